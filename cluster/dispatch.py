"""One request's trip through the cluster: route, open a stream on the chosen backend, fail over.

Shared by the HTTP ingress and the Python driver so both behave the same:

- `open()` asks the router for a backend and waits for the backend's `Admitted`, so a request
  the engine rejects surfaces as `InvalidRequestError` before any response byte is sent.
- If the chosen backend is dead or dies before this request produced a token, the request has
  shown nothing to anyone yet, so it is simply routed again (the router has already dropped
  the backend); this is how a dead backend's queued, unstarted requests are re-routed.
- If it dies after tokens were produced, the stream ends with `BackendUnavailableError` (HTTP 503):
  replaying elsewhere would repeat or change text the client already has.
- `close()` aborts the request on its backend unless it finished, which is what frees the
  blocks of a client that disconnected mid-stream.

Routing calls go out coalesced: the `place` calls of one
event-loop turn share one batch (actors/batching.py), a frame on the router's same-node wire
(actors/wire.py) or, from another node, one `RouterActor.place_many` call, so the router's
cost per call is shared by however many requests arrived together. The router answers with a
backend id, not a handle: an actor handle in a reply is serialized by the router and rebuilt
(and reference-counted with its owner) by the receiver, on every request, a cost that dwarfs
the routing decision (docs/benchmarks/served-path-h200.md). Each process keeps the
backends' handles instead (`BackendHandles`), fetched from the router when it first meets a
backend id.

A request may carry a TTFT deadline (`ttft_deadline_s`) and a priority class (its
SamplingParams'): both go to the router with the placement, and a deadline no backend can meet
ends `open()` with engine/errors.py's `DeadlineUnmetError` (or `InvalidRequestError`, when
even an idle backend would miss it) before any engine work.

`open()` notes when the router answered and when the backend admitted the request, and
`admission_stages` splits a request's time to admission into its stages (the ingress exports
them as `tandem_http_stage_seconds`): where a burst's first tokens wait is a question of which
serial loop holds them, and only a per-stage split answers it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tandem.actors import wire
from tandem.actors.batching import CallBatcher
from tandem.actors.channel import open_stream
from tandem.actors.detached import detached
from tandem.actors.messages import Admitted, Decision, Placement, PlaceRequest
from tandem.engine.errors import (BackendError, BackendGoneError, BackendUnavailableError, DeadlineUnmetError,
                                  InvalidRequestError, TandemError)

logger = logging.getLogger("tandem.dispatch")


class BackendHandles:
    """backend id -> actor handle, one cache per router per process.

    A handle stays valid across Ray's restarts of its actor, so an entry is dropped only when
    its backend failed (it may come back as a new actor with a new handle)."""

    _by_router: dict[Any, BackendHandles] = {}

    def __init__(self, router: Any) -> None:
        self.router = router
        self._handles: dict[str, Any] = {}

    @classmethod
    def of(cls, router: Any) -> BackendHandles:
        key = getattr(router, "_actor_id", None) or id(router)
        cache = cls._by_router.get(key)
        if cache is None:
            cache = cls._by_router[key] = cls(router)
        return cache

    async def get(self, backend_id: str) -> Any:
        handle = self._handles.get(backend_id)
        if handle is None:
            self._handles = dict(await self.router.list_backends.remote())
            handle = self._handles.get(backend_id)
            if handle is None:
                raise BackendUnavailableError(f"backend {backend_id} left before the request reached it; retry it")
        return handle

    def drop(self, backend_id: str) -> None:
        self._handles.pop(backend_id, None)


class RoutedRequest:
    def __init__(self, router: Any, req_id: str, prompt_token_ids: list[int], params: Any,
                 arrival_time: float | None = None, max_attempts: int = 3,
                 ttft_deadline_s: float | None = None) -> None:
        self.router = router
        self.ttft_deadline_s = ttft_deadline_s
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.max_attempts = max_attempts
        self.decision: Decision | None = None
        self.admitted: Admitted | None = None
        self.num_output_tokens = 0
        self.finished = False
        self.attempts = 0
        self.opened_time: float | None = None  # time.time() when `open()` first began routing it
        self.placed_time: float | None = None  # ... when the router answered (the last attempt)
        self.admitted_time: float | None = None  # ... and when the backend admitted it
        self._gen: Any = None
        self._handles = BackendHandles.of(router)

    @property
    def backend_id(self) -> str | None:
        return self.decision.backend_id if self.decision else None

    async def open(self) -> Admitted:
        """Route and start the request; returns once a backend has admitted it."""
        import ray.exceptions

        from tandem.engine.sampling_params import InvalidRequestError

        last_error = "no backend is alive"
        if self.opened_time is None:
            self.opened_time = time.time()
        while self.attempts < self.max_attempts:
            self.attempts += 1
            try:
                placement = await self._place()
                handle = await self._handles.get(placement.backend_id)
                self.placed_time = time.time()
            except BackendUnavailableError as exc:
                raise BackendUnavailableError(f"no backend can take this request: {_cause_message(exc)}") from None
            except (DeadlineUnmetError, InvalidRequestError):
                self.finished = True  # placed nowhere: nothing to forget or abort
                raise
            except (ray.exceptions.RayActorError, wire.WireClosed) as exc:  # the router is gone; nothing restarts it
                raise BackendUnavailableError("the router is unavailable", detail=type(exc).__name__) from None
            self.decision = Decision(self.req_id, placement.backend_id, placement.instance_id,
                                     estimated_s=placement.estimated_s, handle=handle,
                                     projected_ttft_s=placement.projected_ttft_s)
            if self._gen is not None:
                self._gen.close()
            self._gen = open_stream(self.decision.handle, self.req_id, self.prompt_token_ids, self.params,
                                    self.arrival_time)
            try:
                first = await self._gen.next()
            except InvalidRequestError as exc:  # the engine's own checks: messages meant for users
                self.router.forget.remote(self.req_id)
                self.finished = True
                raise InvalidRequestError(_cause_message(exc)) from None
            except (ray.exceptions.RayActorError, BackendGoneError) as exc:
                last_error = f"backend {self.decision.backend_id} failed: {type(exc).__name__}"
                await self._backend_failed(last_error)
                continue
            except BackendError as exc:  # its engine failed before the request's first token
                self.finished = True
                self.router.forget.remote(self.req_id)
                raise BackendUnavailableError(f"backend {self.backend_id} failed while starting the request; retry it",
                                              detail=_cause_message(exc)) from None
            if not isinstance(first, Admitted):
                raise TandemError(f"backend {self.decision.backend_id} could not start the request",
                                  detail=f"it sent {type(first).__name__} before admitting it")
            self.admitted, self.admitted_time = first, time.time()
            return first
        raise BackendUnavailableError(f"the request could not be placed after {self.attempts} attempts; "
                                      "retry it", detail=f"last error: {last_error}")

    def admission_stages(self) -> dict[str, float]:
        """See `admission_stages`; empty before the request was admitted."""
        if self.admitted is None or self.arrival_time is None:
            return {}
        a = self.admitted
        return admission_stages(self.arrival_time, self.placed_time, self.admitted_time, a.outputs,
                                a.received_time, a.queued_time, self.opened_time)

    async def _place(self) -> Placement:
        """The router's `Placement`, from its `place_many`; the request's priority class and TTFT
        deadline go with it."""
        request = PlaceRequest(self.req_id, self.prompt_token_ids, self.params.max_tokens * self.params.n,
                               self.attempts, self.params.priority, self.ttft_deadline_s)
        answer = await _placer(self.router).call(request)
        return msgspec.convert(answer, Placement)  # an array when it came on the wire

    async def outputs(self) -> AsyncIterator[Any]:
        """The request's `RequestOutput`s, re-routing it if its backend dies before a token."""
        import ray.exceptions

        while not self.finished:
            try:
                out = await self._gen.next()
            except StopAsyncIteration:
                raise BackendUnavailableError(f"backend {self.backend_id} ended the request without "
                                              "finishing it; retry it") from None
            except (ray.exceptions.RayActorError, BackendGoneError) as exc:
                message = f"backend {self.backend_id} died while serving request {self.req_id}"
                await self._backend_failed(f"{message}: {type(exc).__name__}")
                if self.num_output_tokens == 0 and self.attempts < self.max_attempts:
                    logger.warning("%s before its first token; routing it again", message)
                    await self.open()
                    continue
                raise BackendUnavailableError(f"{message} after {self.num_output_tokens} tokens; retry "
                                              "the request") from None
            except BackendError as exc:
                raise BackendUnavailableError(f"backend {self.backend_id} failed while serving the request; "
                                              "retry it", detail=_cause_message(exc)) from None
            self.num_output_tokens += len(out.new_token_ids)
            self.finished = out.finished
            yield out

    async def close(self) -> None:
        """Free what the request holds unless it finished (e.g. the client went away): abort it
        on its backend and drop it from the router's ledger. A caller cancelled while its route
        call was in flight has no decision yet, but the router may have placed it all the same,
        so the router hears of it whenever a route was asked for. Both calls are detached from
        the request (actors/detached.py): Serve cancels a request whose client hung up, and Ray
        would cancel an abort sent just before that along with it."""
        if self._gen is not None:
            self._gen.close()
        if self.finished or self.attempts == 0:
            return
        self.finished = True
        try:
            if self.decision is not None:
                detached(self.decision.handle.abort.remote, self.req_id)
            detached(self.router.forget.remote, self.req_id)
        except Exception:  # the backend or router is gone: nothing left to free
            logger.debug("abort of %s after close failed", self.req_id, exc_info=True)

    async def _backend_failed(self, reason: str) -> None:
        decision = self.decision
        self._handles.drop(decision.backend_id)
        try:
            detached(decision.handle.abort.remote, self.req_id)  # in case it is alive after all
            await detached(self.router.backend_failed.remote, decision.backend_id, decision.instance_id, reason)
            await detached(self.router.forget.remote, self.req_id)
        except Exception:  # the router itself is gone: the next route() call reports that
            logger.warning("could not report failure of backend %s", decision.backend_id, exc_info=True)


