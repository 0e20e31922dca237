"""`BackendActor`: the Ray actor in charge of one engine core, the control plane of one backend.

Process layout. The engine runs in its own OS process, the engine core (actors/engine_core.py),
whose loop is "take commands, step, post the step's news" with no asyncio and no Ray, so its
steps never wait for this process's GIL. The core also serves its callers' channels itself:
a caller on this node connects to the core's socket (the address `wire_address` returns) and
its requests' data never passes through this actor. This actor is the backend's control plane,
made of two parts, one concern each:

- `CoreClient` (actors/core_client.py): the core's lifecycle and the core pipe: start it, send
  it control calls, read its one message per step on a reader thread, and notice its death,
  which makes this actor exit so that Ray restarts the backend with a fresh core;
- `ProgressReporter` (actors/progress_reporter.py): the router's batched progress reports and
  this backend's metrics, from the core's per-step messages.

A caller on another node cannot reach the core's socket: it uses `add_many` (sent one-way) and
one `subscribe` stream per channel over Ray, which this actor relays to the core as a channel
of its own (actors/relay.py), frames passed on undecoded. Ray is the control plane: placement,
health, restarts, registration with the router, aborts, stats and profiling.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tandem.actors import wire
from tandem.actors.core_client import CoreClient
from tandem.actors.messages import BackendInfo, EngineCoreFailed, EngineCoreOutputs, Message
from tandem.actors.progress_reporter import ProgressReporter
from tandem.actors.relay import Relay
from tandem.engine.errors import BackendError

logger = logging.getLogger("tandem.backend")


class BackendActor:
    def __init__(self, backend_id: str, engine_kwargs: dict[str, Any], threads: int, requested_device: str = "cpu",
                 device_reason: str = "", router: Any = None, report_interval_s: float = 0.02) -> None:
        self.backend_id = backend_id
        self.instance_id = uuid.uuid4().hex[:12]
        self.threads = threads
        self.requested_device = requested_device
        self.rates: dict[str, Any] | None = None
        self.emulated_kind = (engine_kwargs.get("sim_profile") or {}).get("device_kind", "")
        self.core = CoreClient(backend_id, {**engine_kwargs, "num_threads": threads})
        ready = self.core.ready
        logger.warning(  # warning: shown under Python's default log level, and said once per start
            "backend %s: device %s (%s), dtype %s, %s kernels, %d torch thread%s, max_active %d, KV cache %d tokens, "
            "model %s loaded in %.1f s (engine core pid %d)",
            backend_id, ready.device, device_reason or f"requested {requested_device}", ready.dtype,
            ready.cpu_kernels if ready.device_kind == "cpu" else ready.device_kind,
            threads, "" if threads == 1 else "s", ready.max_active, ready.num_kv_tokens, ready.model_name,
            ready.load_s, ready.pid)
        self.max_active = ready.max_active
        self.reporter = ProgressReporter(backend_id, self.instance_id, _router_handle(router), report_interval_s)
        self.relays: dict[str, Relay] = {}  # remote callers' channels, by channel id
        self.stopping = False
        self.core.start_reading(self._on_message, self._core_exited)
        if router is not None and _was_reconstructed():
            # Ray restarted us after a crash: rejoin routing with the rates the router kept.
            self.reporter.router.add_backend.remote(self._info(reconstructed=True), _self_handle())

    # -- lifecycle and control -------------------------------------------------------------------
    def _info(self, reconstructed: bool = False) -> BackendInfo:
        e = self.core.ready
        return BackendInfo(
            backend_id=self.backend_id, instance_id=self.instance_id, device=e.device, device_kind=e.device_kind,
            requested_device=self.requested_device, dtype=e.dtype, threads=self.threads, max_active=self.max_active,
            block_size=e.block_size, model_name=e.model_name, max_model_len=e.max_model_len, node_id=wire.node_id(),
            rates=self.rates, reconstructed=reconstructed, num_kv_tokens=e.num_kv_tokens,
            cpu_kernels=e.cpu_kernels if e.device_kind == "cpu" else "", shared_device=physical_device(e.device_kind),
            max_priority_wait_s=e.max_priority_wait_s, emulated_kind=self.emulated_kind)

    async def info(self) -> BackendInfo:
        return self._info()

    async def ping(self) -> str:
        return self.instance_id

    async def core_pid(self) -> int:
        """The engine core's process id (tests check it dies with this actor and serves the wire)."""
        return self.core.pid

    async def num_channel_requests(self) -> int:
        """Requests the core's channels still hold (not finished, not aborted): zero when idle."""
        return await self.core.call("num_channel_requests")

    async def tokenizer(self) -> Any:
        """The engine's HF tokenizer object (picklable), so the HTTP ingress tokenizes alike."""
        return self.core.ready.tokenizer

    async def profile(self, max_active: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """Measure this backend's rates (nothing else may run meanwhile); see engine/profiler.py."""
        rates, totals = await self.core.call("profile", max_active, kwargs)
        self.reporter.totals = totals  # profile tokens are not served tokens: not in the counters
        return rates

    async def register(self, rates: dict[str, Any] | None) -> BackendInfo:
        """Join routing with these rates (routing's RateProfile fields) and a snapshot of the
        prefix cache, which later reports update."""
        self.rates = rates
        info = self._info()
        if self.reporter.router is not None:
            snapshot = await self.core.call("cache_snapshot")
            self.reporter.drop_cache_changes()
            await self.reporter.router.add_backend.remote(info, _self_handle(), snapshot)
        return info

    async def set_max_active(self, max_active: int) -> BackendInfo:
        """Run at most `max_active` requests at once from now on (up to the limit this engine was
        built with), and tell the router so its cost model uses the new batch size."""
        await self.core.call("set_max_active", max_active)
        self.max_active = max_active
        if self.reporter.router is not None:
            await self.reporter.router.set_max_active.remote(self.backend_id, max_active)
        return self._info()

    async def shutdown(self) -> None:
        """Fail every request and stop the engine core (the actor itself stays up)."""
        self.stopping = True
        self.core.stop()
        for relay in self.relays.values():
            relay.close()

    async def abort(self, req_id: str) -> bool:
        """Abort a request: its channel gets a last output whose reason is "abort" (a caller that
        gave up on a batched add sends this, since cancelling it does not reach the add)."""
        return await self.core.call("abort", req_id)

    async def num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """This engine's own prefix-hit answer (diagnostics; the router uses its mirror)."""
        return await self.core.call("num_cached_tokens", prompt_token_ids)

    async def stats(self) -> Any:
        return await self.core.call("stats")

    # -- requests: a caller on another node, relayed to the core's channels -------------------
    async def add_many(self, channel_id: str, adds: bytes) -> None:
        """Admit the requests of an encoded `ChannelAdds`, whose outputs go to `channel_id`'s
        `subscribe` stream. Nothing is returned: each request's answer is its first item on that
        stream, `Admitted` (with its first outputs if they come within a step) or a `Refusal`
        (InvalidRequestError if the engine rejects it, BackendError if it cannot start). Callers
        send this one-way (actors/batching.py): an admission rides the channel's next batch."""
        self._relay(channel_id).add(adds)

    async def subscribe(self, channel_id: str) -> AsyncIterator[bytes]:
        """The admissions and outputs of every request added with `channel_id`: the core's
        `ChannelBatch` frames as they arrive, several to an item when they pile up (the caller's
        `wire.FrameSplitter` takes them apart). Ends when the caller closes it, which aborts
        that channel's unfinished requests."""
        relay = self._relay(channel_id)
        try:
            async for batch in relay.batches():
                yield batch
        finally:
            relay.close()
            if self.relays.get(channel_id) is relay:
                del self.relays[channel_id]

    def _relay(self, channel_id: str) -> Relay:
        relay = self.relays.get(channel_id)
        if relay is None:
            if self.stopping:
                raise BackendError(f"backend {self.backend_id} is not taking requests")
            relay = self.relays[channel_id] = Relay(channel_id, self.core.ready.wire_address)
        return relay

    async def wire_address(self) -> tuple[str, tuple[str, bytes]]:
        """(node id, address) of the engine core's channel server, which a caller on the same node
        connects to instead of calling `add_many` + `subscribe`."""
        return wire.node_id(), self.core.ready.wire_address

    # -- the core reader thread ------------------------------------------------------------------
    def _on_message(self, message: Message) -> None:
        if isinstance(message, EngineCoreOutputs):
            self.core.answer(message.replies)
            self.reporter.on_step(message)
        elif isinstance(message, EngineCoreFailed):  # the core failed the step's requests itself
            logger.error("backend %s: engine step failed:\n%s", self.backend_id, message.traceback)

    def _core_exited(self) -> None:
        if self.stopping:
            return
        code = self.core.exitcode()
        logger.error("backend %s: engine core exited (code %s); exiting so Ray restarts this backend",
                     self.backend_id, code)
        self.core.fail_calls(BackendError(f"backend {self.backend_id}: engine core exited (code {code})"))
        time.sleep(0.2)  # let the event loop hand the errors over before the process goes
        os._exit(1)


def _was_reconstructed() -> bool:
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its own deprecation warning
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed


def _router_handle(router: Any) -> Any:
    """The router as a handle, or as (name, namespace). The launcher passes the name: a handle
    among a restartable actor's arguments travels by reference, and Ray logs an error that
    restarts could fail."""
    if not isinstance(router, tuple):
        return router
    import ray

    name, namespace = router
    return ray.get_actor(name, namespace=namespace)


def _self_handle() -> Any:
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its own deprecation warning
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().current_actor


def physical_device(device_kind: str) -> str:
    """The accelerator this actor's engine runs on, named across the cluster: its node and the
    GPU ids Ray assigned to the actor (the engine core inherits them). "" for a cpu backend,
    whose threads are its own, and outside Ray."""
    import ray

    if device_kind in ("cpu", "sim") or not ray.is_initialized():  # a sim device is its own, emulated
        return ""
    ids = ",".join(str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", []))
    return f"{wire.node_id()}/{device_kind}:{ids}"
