"""A backend's side of its channels: which caller each request streams to, its admission, and
the pacing of its outputs.

A channel is one caller process's multiplexed stream (actors/channel.py is the caller's end):
every request the caller adds on it comes back on it, first its admission, then its outputs,
in one `ChannelBatch` per hand-over holding every request's news. The engine core sends one
message per step; `on_step`, on the backend's core reader thread, does per step everything
the channels need and hands the batches to the actor's event loop with one wake-up.

Admission. An add the engine queued is admitted with its request's first outputs (see
`Admitted`) when they come in the same step's message (a synchronous engine) or the next one
(asynchronous scheduling returns a step's tokens with the next step), so the first token
reaches the caller with the answer instead of a channel message later. A request still without
outputs then (queued behind others, or a prompt prefilled in chunks) is admitted without them;
a refused add is answered at once with a `Refusal`.

Pacing: a request's first output goes at once, and so does its last; in between, outputs are
merged and handed over at most every interval, which grows with the channel's open requests
(0.25 ms each, at most 20 ms), because what a caller pays per message (a wake-up, an SSE
chunk, a socket write) is what limits a caller with many streams, while a caller with few gets
every step. A channel's batch goes out every step that has something due, and its consumer
also merges what it has not read yet, so a caller that falls behind reads fewer, larger
messages.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.actors.core_client import CoreClient
from tandem.actors.messages import (AddReply, Admitted, CallReply, ChannelBatch, ChannelOpen, EngineCoreOutput,
                                    EngineCoreOutputs, EngineCoreRequest, Refusal, merge_core_outputs)
from tandem.actors.wire import frame, read_frame
from tandem.engine.errors import BackendError, InvalidRequestError

logger = logging.getLogger("tandem.backend")

# A request's outputs wait at most this long between two hand-overs, however large its channel.
MAX_STREAM_DELAY_S = 0.02
# After its first output, one hand-over per this many seconds per open request of its channel
# (64 streams in one caller: 16 ms), at most MAX_STREAM_DELAY_S.
CHANNEL_PACE_PER_STREAM_S = 0.00025


@dataclass
class ChannelState:
    """The backend's state of one channel: the batches its caller has not been sent yet."""

    loop: asyncio.AbstractEventLoop | None = None  # set once the caller subscribes
    pending: list = field(default_factory=list)  # event-loop side
    wake: asyncio.Event | None = None
    req_ids: set = field(default_factory=set)
    closed: bool = False
    early: list = field(default_factory=list)  # items that came before the caller subscribed
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Reader-thread side: each request's outputs not handed over yet, and when its next
    # hand-over is due (time.monotonic; absent: its first output goes at once).
    held: dict = field(default_factory=dict)
    next_send: dict = field(default_factory=dict)

    def take_due(self, now: float) -> list[EngineCoreOutput]:
        """The held outputs due now, merged per request: finished ones, and the rest once their
        interval has passed (or a step, when steps are slower)."""
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


@dataclass
class _Admitting:
    """A channel add on its way: sent to the core (`queued` None), or queued there and waiting
    for its first outputs."""

    req_id: str
    channel: ChannelState
    received: float  # time.time() when the actor took the add
    num_prompt_tokens: int = 0
    queued: float | None = None