_placers: dict[tuple[int, Any], wire.WireCaller] = {}


def _placer(router: Any) -> wire.WireCaller:
    """This event loop's coalescer of `place` calls to `router` (`RouterActor.place_many`): on
    the router's node over the same-node wire, elsewhere over Ray."""
    import asyncio

    key = (id(asyncio.get_running_loop()), getattr(router, "_actor_id", None) or id(router))
    placer = _placers.get(key)
    if placer is None or placer.closed:
        placer = _placers[key] = wire.WireCaller(lambda: wire.same_node_address(router),
                                                 CallBatcher(router.place_many))
    return placer


def _cause_message(exc: BaseException) -> str:
    """The original message of an exception Ray re-raised from an actor."""
    cause = getattr(exc, "cause", None)
    return str(cause if cause is not None else exc).strip().splitlines()[-1]


def admission_stages(arrival: float, placed: float, admitted: float, first_outputs: list,
                     received: float | None = None, queued: float | None = None,
                     opened: float | None = None) -> dict[str, float]:
    """Seconds per stage from a request's arrival to its admission (wall clock: stages that
    cross processes compare clocks, which one node shares):

    - `prepare`, where `opened` says when routing began: arrival to then (reading, parsing and
      checking the body, tokenizing);
    - `route`: from then (else from arrival) to the router's answer (the router's round trip,
      the coalescing of the `place` calls included);
    - the add's trip, where the backend stamped it (`Admitted.received_time`/`queued_time`):
      `to_backend` placed to the backend's engine core reading the add off its channel (this
      process's batching and the wire, or over Ray the actor's relay), `to_core` from there to
      the engine queueing it (the core finishing its step in progress); without the stamps both
      count in the next stage;
    - with the first outputs in the admission (`Admitted.outputs`): `to_engine` queued (or
      placed) to first scheduled (its wait in the engine), `prefill` first scheduled to first
      token, and `back` first token to the admission's arrival here;
    - without them (the request queued behind others): `admit`, queued (or placed) to admitted.
    A negative difference (clocks of two nodes) counts as 0.
    """
    stages = {"route": placed - arrival} if opened is None else {"prepare": opened - arrival, "route": placed - opened}
    engine_from = placed
    if received is not None and queued is not None:
        stages.update(to_backend=received - placed, to_core=queued - received)
        engine_from = queued
    if first_outputs:
        first = first_outputs[0]
        first_scheduled, first_token = first.first_scheduled_time, first.first_token_time
        if first_scheduled is not None and first_token is not None:
            stages.update(to_engine=first_scheduled - engine_from, prefill=first_token - first_scheduled,
                          back=admitted - first_token)
            return {k: max(0.0, v) for k, v in stages.items()}
    stages["admit"] = admitted - engine_from
    return {k: max(0.0, v) for k, v in stages.items()}
