"""An engine core's side of its channels: which caller each request streams to, its admission,
and one frame per channel per step with its outputs.

A channel is one caller process's multiplexed stream (actors/channel.py is the caller's end):
every request the caller adds on it comes back on it, first its admission, then its outputs,
in one `ChannelBatch` per step holding every request's news. All of this runs on the engine
core's I/O thread (actors/core_io.py), never on the step loop: the step loop hands over each
step's outputs and the fate of the adds it applied, and `on_step` makes one pass over them,
sorts them into per-channel batches and writes each batch in one frame (one encode).

Admission. An add the engine queued is admitted with its request's first outputs (see
`Admitted`) when they come in the same step (a synchronous engine) or the next one
(asynchronous scheduling returns a step's tokens with the next step), so the first token
reaches the caller with the answer instead of a channel message later. A request still without
outputs then (queued behind others, or a prompt prefilled in chunks) is admitted without them;
a refused add is answered at once with a `Refusal`.

No pacing here: every step's outputs go out in that step, one frame per channel, since this
thread shares the GIL with the step loop, and per-output work here (holding, merging, timers)
is taken from a host-bound step. Pacing is the caller's (actors/channel.py): its request
streams hand out merged deltas at most every interval, where each caller pays per message.

A slow caller never holds up the engine: writes go into the socket's buffer without waiting,
and once a channel has `MAX_UNSENT_BYTES` unsent its outputs stay held and keep merging (one
delta per request however many steps pass) until the buffer drains, so what a channel holds
is bounded by its requests' tokens, not by the number of steps. A caller whose socket closes
has its unfinished requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem.actors.messages import Admitted, ChannelBatch, EngineCoreRequest, Refusal
from tandem.actors.wire import frame
from tandem.engine.errors import BackendError, InvalidRequestError
from tandem.engine.outputs import RequestOutput, merge_outputs

logger = logging.getLogger("tandem.backend")

# Above this many bytes written but not yet taken by its caller, a channel's outputs are held.
MAX_UNSENT_BYTES = 4 << 20


@dataclass(frozen=True)
class Abort:
    """A command for the step loop: abort this request (its caller is gone, or its step failed)."""

    req_id: str


@dataclass(eq=False)  # one per connection, compared and hashed by identity
class ChannelState:
    """One channel: its caller's socket, its open requests, and the outputs held while its
    caller is backed up."""

    channel_id: str = ""
    writer: asyncio.StreamWriter | None = None  # None: bookkeeping only (unit tests)
    req_ids: set = field(default_factory=set)
    closed: bool = False
    held: dict = field(default_factory=dict)  # req_id -> outputs not written while backed up
    draining: bool = False  # a task waits for the caller to take what was written

    def hold(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.held.setdefault(out.req_id, []).append(out)

    def take_held(self) -> list[RequestOutput]:
        """What was held, one merged delta per request (per choice)."""
        merged = [out for pending in self.held.values() for out in merge_outputs(pending)]
        self.held.clear()
        return merged

    def drop(self, req_id: str) -> None:
        self.req_ids.discard(req_id)
        self.held.pop(req_id, None)

    def backed_up(self) -> bool:
        return self.writer is not None and self.writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES

    def send(self, items: list) -> None:
        if self.writer is None or self.closed:
            return
        try:
            data = frame(ChannelBatch(items))
        except Exception:  # a batch that does not encode: end the wire rather than stall its requests
            logger.exception("channel %s: could not encode a batch; closing its wire", self.channel_id)
            self.writer.close()  # its caller fails the requests; the reading side aborts them
            return
        self.writer.write(data)


@dataclass
class _Admitting:
    """A channel add on its way: handed to the step loop (`queued` None), or queued by the
    engine and waiting for its first outputs."""

    req_id: str
    channel: ChannelState
    received: float  # time.time() when the add came off the channel
    num_prompt_tokens: int = 0
    queued: float | None = None


class Fanout:
    """Every channel of one engine core; everything here runs on the core's I/O thread.
    `to_core` queues commands (a list of requests to add, an `Abort`) for the step loop."""

    def __init__(self, backend_id: str, to_core: Callable[[Any], None]) -> None:
        self.backend_id = backend_id
        self.to_core = to_core
        self.stopping = False
        self.channel_of: dict[str, ChannelState] = {}  # req_id -> its channel
        self._holding: dict[int, ChannelState] = {}  # channels with held outputs
        self._admitting: dict[str, _Admitting] = {}  # handed to the step loop, not queued yet
        self._awaiting_first: dict[str, _Admitting] = {}  # queued, admitted with their first outputs

    # -- from the channels -------------------------------------------------------------------
    def add(self, channel: ChannelState, requests: list[EngineCoreRequest]) -> None:
        """Hand a frame's requests to the step loop; each one's answer comes on the channel."""
        received = time.time()
        refused, accepted = [], []
        for request in requests:
            req_id = request.req_id
            if req_id in self.channel_of:  # a duplicate id is refused, the running request untouched
                refused.append(Refusal(req_id, InvalidRequestError(
                    f"request id {req_id!r} is already running on {self.backend_id}")))
                continue
            if self.stopping or channel.closed:
                refused.append(Refusal(req_id, BackendError(f"backend {self.backend_id} is not taking requests "
                                                            f"on channel {channel.channel_id}")))
                continue
            channel.req_ids.add(req_id)
            self.channel_of[req_id] = channel
            self._admitting[req_id] = _Admitting(req_id, channel, received)
            accepted.append(request)
        if accepted:
            self.to_core(accepted)
        if refused:
            channel.send(refused)

    def close(self, channel: ChannelState) -> None:
        """The caller is done with the channel (or gone): abort its unfinished requests."""
        channel.closed = True
        for req_id in list(channel.req_ids):
            self.forget(req_id)
            self.to_core(Abort(req_id))
        self._holding.pop(id(channel), None)

    def forget(self, req_id: str) -> None:
        """Drop a request and whatever it has not been sent (aborted, or failed; its caller hears
        why on the channel, or is gone)."""
        channel = self.channel_of.pop(req_id, None)
        if channel is not None:
            channel.drop(req_id)
        self._admitting.pop(req_id, None)
        self._awaiting_first.pop(req_id, None)

    # -- from the step loop ------------------------------------------------------------------
    def on_step(self, added: list[tuple[str, int, float]], refused: list[tuple[str, BaseException]],
                outputs: list[RequestOutput]) -> None:
        """Admit and send one step's news: `added` (req_id, num_prompt_tokens,
        queued time) and `refused` (req_id, error) are the adds the step loop applied."""
        admissions: dict[int, tuple[ChannelState, list]] = {}
        if self._admitting or self._awaiting_first:
            outputs = self._admissions(added, refused, outputs, admissions)
        if outputs or admissions or self._holding:
            self._deliver(outputs, admissions)

    def fail_all(self, error: BaseException) -> list[str]:
        """Put `error` into every channel request; returns their request ids."""
        batches: dict[int, tuple[ChannelState, list]] = {}
        req_ids = list(self.channel_of.items())
        for req_id, channel in req_ids:
            batches.setdefault(id(channel), (channel, []))[1].append(Refusal(req_id, error))
            self.forget(req_id)
        for channel, items in batches.values():
            channel.send(items)
        return [req_id for req_id, _ in req_ids]

    def _admissions(self, added: list[tuple[str, int, float]], refused: list[tuple[str, BaseException]],
                    outputs: list[RequestOutput], admissions: dict) -> list[RequestOutput]:
        """The adds' answers in this step (see the module docstring), put into `admissions`
        (id(channel) -> (channel, items)), which go out before any output; returns the outputs
        left for `_deliver`."""
        late = list(self._awaiting_first)  # held over one step already

        def admit(adding: _Admitting, item: Admitted | Refusal) -> None:
            admissions.setdefault(id(adding.channel), (adding.channel, []))[1].append(item)

        def admit_queued(req_id: str, first: list[RequestOutput]) -> None:
            a = self._awaiting_first.pop(req_id, None)
            if a is not None:
                admit(a, Admitted(req_id, self.backend_id, a.num_prompt_tokens, first, a.received, a.queued))

        for req_id, num_prompt_tokens, queued in added:
            adding = self._admitting.pop(req_id, None)
            if adding is not None:
                adding.num_prompt_tokens, adding.queued = num_prompt_tokens, queued
                self._awaiting_first[req_id] = adding
        for req_id, error in refused:
            adding = self._admitting.pop(req_id, None)
            if adding is not None:
                self.forget(req_id)
                admit(adding, Refusal(req_id, error))
        if not self._awaiting_first:
            return outputs
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
            admit_queued(req_id, merge_outputs(outs))
        for req_id in late:  # no outputs in this step either: admitted without them
            admit_queued(req_id, [])
        return rest

    def _deliver(self, outputs: list[RequestOutput], admissions: dict) -> None:
        """Write a step's outputs, one frame per channel, a channel's admissions first; a
        backed-up channel holds its outputs (admissions still go) until its caller drains."""
        # id(channel) -> (channel, its admissions, its outputs): every channel with news or held outputs
        batches = {key: (channel, admitted, []) for key, (channel, admitted) in admissions.items()}
        for key, channel in self._holding.items():
            batches.setdefault(key, (channel, [], []))
        channel_of = self.channel_of
        for out in outputs:  # a channel's batch is built at its first output, not at every one
            channel = channel_of.get(out.req_id)
            if channel is None:  # aborted or failed meanwhile: its caller already heard why
                continue
            batch = batches.get(id(channel))
            if batch is None:
                batch = batches[id(channel)] = (channel, [], [])
            batch[2].append(out)
            if out.finished:  # it leaves the channel's count
                self._leave_channel(out.req_id)
        for key, (channel, admitted, items) in batches.items():
            if channel.backed_up():
                channel.hold(items)
                self._holding[key] = channel
                self._drain_later(channel)
                items = []
            elif key in self._holding:
                del self._holding[key]
                items = channel.take_held() + items
            if admitted or items:
                channel.send(admitted + items)

    def _drain_later(self, channel: ChannelState) -> None:
        """Once a backed-up caller has taken what was written, send what it is due (its
        requests may all have finished, so no later step would)."""
        if channel.draining or channel.writer is None:
            return
        channel.draining = True

        async def drained() -> None:
            try:
                await channel.writer.drain()
            except ConnectionError:
                return  # the caller is gone; the reading side closes the channel
            finally:
                channel.draining = False
            self._deliver([], {})

        asyncio.get_running_loop().create_task(drained())

    def _leave_channel(self, req_id: str) -> None:
        channel = self.channel_of.pop(req_id, None)
        if channel is not None:
            channel.req_ids.discard(req_id)