class Fanout:
    """Every channel of one backend. `add`, `open`, `close`, `next_batch` and `serve_wire` run
    on the actor's event loop; `on_step` and `fail_all` on the core reader thread."""

    def __init__(self, backend_id: str, core: CoreClient) -> None:
        self.backend_id = backend_id
        self.core = core
        self.stopping = False
        self.channels: dict[str, ChannelState] = {}
        self.channel_of: dict[str, ChannelState] = {}  # req_id -> its channel
        self._holding: dict[int, ChannelState] = {}  # channels with held outputs (reader thread)
        self._admitting: dict[int, _Admitting] = {}  # by the add's call id, until the core queued it
        self._awaiting_first: dict[str, _Admitting] = {}  # by request id, once queued

    # -- the event loop's side -----------------------------------------------------------------
    def add(self, channel_id: str, requests: list[EngineCoreRequest]) -> None:
        """Send the requests to the core; each one's answer comes on the channel."""
        channel = self.channels.setdefault(channel_id, ChannelState())
        received = time.time()
        refused = []
        for request in requests:
            req_id = request.req_id
            if req_id in self.channel_of:  # a duplicate id is refused, the running request untouched
                refused.append(Refusal(req_id, InvalidRequestError(
                    f"request id {req_id!r} is already running on {self.backend_id}")))
                continue
            if self.stopping or channel.closed:
                refused.append(Refusal(req_id, BackendError(f"backend {self.backend_id} is not taking requests "
                                                            f"on channel {channel_id}")))
                continue
            channel.req_ids.add(req_id)
            self.channel_of[req_id] = channel
            request.call_id = self.core.new_call_id()
            self._admitting[request.call_id] = _Admitting(req_id, channel, received)
            try:
                self.core.send(request)
            except BackendError as exc:  # the engine core is gone
                self._admitting.pop(request.call_id, None)
                self.forget(req_id)
                refused.append(Refusal(req_id, exc))
        if refused:
            _dispatch([(channel, refused)])

    def open(self, channel_id: str) -> ChannelState:
        """Start handing a channel's batches to this event loop (those that came before, too)."""
        channel = self.channels.setdefault(channel_id, ChannelState())
        channel.wake = asyncio.Event()
        with channel.lock:
            channel.loop = asyncio.get_running_loop()
            channel.pending, channel.early = channel.early, []
        return channel

    @staticmethod
    async def next_batch(channel: ChannelState) -> list | None:
        """The channel's next hand-over; None once it is closed and everything went out."""
        while not channel.pending:
            if channel.closed:
                return None
            await channel.wake.wait()
            channel.wake.clear()
        batch, channel.pending = channel.pending, []
        return batch

    def close(self, channel_id: str, channel: ChannelState) -> None:
        """The caller is done with the channel (or gone): abort its unfinished requests."""
        channel.closed = True
        self.channels.pop(channel_id, None)
        for req_id in list(channel.req_ids):
            self.forget(req_id)
            self.core.abort(req_id)

    def forget(self, req_id: str) -> None:
        """Drop a request and whatever it has not been sent (aborted, or failed; its caller hears
        why on the channel, or is gone)."""
        channel = self.channel_of.pop(req_id, None)
        if channel is not None:
            channel.drop(req_id)
        self._awaiting_first.pop(req_id, None)

    # -- the same-node wire: a channel's transport for a caller on this node ---------------------
    async def serve_wire(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A `WireServer` handler (actors/wire.py) serving one caller's channel: its first frame
        is a `ChannelOpen`, the others `ChannelAdds`; the hand-overs go back as `ChannelBatch`
        frames. The caller closing the socket closes the channel, which aborts its unfinished
        requests."""
        try:
            opened = await read_frame(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            opened = None
        if not isinstance(opened, ChannelOpen):
            writer.close()
            return
        channel = self.open(opened.channel_id)
        sender = asyncio.get_running_loop().create_task(self._send_over_wire(channel, writer))
        try:
            while True:
                self.add(opened.channel_id, (await read_frame(reader)).requests)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller is gone
        except Exception:  # a frame that does not decode: this caller's wire is broken
            logger.exception("backend %s: bad frame on channel %s", self.backend_id, opened.channel_id)
        finally:
            sender.cancel()
            self.close(opened.channel_id, channel)
            writer.close()

    async def _send_over_wire(self, channel: ChannelState, writer: asyncio.StreamWriter) -> None:
        try:
            while (batch := await self.next_batch(channel)) is not None:
                writer.write(frame(ChannelBatch(batch)))
                await writer.drain()
        except ConnectionError:
            pass  # the caller is gone; the reading side closes the channel
        except Exception:  # a batch that does not encode: end the wire rather than stall its requests
            logger.exception("backend %s: could not send a channel batch; closing the wire", self.backend_id)
            writer.close()

    # -- the reader thread's side ----------------------------------------------------------------
    def on_step(self, message: EngineCoreOutputs) -> list[CallReply]:
        """Admit, merge, pace and hand over one step's news; returns the replies that answer
        control calls, not adds."""
        outputs, admissions, replies = message.outputs, {}, message.replies
        if self._admitting or self._awaiting_first:
            replies, outputs, admissions = self._admissions(message.added, replies, outputs)
        if outputs or admissions:
            self._deliver(outputs, admissions)
        return replies

    def fail_all(self, error: BaseException) -> list[str]:
        """Put `error` into every channel request; returns their request ids."""
        self._admitting.clear()
        batches: dict[int, tuple[ChannelState, list]] = {}
        req_ids = list(self.channel_of.items())
        for req_id, channel in req_ids:
            batches.setdefault(id(channel), (channel, []))[1].append(Refusal(req_id, error))
            self.forget(req_id)
        _dispatch(list(batches.values()))
        return [req_id for req_id, _ in req_ids]

    def _admissions(self, added: list[AddReply], replies: list[CallReply],
                    outputs: list[EngineCoreOutput]) -> tuple[list, list, dict]:
        """The adds' answers in this message (see the module docstring). Returns the control
        calls' replies, the outputs left for `_deliver`, and the admission items per channel
        (id(channel) -> (channel, items)), which go out before any output."""
        late = list(self._awaiting_first)  # held over one message already
        admissions: dict[int, tuple[ChannelState, list]] = {}

        def admit(adding: _Admitting, item: Admitted | Refusal) -> None:
            admissions.setdefault(id(adding.channel), (adding.channel, []))[1].append(item)

        def admit_queued(req_id: str, first: list[EngineCoreOutput]) -> None:
            a = self._awaiting_first.pop(req_id, None)
            if a is not None:
                admit(a, Admitted(req_id, self.backend_id, a.num_prompt_tokens, first, a.received, a.queued))

        for reply in added:
            adding = self._admitting.pop(reply.call_id, None)
            if adding is not None:
                adding.num_prompt_tokens, adding.queued = reply.num_prompt_tokens, reply.queued_time
                self._awaiting_first[adding.req_id] = adding
        calls = []
        for reply in replies:
            adding = self._admitting.pop(reply.call_id, None)
            if adding is None:
                calls.append(reply)
            else:  # a refused add
                self.forget(adding.req_id)
                admit(adding, Refusal(adding.req_id, reply.value))
        if not self._awaiting_first:
            return calls, outputs, admissions
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
        return calls, rest, admissions

    def _deliver(self, outputs: list[EngineCoreOutput], admissions: dict) -> None:
        """Hold a step's outputs on their channels and hand over what is due, a channel's
        admissions first, with one wake-up of the event loop, not one per request."""
        now = time.monotonic()
        for out in outputs:
            channel = self.channel_of.get(out.req_id)
            if channel is None:  # aborted or failed meanwhile: its caller already heard why
                continue
            channel.held.setdefault(out.req_id, []).append(out)
            self._holding[id(channel)] = channel
            if out.finished:  # it leaves the channel's count; its outputs stay held
                self._leave_channel(out.req_id)
        batches = dict(admissions)
        for key, channel in list(self._holding.items()):
            due = channel.take_due(now)
            if due:
                batches.setdefault(key, (channel, []))[1].extend(due)
            if not channel.held:
                del self._holding[key]
        _dispatch(list(batches.values()))

    def _leave_channel(self, req_id: str) -> None:
        channel = self.channel_of.pop(req_id, None)  # pop: the event loop may have dropped it
        if channel is not None:
            channel.req_ids.discard(req_id)


def _dispatch(batches: list[tuple[ChannelState, list]]) -> None:
    """Hand batches over with one wake-up per event loop (one, in an actor). A channel not
    subscribed yet keeps them until its caller subscribes."""
    by_loop: dict[Any, list] = {}
    for channel, items in batches:
        with channel.lock:
            if channel.loop is None:
                channel.early.extend(items)
                continue
        by_loop.setdefault(channel.loop, []).append((channel, items))
    for loop, handed in by_loop.items():
        loop.call_soon_threadsafe(_hand_over, handed)


def _hand_over(batches: list[tuple[ChannelState, list]]) -> None:
    for channel, items in batches:
        channel.pending.extend(items)
        if channel.wake is not None:
            channel.wake.set()
