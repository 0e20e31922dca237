"""One request's trip through the cluster: route, open a stream on the chosen backend, fail over.

Shared by the HTTP ingress and the Python driver so both behave the same:

- `open()` asks the router for a backend and waits for the backend's `Admitted`, so a request
  the engine rejects surfaces as `InvalidRequest` before any response byte is sent.
- If the chosen backend is dead or dies before this request produced a token, the request has
  shown nothing to anyone yet, so it is simply routed again (the router has already dropped
  the backend); this is how a dead backend's queued, unstarted requests are re-routed.
- If it dies after tokens were produced, the stream ends with `BackendUnavailable` (HTTP 503):
  replaying elsewhere would repeat or change text the client already has.
- `close()` aborts the request on its backend unless it finished, which is what frees the
  blocks of a client that disconnected mid-stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from tandem.actors.messages import Admitted, BackendError, Decision

logger = logging.getLogger("tandem.dispatch")


class RequestFailed(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidRequest(RequestFailed):
    status_code = 400
    error_type = "invalid_request_error"


class BackendUnavailable(RequestFailed):
    status_code = 503
    error_type = "service_unavailable"


class RequestStream:
    def __init__(self, router: Any, req_id: str, prompt_token_ids: list[int], params: Any,
                 arrival_time: float | None = None, max_attempts: int = 3) -> None:
        self.router = router
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
        self._gen: Any = None

    @property
    def backend_id(self) -> str | None:
        return self.decision.backend_id if self.decision else None

    async def open(self) -> Admitted:
        """Route and start the request; returns once a backend has admitted it."""
        import ray.exceptions

        from tandem.actors.router import NoBackendAvailable
        from tandem.engine.sampling_params import InvalidRequestError

        last_error = "no backend is alive"
        while self.attempts < self.max_attempts:
            self.attempts += 1
            try:
                self.decision = await self.router.route.remote(
                    self.req_id, self.prompt_token_ids, self.params.max_tokens, self.attempts)
            except NoBackendAvailable as exc:
                raise BackendUnavailable(f"no backend can take this request: {_cause_message(exc)}") from None
            self._gen = self.decision.handle.generate.options(num_returns="streaming").remote(
                self.req_id, self.prompt_token_ids, self.params, self.arrival_time)
            try:
                first = await (await self._gen.__anext__())
            except InvalidRequestError as exc:
                self.router.forget.remote(self.req_id)
                raise InvalidRequest(_cause_message(exc)) from None
            except ray.exceptions.RayActorError as exc:
                last_error = f"backend {self.decision.backend_id} failed: {type(exc).__name__}"
                await self._backend_failed(last_error)
                continue
            if not isinstance(first, Admitted):
                raise RequestFailed(f"backend {self.decision.backend_id} sent {type(first).__name__} "
                                    "before admitting the request")
            self.admitted = first
            return first
        raise BackendUnavailable(f"request {self.req_id} could not be placed after "
                                 f"{self.attempts} attempts; last error: {last_error}")

    async def outputs(self) -> AsyncIterator[Any]:
        """The request's `RequestOutput`s, re-routing it if its backend dies before a token."""
        import ray.exceptions

        while not self.finished:
            try:
                out = await (await self._gen.__anext__())
            except StopAsyncIteration:
                raise BackendUnavailable(f"backend {self.backend_id} ended request {self.req_id} "
                                         "without finishing it") from None
            except ray.exceptions.RayActorError as exc:
                message = f"backend {self.backend_id} died while serving request {self.req_id}"
                await self._backend_failed(f"{message}: {type(exc).__name__}")
                if self.num_output_tokens == 0 and self.attempts < self.max_attempts:
                    logger.warning("%s before its first token; routing it again", message)
                    await self.open()
                    continue
                raise BackendUnavailable(f"{message} after {self.num_output_tokens} tokens; retry "
                                         "the request") from None
            except BackendError as exc:
                raise BackendUnavailable(_cause_message(exc)) from None
            self.num_output_tokens += len(out.new_token_ids)
            self.finished = out.finished
            yield out

    async def close(self) -> None:
        """Abort the request on its backend unless it finished (e.g. the client went away)."""
        if self.finished or self.decision is None:
            return
        self.finished = True
        try:
            self.decision.handle.abort.remote(self.req_id)
            self.router.forget.remote(self.req_id)
        except Exception:  # the backend or router is gone: nothing left to free
            logger.debug("abort of %s after close failed", self.req_id, exc_info=True)

    async def _backend_failed(self, reason: str) -> None:
        decision = self.decision
        try:
            decision.handle.abort.remote(self.req_id)  # in case it is alive after all
            await self.router.backend_failed.remote(decision.backend_id, decision.instance_id, reason)
            await self.router.forget.remote(self.req_id)
        except Exception:  # the router itself is gone: the next route() call reports that
            logger.warning("could not report failure of backend %s", decision.backend_id, exc_info=True)


def _cause_message(exc: BaseException) -> str:
    """The original message of an exception Ray re-raised from an actor."""
    cause = getattr(exc, "cause", None)
    return str(cause if cause is not None else exc).strip().splitlines()[-1]
