"""`BackendActor`: the serving front of one engine core, streaming many requests at once.

Process layout. The engine runs in its own OS process, the engine core (actors/engine_core.py),
whose loop is "take commands, step, send outputs" with no asyncio and no Ray. This actor is its
thin front, an async Ray actor: it starts the core, forwards add/abort/stats/set_max_active/
profile and cache queries to it over a pipe, and fans the core's one-message-per-step output
out to the request streams. Serving work (Ray calls, streams, router reports, metrics) runs on
this process's GIL, so it never holds up the engine's next step.

Threads of this process: the actor's event loop (Ray calls, streams) and a reader thread that
receives the core's messages and does, per step, everything a step implies: merge and pace
the outputs, hand them to the event loop with one wake-up, answer the commands' futures, batch
the router's progress report and record the metrics.

Two ways to stream:
- `generate` (one Ray streaming generator per request): `Admitted`, then `RequestOutput`s.
  Used by the warm-up and benchmarks, and simple to drive by hand.
- a channel (one multiplexed stream per caller process, see actors/channel.py): every request
  the caller adds with that channel id comes back on it, first its admission, then its
  outputs, in one `ChannelBatch` of every request's news per step. On this node the channel is
  a connection to this actor's same-node wire (`wire_address`, actors/wire.py: a Unix socket, a
  frame per batch each way); from another node it is `add_many` (sent one-way) plus one
  `subscribe` stream carrying the same messages as bytes, so Ray's per-call and per-item costs
  are paid per step and per batch of adds, never per request. The serving path
  (cluster/dispatch.py) uses channels.

Pacing: a request's first output goes at once, and so does its last; in between, outputs are
merged and sent at most every interval. For `generate` streams that is `stream_interval_s`;
for a channel's requests it grows with the channel's open requests (0.25 ms each, at most
20 ms), because what a caller pays per message (a wake-up, an SSE chunk, a socket write) is
what limits a caller with many streams, while a caller with few gets every step. A channel's
batch goes out every step that has something due, and its consumer also merges what it has not
read yet, so a caller that falls behind reads fewer, larger messages.

Progress goes to the router in batches: at most every `report_interval_s` (and when the engine
goes idle) as one fire-and-forget `router.report.remote(...)` carrying the latest state of each
request, each step's token counts and time, and the block hashes the prefix cache published or
evicted, which keep the router's mirror of this backend's cache current.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tandem.actors import engine_core as core
from tandem.actors import wire
from tandem.actors.messages import (AddReply, Admitted, BackendInfo, CallReply, ChannelBatch, ChannelOpen,
                                    EngineCoreAbort, EngineCoreCall, EngineCoreFailed, EngineCoreOutput,
                                    EngineCoreOutputs, EngineCoreRequest, Message, Refusal, StatsTotals, decode,
                                    encode, merge_core_outputs)
from tandem.actors.metrics import BACKEND_METRICS, Recorder
from tandem.engine.errors import BackendError, InvalidRequestError
from tandem.engine.outputs import merge_outputs

logger = logging.getLogger("tandem.backend")

# A `generate` stream's pacing: after its first output, at most one message per interval.
STREAM_INTERVAL_S = 0.01
# ...stretched with the number of streams to stay within a message budget (0: none), but never
# past this: a stream always receives its tokens within 20 ms.
MAX_STREAM_DELAY_S = 0.02
MAX_STREAM_MESSAGES_PER_S = 0.0
# A channel request's pacing: after its first output, one hand-over per this many seconds per
# request of its channel (64 streams in one caller: 16 ms), at most MAX_STREAM_DELAY_S.
CHANNEL_PACE_PER_STREAM_S = 0.00025
CORE_START_TIMEOUT_S = 600.0


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # Reader-thread state: outputs not yet handed over, and when the next hand-over is due
    # (time.monotonic; 0: the first output goes at once).
    pending: list = field(default_factory=list)
    next_send: float = 0.0


@dataclass
class _Channel:
    """One caller process's multiplexed stream: the batches its `subscribe` has not sent yet."""

    loop: asyncio.AbstractEventLoop | None = None  # set by `subscribe`
    pending: list = field(default_factory=list)  # event-loop side
    wake: asyncio.Event | None = None
    req_ids: set = field(default_factory=set)
    closed: bool = False
    early: list = field(default_factory=list)  # outputs that came before `subscribe` did
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Reader-thread side: each request's outputs not handed over yet, and when its next
    # hand-over is due (time.monotonic; absent: its first output goes at once).
    held: dict = field(default_factory=dict)
    next_send: dict = field(default_factory=dict)

    def take_due(self, now: float) -> list:
        """The held outputs due now, merged per request: finished ones, and the rest once their
        interval has passed. The interval grows with this caller's streams, so a caller with
        many pays per message for several steps' tokens, while a stream never waits longer
        than MAX_STREAM_DELAY_S (or a step, when steps are slower)."""
        interval = min(MAX_STREAM_DELAY_S, len(self.req_ids) * CHANNEL_PACE_PER_STREAM_S)
        due = []
        for req_id, pending in list(self.held.items()):
            finished = pending[-1].finished
            if finished or now >= self.next_send.get(req_id, 0.0):
                self.held.pop(req_id, None)  # pop: the event loop may have dropped it meanwhile
                if finished:
                    self.next_send.pop(req_id, None)
                else:
                    self.next_send[req_id] = now + interval
                due.extend(merge_core_outputs(pending))
        return due

    def drop(self, req_id: str) -> None:
        self.req_ids.discard(req_id)
        self.held.pop(req_id, None)
        self.next_send.pop(req_id, None)


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
        self.backend_id = backend_id
        self.instance_id = uuid.uuid4().hex[:12]
        self.stream_interval_s = stream_interval_s
        self.max_stream_messages_per_s = max_stream_messages_per_s
        self.threads = threads
        self.router = _router_handle(router)
        self.report_interval_s = report_interval_s
        self.requested_device = requested_device
        self.rates: dict[str, Any] | None = None
        self.core = core.CoreProcess({**engine_kwargs, "num_threads": threads}, name=f"engine-core-{backend_id}")
        ready = self.core.wait_ready(CORE_START_TIMEOUT_S)
        self.engine_info = ready
        logger.warning(  # warning: shown under Python's default log level, and said once per start
            "backend %s: device %s (%s), dtype %s, %s kernels, %d torch threads, max_active %d, KV cache %d tokens, "
            "model %s loaded in %.1f s (engine core pid %d)",
            backend_id, ready.device, device_reason or f"requested {requested_device}", ready.dtype,
            ready.cpu_kernels if ready.device_kind == "cpu" else ready.device_kind, threads,
            ready.max_active, ready.num_kv_tokens, ready.model_name, ready.load_s, ready.pid)
        self.max_active = ready.max_active
        self.metrics = Recorder(BACKEND_METRICS, {"backend": backend_id})
        self._streams: dict[str, _Stream] = {}
        self._held: dict[str, _Stream] = {}  # streams with merged outputs waiting for their turn
        self._channels: dict[str, _Channel] = {}
        self._channel_of: dict[str, _Channel] = {}  # req_id -> its channel
        self._holding: dict[int, _Channel] = {}  # channels with held outputs (reader thread)
        # A channel add's call id -> (request id, its channel, when this actor took it); once
        # the engine queued it, its admission waits for its first outputs in `_awaiting_first`:
        # request id -> (channel, prompt tokens, time taken, time queued).
        self._admitting: dict[int, tuple[str, _Channel, float]] = {}
        self._awaiting_first: dict[str, tuple[_Channel, int, float, float]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        # Latest progress per request: reports carry absolute counts, so between two reports
        # only the last state of each request matters.
        self._pending_progress: dict[str, Any] = {}
        self._pending_steps: list[Any] = []
        self._pending_cache_changes: dict[int, bool] = {}
        self._last_report = 0.0
        self._stats_totals = StatsTotals(0, 0, 0.0, 0, 0, 0, 0, 0, 0)
        self._stopping = False
        self._wire: wire.WireServer | None = None
        self._reader = threading.Thread(target=self._read_core, name=f"core-reader-{backend_id}", daemon=True)
        self._reader.start()
        if router is not None and _was_reconstructed():
            # Ray restarted us after a crash: rejoin routing with the rates the router kept.
            self.router.add_backend.remote(self._info(reconstructed=True), _self_handle())

    # -- lifecycle ---------------------------------------------------------------------------
    def _info(self, reconstructed: bool = False) -> BackendInfo:
        e = self.engine_info
        return BackendInfo(
            backend_id=self.backend_id, instance_id=self.instance_id, device=e.device,
            device_kind=e.device_kind, requested_device=self.requested_device, dtype=e.dtype,
            threads=self.threads, max_active=self.max_active, block_size=e.block_size,
            model_name=e.model_name, max_model_len=e.max_model_len, node_id=wire.node_id(), rates=self.rates,
            reconstructed=reconstructed)

    async def info(self) -> BackendInfo:
        return self._info()

    async def ping(self) -> str:
        return self.instance_id

    async def core_pid(self) -> int:
        """The engine core's process id (tests check it dies with this actor)."""
        return self.core.pid

    async def tokenizer(self) -> Any:
        """The engine's HF tokenizer object (picklable), so the HTTP ingress tokenizes alike."""
        return self.engine_info.tokenizer

    async def profile(self, max_active: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """Measure this backend's rates (nothing else may run meanwhile); see engine/profiler.py."""
        if self._streams or self._channel_of:
            raise BackendError(f"backend {self.backend_id} is serving requests; profile it idle")
        rates, totals = await self._call("profile", max_active, kwargs)
        self._stats_totals = totals  # profile tokens are not served tokens: not in the counters
        return rates

    async def register(self, rates: dict[str, Any] | None) -> BackendInfo:
        """Join routing with these rates (routing's RateProfile fields) and a snapshot of the
        prefix cache, which later reports update."""
        self.rates = rates
        info = self._info()
        if self.router is not None:
            snapshot = await self._call("cache_snapshot")
            self._pending_cache_changes = {}  # the snapshot supersedes them
            await self.router.add_backend.remote(info, _self_handle(), snapshot)
        return info

    async def set_max_active(self, max_active: int) -> BackendInfo:
        """Run at most `max_active` requests at once from now on (up to the limit this engine was
        built with), and tell the router so its cost model uses the new batch size."""
        await self._call("set_max_active", max_active)
        self.max_active = max_active
        if self.router is not None:
            await self.router.set_max_active.remote(self.backend_id, max_active)
        return self._info()

    async def shutdown(self) -> None:
        """Fail every stream and stop the engine core (the actor itself stays up)."""
        self._stopping = True
        self._fail_streams(BackendError(f"backend {self.backend_id} is shutting down"))
        self.core.stop()
        if self._wire is not None:
            self._wire.close()

    # -- requests: one stream per request -----------------------------------------------------
    async def generate(self, req_id: str, prompt_token_ids: list[int], params: Any,
                       arrival_time: float | None = None) -> AsyncIterator[Any]:
        """Stream `Admitted`, then `RequestOutput`s (each merging the steps since the last), the
        last one `finished`. Raises InvalidRequestError before `Admitted` if the engine rejects it.
        Closing the stream early (caller cancelled) aborts the request and frees its blocks."""
        self._check_new(req_id)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[req_id] = stream
        finished = False
        try:
            num_prompt_tokens = await self._add(EngineCoreRequest(req_id, prompt_token_ids, params, arrival_time))
            yield Admitted(req_id, self.backend_id, num_prompt_tokens)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                items, pending_error = _coalesce(item, stream.queue)
                for item in items:
                    finished = item.finished
                    yield item
                if pending_error is not None:
                    raise pending_error
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                # Cancelled at any moment, even while the add was on its way: the pipe keeps
                # order, so this abort follows the add; aborting a request the engine never
                # took is a no-op.
                self._abort_quietly(req_id)

    # -- requests: one multiplexed stream per caller process ---------------------------------
    async def add_many(self, channel_id: str, adds: bytes) -> None:
        """Admit the requests of an encoded `ChannelAdds`, whose outputs go to `channel_id`'s
        `subscribe` stream. Nothing is returned: each request's answer is its first item on that
        stream, `Admitted` with its first outputs if they come within a step (see `Admitted`),
        or a `Refusal`: InvalidRequestError if the engine rejects it, BackendError if it cannot
        start. Callers send this one-way (actors/batching.py), so an admission costs no reply of
        its own: it rides the channel's next batch with the step's outputs."""
        self._add_to_channel(channel_id, decode(adds).requests)

    def _add_to_channel(self, channel_id: str, requests: list[EngineCoreRequest]) -> None:
        channel = self._channels.setdefault(channel_id, _Channel())
        received = time.time()
        refused = []
        for request in requests:
            req_id = request.req_id
            try:
                self._check_new(req_id)  # a duplicate id is refused, the running request untouched
                if channel.closed:
                    raise BackendError(f"channel {channel_id} of backend {self.backend_id} is closed")
            except Exception as exc:
                refused.append(Refusal(req_id, exc))
                continue
            channel.req_ids.add(req_id)
            self._channel_of[req_id] = channel
            request.call_id = next(self._call_ids)
            self._admitting[request.call_id] = (req_id, channel, received)
            try:
                self._send(request)
            except BackendError as exc:  # the engine core is gone
                self._forget(req_id)
                refused.append(Refusal(req_id, exc))
        if refused:
            _dispatch([], [(channel, refused)])

    async def subscribe(self, channel_id: str) -> AsyncIterator[bytes]:
        """The admissions and outputs of every request added with `channel_id`, one encoded
        `ChannelBatch` per hand-over. Ends when the caller closes it, which aborts that
        channel's unfinished requests."""
        channel = self._open_channel(channel_id)
        try:
            while (batch := await self._next_batch(channel)) is not None:
                yield encode(ChannelBatch(batch))
        finally:
            self._close_channel(channel_id, channel)

    def _open_channel(self, channel_id: str) -> _Channel:
        """Start handing a channel's batches to this event loop (those that came before, too)."""
        channel = self._channels.setdefault(channel_id, _Channel())
        channel.wake = asyncio.Event()
        with channel.lock:
            channel.loop = asyncio.get_running_loop()
            channel.pending, channel.early = channel.early, []
        return channel

    @staticmethod
    async def _next_batch(channel: _Channel) -> list | None:
        """The channel's next hand-over; None once it is closed and everything went out."""
        while not channel.pending:
            if channel.closed:
                return None
            await channel.wake.wait()
            channel.wake.clear()
        batch, channel.pending = channel.pending, []
        return batch

    def _close_channel(self, channel_id: str, channel: _Channel) -> None:
        """The caller is done with the channel (or gone): abort its unfinished requests."""
        channel.closed = True
        self._channels.pop(channel_id, None)
        for req_id in list(channel.req_ids):
            self._forget(req_id)
            self._abort_quietly(req_id)

    # -- requests: the same-node wire (actors/wire.py) ---------------------------------------
    async def wire_address(self) -> tuple[str, tuple[str, bytes]]:
        """(node id, address) of this backend's same-node wire, which a caller on the same node
        uses instead of `add_many` + `subscribe`; started on the first call."""
        if self._wire is None:
            self._wire = wire.WireServer()
            await self._wire.start(self._serve_wire)
        return wire.node_id(), self._wire.address

    async def _serve_wire(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One caller's channel: its first frame is a `ChannelOpen`, the others `ChannelAdds`;
        the channel's hand-overs go back as `ChannelBatch` frames. The caller closing the socket
        closes the channel, which aborts its unfinished requests."""
        try:
            opened = await wire.read_frame(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if not isinstance(opened, ChannelOpen):
            logger.error("backend %s: a wire opened with %s, not a ChannelOpen", self.backend_id,
                         type(opened).__name__)
            writer.close()
            return
        channel_id = opened.channel_id
        channel = self._open_channel(channel_id)
        sender = asyncio.get_running_loop().create_task(self._send_channel(channel, writer))
        try:
            while True:
                self._add_to_channel(channel_id, (await wire.read_frame(reader)).requests)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller is gone
        except Exception:  # a frame that does not decode: this caller's wire is broken
            logger.exception("backend %s: bad frame on channel %s", self.backend_id, channel_id)
        finally:
            sender.cancel()
            self._close_channel(channel_id, channel)
            writer.close()

    async def _send_channel(self, channel: _Channel, writer: asyncio.StreamWriter) -> None:
        try:
            while (batch := await self._next_batch(channel)) is not None:
                writer.write(wire.frame(ChannelBatch(batch)))
                await writer.drain()
        except ConnectionError:
            pass  # the caller is gone; the reading side closes the channel
        except Exception:  # a batch that does not encode: end the wire rather than stall its requests
            logger.exception("backend %s: could not send a channel batch; closing the wire", self.backend_id)
            writer.close()

    def _check_new(self, req_id: str) -> None:
        if req_id in self._streams or req_id in self._channel_of:
            raise InvalidRequestError(f"request id {req_id!r} is already running on {self.backend_id}")
        if self._stopping:
            raise BackendError(f"backend {self.backend_id} is shutting down")

    def _forget(self, req_id: str) -> None:
        """Drop a channel request and whatever it has not been sent (aborted, or failed; its
        caller hears why on the channel, or is gone)."""
        channel = self._channel_of.pop(req_id, None)
        if channel is not None:
            channel.drop(req_id)
        self._awaiting_first.pop(req_id, None)

    def _leave_channel(self, req_id: str) -> None:
        """A finished request leaves its channel's count; its held outputs still go out."""
        channel = self._channel_of.pop(req_id, None)  # pop: the event loop may have dropped it
        if channel is not None:
            channel.req_ids.discard(req_id)

    async def abort(self, req_id: str) -> bool:
        """Abort a request: its stream ends with an output whose reason is "abort", which also
        takes a channel request out of its channel (a batched add's caller that gave up sends
        this, since cancelling it does not reach the add)."""
        return await self._call("abort", req_id)

    async def num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """This engine's own prefix-hit answer (diagnostics; the router uses its mirror)."""
        return await self._call("num_cached_tokens", prompt_token_ids)

    async def stats(self) -> Any:
        return await self._call("stats")

    # -- talking to the core -----------------------------------------------------------------
    async def _add(self, request: EngineCoreRequest) -> int:
        request.call_id, future = self._new_call()
        self._send(request)
        added = await future
        return added.num_prompt_tokens

    async def _call(self, name: str, *args: Any) -> Any:
        """Run the core's `call_<name>(*args)` between two steps and return its result."""
        call_id, future = self._new_call()
        self._send(EngineCoreCall(call_id, name, list(args)))
        return await future

    def _new_call(self) -> tuple[int, asyncio.Future]:
        loop = asyncio.get_running_loop()
        call_id, future = next(self._call_ids), loop.create_future()
        self._calls[call_id] = (loop, future)
        return call_id, future

    def _send(self, message: Message) -> None:
        try:
            self.core.send(message)
        except (OSError, ValueError):  # the core is gone; the reader thread fails the streams
            call_id = getattr(message, "call_id", None)
            if call_id is not None:
                self._calls.pop(call_id, None)
                self._admitting.pop(call_id, None)
            raise BackendError(f"backend {self.backend_id}: its engine core is not running") from None

    def _abort_quietly(self, req_id: str) -> None:
        try:
            self.core.send(EngineCoreAbort(req_id))
        except (OSError, ValueError):  # the core is gone: nothing left to free
            pass

    # -- the reader thread -------------------------------------------------------------------
    def _read_core(self) -> None:
        while True:
            try:
                message = self.core.recv()
            except (EOFError, OSError):
                self._core_exited()
                return
            try:
                if isinstance(message, EngineCoreOutputs):
                    self._on_step(message)
                elif isinstance(message, EngineCoreFailed):
                    self._on_failure(message.traceback)
            except Exception:  # our own bookkeeping failed: log it, keep serving
                logger.exception("backend %s: handling the engine core's message failed", self.backend_id)

    def _on_step(self, message: EngineCoreOutputs) -> None:
        added, replies, outputs, step = message.added, message.replies, message.outputs, message.step
        to_deliver, admissions = outputs, {}
        if self._admitting or self._awaiting_first:
            added, replies, to_deliver, admissions = self._admissions(added, replies, outputs)
        if added or replies:
            self._answer(added, replies)
        if to_deliver or admissions:
            self._deliver(to_deliver, admissions)
        if step is not None:
            self.metrics.observe("tandem_backend_step_time_seconds", step.elapsed_s)
            self.metrics.inc("tandem_backend_step_seconds", step.elapsed_s)
            self.metrics.inc("tandem_backend_steps")
            self._pending_steps.append(step)
        for out in outputs:
            if out.finished:
                self._record_finished(out)
        for p in message.progress:
            self._pending_progress[p.req_id] = p
        if message.cache_changes:
            self._pending_cache_changes.update(message.cache_changes)
        now = time.monotonic()
        if step is None or now - self._last_report >= self.report_interval_s:
            self._report(now)
        if message.stats is not None:
            self._record_stats(message.stats)

    def _admissions(self, added: list[AddReply], replies: list[CallReply],
                    outputs: list[EngineCoreOutput]) -> tuple[list, list, list, dict]:
        """The channel adds' answers in this message: an add the engine queued is admitted with
        its request's first outputs (see `Admitted`) when they come in the same step's message
        (a synchronous engine) or the next one (asynchronous scheduling returns a step's tokens
        with the next step); those outputs leave the channel's path. A request still without
        outputs then (queued behind others, or a prompt prefilled in chunks) is admitted
        without them, so its caller's response starts as before; a rejection is answered at
        once. Returns the other adds' and calls' replies, the outputs left for `_deliver`, and the
        admission items per channel (id(channel) -> (channel, items)), which go out before any
        output."""
        late = list(self._awaiting_first)  # held over one message already
        other_added, other_replies = [], []
        admissions: dict[int, tuple[_Channel, list]] = {}

        def admit(channel: _Channel, item: Admitted | Refusal) -> None:
            admissions.setdefault(id(channel), (channel, []))[1].append(item)

        def admit_queued(req_id: str, outputs: list[EngineCoreOutput]) -> None:
            waiting = self._awaiting_first.pop(req_id, None)
            if waiting is not None:
                channel, num_prompt_tokens, received, queued = waiting
                admit(channel, Admitted(req_id, self.backend_id, num_prompt_tokens, outputs, received, queued))

        for reply in added:
            adding = self._admitting.pop(reply.call_id, None)
            if adding is None:
                other_added.append(reply)
            else:
                req_id, channel, received = adding
                self._awaiting_first[req_id] = (channel, reply.num_prompt_tokens, received, reply.queued_time)
        for reply in replies:
            adding = self._admitting.pop(reply.call_id, None)
            if adding is None:
                other_replies.append(reply)
            else:  # a refused add
                self._forget(adding[0])
                admit(adding[1], Refusal(adding[0], reply.value))
        if not self._awaiting_first:
            return other_added, other_replies, outputs, admissions
        firsts: dict[str, list] = {}
        rest = []
        for out in outputs:
            if out.req_id not in self._awaiting_first:
                rest.append(out)
                continue
            firsts.setdefault(out.req_id, []).append(out)
            if out.finished:  # finished in its first step: nothing more will come on the channel
                self._leave_channel(out.req_id)
        for req_id, outs in firsts.items():
            admit_queued(req_id, merge_core_outputs(outs))
        for req_id in late:  # no outputs in this message either: admitted without them
            admit_queued(req_id, [])
        return other_added, other_replies, rest, admissions

    def _answer(self, added: list[AddReply], replies: list[CallReply]) -> None:
        by_loop: dict[Any, list] = {}
        answers = [(r.call_id, True, r) for r in added] + [(r.call_id, r.ok, r.value) for r in replies]
        for call_id, ok, value in answers:
            entry = self._calls.pop(call_id, None)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], ok, value))
        for loop, answers in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, answers)

    def _deliver(self, outputs: list, admissions: dict | None = None) -> None:
        """Hand a step's outputs to their streams and channels with one wake-up of the event
        loop, not one per request. Both are paced here: `generate` streams by
        `stream_interval_s` (a stream's coroutine wakes only to send), channel requests by their
        channel's size (`_Channel.take_due`), so a caller with many streams gets several steps'
        tokens per message. A channel's outputs stay `EngineCoreOutput`s, encoded once per
        batch; the channel's reader makes them `RequestOutput`s."""
        now = time.monotonic()
        for out in outputs:
            req_id = out.req_id
            channel = self._channel_of.get(req_id)
            if channel is not None:
                channel.held.setdefault(req_id, []).append(out)
                self._holding[id(channel)] = channel
                if out.finished:  # finished: it leaves the channel's count, its outputs stay held
                    self._leave_channel(req_id)
                continue
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.pending.append(out.to_request_output())
                self._held[req_id] = stream
        batches = dict(admissions or {})  # a channel's admissions go before its outputs
        for key, channel in list(self._holding.items()):
            due = channel.take_due(now)
            if due:
                batches.setdefault(key, (channel, []))[1].extend(due)
            if not channel.held:
                del self._holding[key]
        deliveries = []
        if self._held:
            interval = self._stream_interval()
            for req_id, stream in list(self._held.items()):
                if stream.pending[-1].finished or now >= stream.next_send:
                    del self._held[req_id]
                    deliveries.extend((stream, out) for out in merge_outputs(stream.pending))
                    stream.pending, stream.next_send = [], now + interval
        _dispatch(deliveries, list(batches.values()))

    def _stream_interval(self) -> float:
        """Seconds until a `generate` stream's next message: the configured interval, stretched
        to keep all streams within `max_stream_messages_per_s` (0: no budget), at most
        `MAX_STREAM_DELAY_S`."""
        interval = self.stream_interval_s
        if self.max_stream_messages_per_s > 0:
            interval = max(interval, len(self._streams) / self.max_stream_messages_per_s)
        return min(interval, max(MAX_STREAM_DELAY_S, self.stream_interval_s))

    def _on_failure(self, trace: str) -> None:
        logger.error("backend %s: engine step failed:\n%s", self.backend_id, trace)
        error = BackendError(f"backend {self.backend_id}: engine failed: {trace.strip().splitlines()[-1]}")
        for req_id in self._fail_streams(error):
            self._abort_quietly(req_id)

    def _fail_streams(self, error: BaseException) -> list[str]:
        """Put `error` into every stream and channel request; returns their request ids."""
        self._held.clear()  # outputs not yet handed over: the error replaces them
        streams = list(self._streams.items())
        channel_reqs = list(self._channel_of.items())
        deliveries = [(stream, error) for _, stream in streams]
        batches: dict[int, tuple[_Channel, list]] = {}
        for req_id, channel in channel_reqs:
            batches.setdefault(id(channel), (channel, []))[1].append(Refusal(req_id, error))
            self._forget(req_id)
        _dispatch(deliveries, list(batches.values()))
        return [r for r, _ in streams] + [r for r, _ in channel_reqs]

    def _core_exited(self) -> None:
        if self._stopping:
            return
        code = self.core.exitcode()
        logger.error("backend %s: engine core exited (code %s); exiting so Ray restarts this backend",
                     self.backend_id, code)
        self._fail_streams(BackendError(f"backend {self.backend_id}: engine core exited (code {code})"))
        self._fail_calls(BackendError(f"backend {self.backend_id}: engine core exited (code {code})"))
        time.sleep(0.2)  # let the event loop hand the errors over before the process goes
        os._exit(1)

    def _fail_calls(self, error: BaseException) -> None:
        calls, self._calls = self._calls, {}
        self._admitting.clear()
        self._awaiting_first.clear()
        by_loop: dict[Any, list] = {}
        for loop, future in calls.values():
            by_loop.setdefault(loop, []).append((future, False, error))
        for loop, answers in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, answers)

    # -- router reports and metrics ----------------------------------------------------------
    def _report(self, now: float) -> None:
        self._last_report = now
        if not (self._pending_progress or self._pending_steps or self._pending_cache_changes):
            return
        progress = list(self._pending_progress.values())
        self._pending_progress = {}
        steps, self._pending_steps = self._pending_steps, []
        cache_changes, self._pending_cache_changes = self._pending_cache_changes, {}
        if self.router is not None:
            self.router.report.remote(self.backend_id, self.instance_id, progress, steps, cache_changes)

    def _record_finished(self, out: EngineCoreOutput) -> None:
        reason, arrival = out.finish_reason, out.arrival_time
        first_scheduled, first_token, finished = out.first_scheduled_time, out.first_token_time, out.finished_time
        self.metrics.inc("tandem_backend_requests_finished", tags={"finish_reason": reason or "unknown"})
        if reason == "abort":
            return
        if first_token is not None:
            self.metrics.observe("tandem_backend_ttft_seconds", max(0.0, first_token - arrival))
        if first_scheduled is not None:
            self.metrics.observe("tandem_backend_queue_time_seconds", max(0.0, first_scheduled - arrival))
        if finished is not None:
            self.metrics.observe("tandem_backend_e2e_seconds", max(0.0, finished - arrival))

    def _record_stats(self, stats: StatsTotals) -> None:
        m, old = self.metrics, self._stats_totals
        m.set("tandem_backend_up", 1)
        m.set("tandem_backend_running_requests", stats.num_running)
        m.set("tandem_backend_waiting_requests", stats.num_waiting)
        m.set("tandem_backend_kv_cache_usage", stats.kv_cache_usage)
        m.set("tandem_backend_kv_cache_free_blocks", stats.num_free_blocks)
        m.inc("tandem_backend_prefix_cache_queries", stats.prefix_cache_queries - old.prefix_cache_queries)
        m.inc("tandem_backend_prefix_cache_hits", stats.prefix_cache_hits - old.prefix_cache_hits)
        m.inc("tandem_backend_prompt_tokens", stats.prompt_tokens - old.prompt_tokens)
        m.inc("tandem_backend_generation_tokens", stats.generation_tokens - old.generation_tokens)
        m.inc("tandem_backend_preemptions", stats.preemptions - old.preemptions)
        self._stats_totals = stats


