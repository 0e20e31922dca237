"""`BackendActor`: one `LLMEngine` on one device, serving many streaming requests at once.

Threading model. The engine is not thread-safe, so exactly one thread touches its mutable
state: a dedicated engine thread that loops "apply queued commands, step, deliver outputs".
The actor itself is an async Ray actor; its methods run on the actor's event loop and talk to
the engine thread through a command queue (add, abort, stats), each command carrying a future
the coroutine awaits. Torch releases the GIL inside kernels, so the event loop keeps answering
(new requests, cache queries, pings) while a step runs, and every generate stream is just an
`asyncio.Queue` the engine thread feeds with `call_soon_threadsafe`.

Progress goes to the router in batches: the engine thread drains `engine.drain_progress()`
after each step and sends it at most every `report_interval_s` (and whenever it goes idle) as
one fire-and-forget `router.report.remote(...)`, never a per-token round trip. The same message
carries each step's token counts and time, which the router may use to calibrate its rates,
and the block hashes the prefix cache published or evicted, which keep the router's mirror of
this backend's cache current: the router never asks a backend anything on its decision path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import os
import queue
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tandem.actors.messages import Admitted, BackendError, BackendInfo
from tandem.actors.metrics import BACKEND_METRICS, Recorder

logger = logging.getLogger("tandem.backend")

IDLE_POLL_S = 0.05
# After a stream's first token, send at most one message per this interval, merging the tokens
# of the steps in between: each streamed item costs the actor about half a millisecond of its
# GIL, which at one item per request per step slowed a GPU backend's served path ~2x.
STREAM_INTERVAL_S = 0.01
# ...and across all its streams at most this many messages per second: with 48 streams, one
# message each per 10 ms would be 4,800 a second, more GIL than the process has. The interval
# grows with the number of streams instead (48 streams: one message each per 96 ms); the first
# token of every stream still goes out at once.
MAX_STREAM_MESSAGES_PER_S = 500.0
STATS_INTERVAL_S = 0.5


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # Engine-thread state: outputs merged but not yet handed over, and when the next hand-over
    # is due (time.monotonic; 0: the first output goes at once).
    pending: Any = None
    next_send: float = 0.0

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class BackendActor:
    def __init__(
        self,
        backend_id: str,
        engine_kwargs: dict[str, Any],
        threads: int,
        requested_device: str = "cpu",
        device_reason: str = "",
        router: Any = None,
        report_interval_s: float = 0.02,
        stream_interval_s: float = STREAM_INTERVAL_S,
        max_stream_messages_per_s: float = MAX_STREAM_MESSAGES_PER_S,
    ) -> None:
        import torch

        from tandem.engine.config import EngineConfig
        from tandem.engine.llm_engine import LLMEngine

        # Ray sets OMP_NUM_THREADS from the actor's num_cpus and reuses workers: set our own.
        torch.set_num_threads(threads)
        self.backend_id = backend_id
        self.instance_id = uuid.uuid4().hex[:12]
        self.stream_interval_s = stream_interval_s
        self.max_stream_messages_per_s = max_stream_messages_per_s
        self.threads = threads
        self.router = router
        self.report_interval_s = report_interval_s
        self.rates: dict[str, Any] | None = None
        config = EngineConfig(**{**engine_kwargs, "num_threads": threads})
        start = time.perf_counter()
        self.engine = LLMEngine(config)
        logger.warning(  # warning: shown under Python's default log level, and said once per start
            "backend %s: device %s (%s), dtype %s, %d torch threads, model %s loaded in %.1f s",
            backend_id, config.device, device_reason or f"requested {requested_device}",
            str(self.engine.dtype).removeprefix("torch."), threads, self.engine.model_name,
            time.perf_counter() - start)
        self.requested_device = requested_device
        self.metrics = Recorder(BACKEND_METRICS, {"backend": backend_id})
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._held: dict[str, _Stream] = {}  # streams with merged outputs waiting for their turn
        # Latest progress per request: reports carry absolute counts, so between two reports
        # only the last state of each request matters (at batch 48 and ~1 ms steps a report
        # would otherwise carry ~20 copies of each).
        self._pending_progress: dict[str, Any] = {}
        self._pending_steps: list[tuple[int, int, int, float]] = []
        self._pending_cache_changes: dict[int, bool] = {}  # block hash -> published / evicted
        self._last_report = 0.0
        self._last_stats = 0.0
        self._stats_totals = (0, 0, 0, 0, 0)
        self._stopping = False
        self._thread = threading.Thread(target=self._engine_loop, name=f"engine-{backend_id}", daemon=True)
        self._thread.start()
        if router is not None and _was_reconstructed():
            # Ray restarted us after a crash: rejoin routing with the rates the router kept.
            self.router.add_backend.remote(self._info(reconstructed=True), _self_handle())

    # -- lifecycle ---------------------------------------------------------------------------
    def _info(self, reconstructed: bool = False) -> BackendInfo:
        cfg = self.engine.config
        return BackendInfo(
            backend_id=self.backend_id, instance_id=self.instance_id, device=str(self.engine.device),
            device_kind=self.engine.device.type, requested_device=self.requested_device,
            dtype=str(self.engine.dtype).removeprefix("torch."), threads=self.threads,
            max_active=cfg.max_active, block_size=cfg.block_size, model_name=self.engine.model_name,
            max_model_len=self.engine.max_model_len, node_id=_node_id(), rates=self.rates,
            reconstructed=reconstructed)

    async def info(self) -> BackendInfo:
        return self._info()

    async def ping(self) -> str:
        return self.instance_id

    async def tokenizer(self) -> Any:
        """The engine's HF tokenizer object (picklable), so the HTTP ingress tokenizes alike."""
        return self.engine.tokenizer

    async def profile(self, max_active: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """Measure this backend's rates (nothing else may run meanwhile); see engine/profiler.py."""
        from tandem.engine.profiler import measure_rates

        if self._streams:
            raise BackendError(f"backend {self.backend_id} is serving requests; profile it idle")
        def measure() -> dict[str, Any]:
            rates = measure_rates(self.engine, max_active or self.engine.config.max_active, **kwargs)
            st = self.engine.get_stats()  # profile tokens are not served tokens: not in the counters
            self._stats_totals = (st.prefix_cache_queries, st.prefix_cache_hits, st.num_prompt_tokens_total,
                                  st.num_generation_tokens_total, st.num_preemptions)
            return rates

        return await self._call(measure)

    async def register(self, rates: dict[str, Any] | None) -> BackendInfo:
        """Join routing with these rates (routing's RateProfile fields) and a snapshot of the
        prefix cache, which later reports update."""
        self.rates = rates
        info = self._info()
        if self.router is not None:
            snapshot = await self._call(self._cache_snapshot)
            await self.router.add_backend.remote(info, _self_handle(), snapshot)
        return info

    async def set_max_active(self, max_active: int) -> BackendInfo:
        """Run at most `max_active` requests at once from now on (up to the limit this engine was
        built with), and tell the router so its cost model uses the new batch size."""
        await self._call(lambda: self.engine.set_max_active(max_active))
        if self.router is not None:
            await self.router.set_max_active.remote(self.backend_id, max_active)
        return self._info()

    def _cache_snapshot(self) -> list[int]:
        self.engine.drain_cache_changes()  # the snapshot supersedes them
        self._pending_cache_changes = {}
        return self.engine.cached_block_hashes()

    async def shutdown(self) -> None:
        self._stopping = True
        for stream in list(self._streams.values()):
            stream.put(BackendError(f"backend {self.backend_id} is shutting down"))

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, req_id: str, prompt_token_ids: list[int], params: Any,
                       arrival_time: float | None = None) -> AsyncIterator[Any]:
        """Stream `Admitted`, then one `RequestOutput` per step that produced tokens, the last
        one `finished`. Raises InvalidRequestError before `Admitted` if the engine rejects it.
        Closing the stream early (caller cancelled) aborts the request and frees its blocks."""
        if req_id in self._streams:
            from tandem.engine.sampling_params import InvalidRequestError

            raise InvalidRequestError(f"request id {req_id!r} is already running on {self.backend_id}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[req_id] = stream
        finished = False
        try:
            fn = lambda: self.engine.add_request(req_id, prompt_token_ids, params, arrival_time)  # noqa: E731
            num_prompt_tokens = await self._call(fn)
            yield Admitted(req_id, self.backend_id, num_prompt_tokens)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                item, pending_error = _coalesce(item, stream.queue)
                finished = item.finished
                yield item
                if pending_error is not None:
                    raise pending_error
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                # Cancelled at any moment, even while the add was queued or running: commands run
                # in order on the engine thread, so this abort follows the add; aborting a request
                # the engine never took is a no-op.
                self._commands.put(lambda: self.engine.abort_request(req_id))

    def _stream_interval(self) -> float:
        """Seconds until a stream's next message: the configured interval, stretched so that all
        streams together stay within `max_stream_messages_per_s` (0: no limit)."""
        if self.max_stream_messages_per_s <= 0:
            return self.stream_interval_s
        return max(self.stream_interval_s, len(self._streams) / self.max_stream_messages_per_s)

    async def abort(self, req_id: str) -> bool:
        return await self._call(lambda: self.engine.abort_request(req_id))

    async def num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """This engine's own prefix-hit answer (diagnostics; the router uses its mirror)."""
        return await self._call(lambda: self.engine.num_cached_tokens(prompt_token_ids))

    async def stats(self) -> Any:
        return await self._call(lambda: copy.deepcopy(self.engine.get_stats()))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            # The awaiting coroutine may have been cancelled (its client hung up): then the future
            # is cancelled too, and nobody wants the result. Setting one would raise
            # InvalidStateError here, in the engine thread, where it would fail every stream.
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn()
            except Exception as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._commands.put(command)
        return await asyncio.wrap_future(future)

    # -- the engine thread -------------------------------------------------------------------
    def _engine_loop(self) -> None:
        num_failures = 0
        while not self._stopping:
            try:
                self._loop_once()
                num_failures = 0
            except Exception:  # a bug or device error: fail the requests, keep serving
                num_failures += 1
                self._fail_all(traceback.format_exc())
                if num_failures >= 3:
                    logger.error("backend %s: engine loop failed 3 times in a row; exiting so Ray restarts it",
                                 self.backend_id)
                    os._exit(1)

    def _loop_once(self) -> None:
        busy = self.engine.has_unfinished_requests()
        self._apply_commands(block=not busy)
        if not self.engine.has_unfinished_requests():
            self._after_idle()
            return
        start = time.perf_counter()
        outputs = self.engine.step()
        self._deliver(outputs)
        # Timed with the hand-off: the router's calibration wants how fast this backend drains
        # work as served (the step loop's whole turn), not the model alone.
        self._after_step(time.perf_counter() - start, outputs)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, command: Callable[[], None]) -> None:
        """One request's bookkeeping must never fail the loop that serves everyone else."""
        try:
            command()
        except Exception:
            logger.exception("backend %s: a command failed; the engine keeps serving", self.backend_id)

    def _deliver(self, outputs: list) -> None:
        """Merge a step's outputs into their streams and hand over those that are due, with one
        wake-up of the event loop, not one per request. Pacing happens here, in the engine
        thread: a stream's coroutine wakes only to send, not on every step to wait (48 woken
        coroutines per step cost the engine more GIL than the messages themselves)."""
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is not None:
                stream.pending = out if stream.pending is None else stream.pending.merge(out)
                self._held[out.req_id] = stream
        due = [(req_id, stream) for req_id, stream in self._held.items()
               if stream.pending.finished or now >= stream.next_send]
        if not due:
            return
        interval = self._stream_interval()
        deliveries = []
        for req_id, stream in due:
            del self._held[req_id]
            deliveries.append((stream, stream.pending))
            stream.pending, stream.next_send = None, now + interval
        deliveries[0][0].loop.call_soon_threadsafe(_put_all, deliveries)

    def _fail_all(self, trace: str) -> None:
        logger.error("backend %s: engine loop failed:\n%s", self.backend_id, trace)
        error = BackendError(f"backend {self.backend_id}: engine failed: {trace.strip().splitlines()[-1]}")
        self._held.clear()  # outputs not yet handed over: the error replaces them
        for req_id, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self.engine.abort_request(req_id)
            except Exception:  # the engine is in a bad state; the stream already has its error
                logger.exception("backend %s: abort of %s after a failed step", self.backend_id, req_id)

    def _after_step(self, elapsed: float, outputs: list) -> None:
        self.metrics.observe("tandem_backend_step_time_seconds", elapsed)
        self.metrics.inc("tandem_backend_steps")
        for out in outputs:
            if out.finished:
                self._record_finished(out)
        st = self.engine.get_stats()
        # (prefill tokens, decode tokens, batch size, seconds): the router's online calibration.
        batch_size = st.step_decode_tokens or len(outputs)  # a decode step gives each request one token
        self._pending_steps.append((st.step_prefill_tokens, st.step_decode_tokens, batch_size, elapsed))
        now = time.monotonic()
        self._pending_progress.update((p.req_id, p) for p in self.engine.drain_progress())
        self._pending_cache_changes.update(self.engine.drain_cache_changes())
        if now - self._last_report >= self.report_interval_s:
            self._report(now)
        if now - self._last_stats >= STATS_INTERVAL_S:
            self._record_stats(now)

    def _after_idle(self) -> None:
        now = time.monotonic()
        self._pending_progress.update((p.req_id, p) for p in self.engine.drain_progress())
        self._pending_cache_changes.update(self.engine.drain_cache_changes())
        if self._pending_progress or self._pending_steps or self._pending_cache_changes:
            self._report(now)
        if now - self._last_stats >= STATS_INTERVAL_S:
            self._record_stats(now)

    def _report(self, now: float) -> None:
        self._last_report = now
        if not (self._pending_progress or self._pending_steps or self._pending_cache_changes):
            return
        progress, self._pending_progress = list(self._pending_progress.values()), {}
        steps, self._pending_steps = self._pending_steps, []
        cache_changes, self._pending_cache_changes = self._pending_cache_changes, {}
        if self.router is not None:
            self.router.report.remote(self.backend_id, self.instance_id, progress, steps, cache_changes)

    def _record_finished(self, out: Any) -> None:
        self.metrics.inc("tandem_backend_requests_finished", tags={"finish_reason": out.finish_reason or "unknown"})
        if out.finish_reason == "abort":
            return
        if out.first_token_time is not None:
            self.metrics.observe("tandem_backend_ttft_seconds", max(0.0, out.first_token_time - out.arrival_time))
        if out.first_scheduled_time is not None:
            self.metrics.observe("tandem_backend_queue_time_seconds",
                                 max(0.0, out.first_scheduled_time - out.arrival_time))
        if out.finished_time is not None:
            self.metrics.observe("tandem_backend_e2e_seconds", max(0.0, out.finished_time - out.arrival_time))

    def _record_stats(self, now: float) -> None:
        self._last_stats = now
        st = self.engine.get_stats()
        m = self.metrics
        m.set("tandem_backend_up", 1)
        m.set("tandem_backend_running_requests", st.num_running)
        m.set("tandem_backend_waiting_requests", st.num_waiting)
        m.set("tandem_backend_kv_cache_usage", st.kv_cache_usage)
        m.set("tandem_backend_kv_cache_free_blocks", st.num_free_blocks)
        totals = (st.prefix_cache_queries, st.prefix_cache_hits, st.num_prompt_tokens_total,
                  st.num_generation_tokens_total, st.num_preemptions)
        names = ("tandem_backend_prefix_cache_queries", "tandem_backend_prefix_cache_hits",
                 "tandem_backend_prompt_tokens", "tandem_backend_generation_tokens",
                 "tandem_backend_preemptions")
        for name, new, old in zip(names, totals, self._stats_totals):
            m.inc(name, new - old)
        self._stats_totals = totals


def _put_all(deliveries: list[tuple[_Stream, Any]]) -> None:
    for stream, out in deliveries:
        stream.queue.put_nowait(out)


def _coalesce(item: Any, queue: asyncio.Queue) -> tuple[Any, BaseException | None]:
    """Merge the outputs already waiting behind `item` into it, so a stream whose consumer fell
    behind sends one message per catch-up rather than one per engine step (Ray's per-item cost
    otherwise caps a backend's served tokens/s far below what its engine produces). An error
    found while draining is returned to be raised after the merged output is sent."""
    while not item.finished and not queue.empty():
        following = queue.get_nowait()
        if isinstance(following, BaseException):
            return item, following
        item = item.merge(following)
    return item, None


def _was_reconstructed() -> bool:
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its own deprecation warning
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed


def _self_handle() -> Any:
    import warnings

    import ray

    with warnings.catch_warnings():  # Ray's own property trips its own deprecation warning
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().current_actor


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # not inside Ray (unit tests): no node
        return ""
