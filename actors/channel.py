"""The caller's side of the hop from a backend to whoever streams its requests (the HTTP
ingress, the Python driver): one multiplexed channel per backend per event loop.

A Ray streaming generator per request costs an item (an object, a task event, a wake-up on
both sides) per request per message; at 64 streams and a message per stream every few
milliseconds that per-item cost, not the engine, sets the pace. Here each caller process opens
one channel per backend and adds its requests on it (the adds of one event-loop turn in one
batch, actors/batching.py); every engine step then comes back as one `ChannelBatch` holding this
caller's admissions (each with the request's first outputs) and outputs, which a reader task
sorts into per-request queues. A request's reader merges whatever has piled up since its last
read into one output, so a caller that falls behind reads fewer, larger deltas instead of
queueing more messages: the hop costs per step, and the caller's own pace sets the chunking.

Pacing is here too: after its first output a request hands out a delta at most every interval,
which grows with the channel's open requests (0.25 ms each, at most 20 ms), because what a
caller pays per message (a wake-up, an SSE chunk, a socket write) is what limits a caller with
many streams, while a caller with few gets every step; a request's last output (or its error)
goes at once. The engine core sends every step as it comes and leaves the pacing to its callers
(actors/fanout.py), so the per-output work is the callers', in their own processes.

A channel's transport is decided by locality: on the backend's own node, the same-node wire
to the backend's engine core process itself (a Unix socket, see actors/wire.py), which costs a
socket write per batch each way; elsewhere Ray, a one-way `BackendActor.add_many` per batch of
adds and one `BackendActor.subscribe` stream for the batches back, which the actor relays to
its core (actors/relay.py). Both carry the same typed messages (actors/messages.py) in the
same codec: `ChannelAdds` of `EngineCoreRequest`s one way, `ChannelBatch`es the other (over
Ray as encoded bytes, which Ray passes without serializing them again).

`open_stream` returns a `RequestStream`, with `await next()` (first `Admitted`, then
`RequestOutput`s) and `close()`; its errors: `InvalidRequestError` when the engine refuses the
add, `BackendError` for a failed engine, Ray's `RayActorError` if the backend died (or
`BackendGoneError`, when the wire closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from tandem.actors import wire
from tandem.actors.batching import NoticeBatcher
from tandem.actors.detached import detached
from tandem.actors.messages import Admitted, ChannelAdds, ChannelOpen, EngineCoreRequest, Refusal, decode, encode
from tandem.engine.errors import BackendError, BackendGoneError
from tandem.engine.outputs import merge_outputs

logger = logging.getLogger("tandem.channel")

# A request's deltas wait at most this long between two hand-overs, however large its channel.
MAX_STREAM_DELAY_S = 0.02
# After its first output, one hand-over per this many seconds per open request of its channel
# (64 streams in one caller: 16 ms), at most MAX_STREAM_DELAY_S.
CHANNEL_PACE_PER_STREAM_S = 0.00025

_channels: dict[tuple[int, str], Channel] = {}


def open_stream(handle: Any, req_id: str, prompt_token_ids: list[int], params: Any,
                arrival_time: float | None) -> RequestStream:
    """Start a request on the backend behind `handle`; read it with `await stream.next()`."""
    return RequestStream(channel_for(handle), EngineCoreRequest(req_id, prompt_token_ids, params, arrival_time))


def run_to_end(requests: list[tuple[Any, str, list[int], Any]]) -> None:
    """Run requests `(backend handle, req_id, prompt_token_ids, params)` straight on their
    backends, without the router, until each finished: the warm-up's and the benchmarks' way to
    load a backend. On an event loop of its own (in a thread), so a caller that has a running
    loop can call it too."""
    from concurrent.futures import ThreadPoolExecutor

    async def one(handle: Any, req_id: str, prompt_token_ids: list[int], params: Any) -> None:
        stream = open_stream(handle, req_id, prompt_token_ids, params, time.time())
        try:
            await stream.next()  # the admission
            while not (await stream.next()).finished:
                pass
        finally:
            stream.close()

    async def all_of_them() -> None:
        await asyncio.gather(*(one(*request) for request in requests))

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, all_of_them()).result()


def channel_for(handle: Any) -> Channel:
    """This event loop's channel to the backend behind `handle` (one per actor, shared)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), handle._actor_id.hex())
    channel = _channels.get(key)
    if channel is None or channel.error is not None:
        channel = _channels[key] = Channel(handle, key)
    return channel