def _resolve_all(answers: list[tuple[asyncio.Future, bool, Any]]) -> None:
    """On the event loop: answer the commands' futures. A caller cancelled meanwhile (its client
    hung up) has a cancelled future, which is left alone."""
    for future, ok, value in answers:
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _dispatch(deliveries: list[tuple[_Stream, Any]], channels: list[tuple[_Channel, list]]) -> None:
    """From the reader thread: hand outputs over with one wake-up per event loop (one, in an
    actor). A channel not subscribed yet keeps them until `subscribe` takes them."""
    by_loop: dict[Any, tuple[list, list]] = {}
    for stream, out in deliveries:
        by_loop.setdefault(stream.loop, ([], []))[0].append((stream, out))
    for channel, outs in channels:
        with channel.lock:
            if channel.loop is None:
                channel.early.extend(outs)
                continue
        by_loop.setdefault(channel.loop, ([], []))[1].append((channel, outs))
    for loop, (streams, batches) in by_loop.items():
        loop.call_soon_threadsafe(_hand_over, streams, batches)


def _hand_over(deliveries: list[tuple[_Stream, Any]], channels: list[tuple[_Channel, list]]) -> None:
    for stream, out in deliveries:
        stream.queue.put_nowait(out)
    for channel, outs in channels:
        channel.pending.extend(outs)
        if channel.wake is not None:
            channel.wake.set()


def _coalesce(item: Any, queue: asyncio.Queue) -> tuple[list, BaseException | None]:
    """Merge the outputs already waiting behind `item` with it (one per choice), so a stream
    whose consumer fell behind sends one message per catch-up rather than one per engine step.
    An error found while draining is returned to be raised after the merged outputs are sent."""
    items = [item]
    while not items[-1].finished and not queue.empty():
        following = queue.get_nowait()
        if isinstance(following, BaseException):
            return merge_outputs(items), following
        items.append(following)
    return merge_outputs(items), None


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