class Channel:
    """The caller's end of one channel. Its transport is settled by the reader task: the
    same-node wire when the backend is on this node, else Ray (`add_many` and `subscribe`);
    adds made before that is known wait in `_unsent`."""

    def __init__(self, handle: Any, key: tuple[int, str]) -> None:
        self.handle = handle
        self.key = key
        self.channel_id = f"ch-{uuid.uuid4().hex}"
        self.adds = NoticeBatcher(self._send_adds, on_error=self._adds_failed)
        self.streams: dict[str, RequestStream] = {}
        self.error: BaseException | None = None
        self.transport: str | None = None  # "wire" or "ray", once the reader task knows
        self._writer: asyncio.StreamWriter | None = None
        self._unsent: list[EngineCoreRequest] = []
        self.task = detached(asyncio.get_running_loop().create_task, self._read())  # outlives its first request

    def _send_adds(self, batch: list[EngineCoreRequest]) -> None:
        if self.transport == "wire":
            self._write_wire(ChannelAdds(batch))
        elif self.transport == "ray":
            self.handle.add_many.remote(self.channel_id, encode(ChannelAdds(batch)))
        else:
            self._unsent.extend(batch)

    def _write_wire(self, adds: ChannelAdds) -> None:
        """A wire that closed under the backend (killed, restarting) before the reader task saw
        it fails these adds as `BackendGoneError`, which fails over, rather than as the transport's
        own error (uvloop raises RuntimeError on a closed handle; asyncio drops the bytes)."""
        gone = BackendGoneError(f"the wire of backend channel {self.channel_id} closed before its adds were sent")
        if self._writer.is_closing():
            raise gone
        try:
            self._writer.write(wire.frame(adds))
        except (RuntimeError, ConnectionError) as exc:
            raise gone from exc

    async def _read(self) -> None:
        try:
            address = await wire.same_node_address(self.handle)
            if address is None:
                await self._read_ray()
            else:
                await self._read_wire(address)
        except BaseException as exc:  # the backend died or restarted, or this loop is closing
            self.error = exc
            if self._writer is not None:
                self._writer.close()
            if _channels.get(self.key) is self:
                del _channels[self.key]
            for stream in list(self.streams.values()):
                stream.deliver(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _read_ray(self) -> None:
        gen = self.handle.subscribe.options(num_returns="streaming").remote(self.channel_id)
        self._start("ray")
        frames = wire.FrameSplitter()
        async for ref in gen:
            for payload in frames.feed(await ref):
                self._sort(decode(payload).items)
        raise BackendError(f"backend channel {self.channel_id} ended")

    async def _read_wire(self, address: tuple[str, bytes]) -> None:
        reader, self._writer = await wire.connect(address)
        self._writer.write(wire.frame(ChannelOpen(self.channel_id)))
        self._start("wire")
        while True:
            try:
                batch = await wire.read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                raise BackendGoneError(f"the wire of backend channel {self.channel_id} closed") from None
            self._sort(batch.items)

    def _start(self, transport: str) -> None:
        """Send the adds that waited for the transport, then every add as it comes."""
        self.transport = transport
        if self._unsent:
            batch, self._unsent = self._unsent, []
            self._send_adds(batch)

    def interval(self) -> float:
        """How long a request's deltas are held between two hand-overs (see the module doc)."""
        return min(MAX_STREAM_DELAY_S, len(self.streams) * CHANNEL_PACE_PER_STREAM_S)

    def _sort(self, items: list) -> None:
        """A batch's items (`RequestOutput`, `Admitted` or `Refusal`), each to its request's
        stream, a refusal as its exception. The stream hands outputs out merged: one
        `RequestOutput` per delta, not per step."""
        for item in items:
            stream = self.streams.get(item.req_id)
            if stream is None:
                continue
            stream.deliver(item.error if isinstance(item, Refusal) else item)

    def _adds_failed(self, batch: list[EngineCoreRequest], error: BaseException) -> None:
        """The adds could not be sent: each request hears it as its answer."""
        for request in batch:
            stream = self.streams.get(request.req_id)
            if stream is not None:
                stream.deliver(error)


class RequestStream:
    """One request on a `Channel`."""

    def __init__(self, channel: Channel, request: EngineCoreRequest) -> None:
        self.channel = channel
        self.req_id = request.req_id
        self._request = request
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending_error: BaseException | None = None
        self._ready: list = []  # merged outputs of other choices, returned before reading more
        self._first: list = []  # outputs that came with the admission (`Admitted.outputs`)
        self._admitted = False
        self._due = 0.0  # the loop's time before which no delta but the last is handed out
        self._last_queued = False  # the last output, or an error, is in the queue
        self._waiter: asyncio.Future | None = None  # set while next() waits for its turn

    def deliver(self, item: Any) -> None:
        """The channel's reader hands over the next item (`Admitted`, a `RequestOutput` or an
        exception); the last output and an error end a wait for the next turn."""
        self._queue.put_nowait(item)
        if isinstance(item, BaseException) or getattr(item, "finished", False):
            self._last_queued = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def next(self) -> Any:
        if not self._admitted:
            return await self._add()
        if self._ready:
            return self._ready.pop(0)
        if self._pending_error is not None:
            raise self._pending_error
        if self._first:  # came with the admission: before anything the channel brought since
            items, self._first = self._first, []
        else:
            await self._turn()
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            items = [item]
        while not items[-1].finished and not self._queue.empty():  # catch up in one delta per choice
            following = self._queue.get_nowait()
            if isinstance(following, BaseException):
                self._pending_error = following
                break
            items.append(following)
        item, *self._ready = merge_outputs(items)
        if items[-1].finished:
            self.close()
        else:
            self._due = asyncio.get_running_loop().time() + self.channel.interval()
        return item

    async def _turn(self) -> None:
        """Wait until this request's next delta is due, unless its last output is in already."""
        loop = asyncio.get_running_loop()
        wait = self._due - loop.time()
        if wait <= 0 or self._last_queued:
            return
        self._waiter = loop.create_future()
        timer = loop.call_later(wait, _wake, self._waiter)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _add(self) -> Admitted:
        channel = self.channel
        channel.streams[self.req_id] = self  # before the add, which answers on this stream
        if channel.error is not None:
            self.close()
            raise channel.error
        channel.adds.notify(self._request)
        try:
            admitted = await self._queue.get()  # the admission comes first, on the channel
        except BaseException:
            self.close()
            raise
        if isinstance(admitted, BaseException):
            self.close()
            raise admitted
        self._admitted = True
        self._first = list(admitted.outputs)
        if self._first and self._first[-1].finished:
            self.close()
        return admitted

    def close(self) -> None:
        if self.channel.streams.get(self.req_id) is self:
            del self.channel.streams[self.req_id]


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
