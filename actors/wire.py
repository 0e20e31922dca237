"""The same-node wire between a caller process and a server process (a backend's engine core,
the router actor): a Unix socket carrying length-prefixed typed messages, so a batch of routing
calls, a batch of adds and a step's batch of outputs each cost one socket write instead of a Ray
call or a streamed Ray object.

Why. Over Ray, each of a request's data hops (its routing call, its add, its admission, its
outputs) is a call or an item of a streaming generator: a task or an object on both sides
(serialization into Ray's object format, a gRPC message, the owner's bookkeeping, a
cross-thread wake-up). Under a high rate of short requests that makes the backend actor the
busiest process on the machine, puts tens of milliseconds between the ingress and the engine,
and caps the request rate well below what the engine serves (docs/benchmarks/served-path-h200.md
compares the two paths). When the caller and the server share a node none of that is needed:
the server listens on a socket, the caller learns its address with one Ray call to the actor
(`wire_address`) and then talks to it directly; a backend's socket is its engine core's own, so
a request's data skips the backend actor altogether. Ray stays the control plane (placement,
health, restarts, aborts, stats, reports); only the per-request data leaves it. vLLM's front
end and engine core talk the same way (a local socket, not RPC).

Frames, both ways: a 4-byte big-endian length, then one message of actors/messages.py in its
codec. A connection opens with the server's token (random bytes the caller got with the
address over Ray), checked before any frame is decoded (decoding may unpickle). On Linux the
socket lives in the abstract namespace (no file to clean up after a killed process); elsewhere
in a private temporary directory. Two protocols use it:

- a backend's channel (actors/channel.py is the caller's end; the backend's engine core
  process serves it, actors/core_io.py): the caller's first frame is a `ChannelOpen`, every
  later one a `ChannelAdds`; the core's frames are the `ChannelBatch`es `subscribe` would
  yield. Either end closing the socket ends the channel: the core aborts the channel's
  unfinished requests, and the caller fails them with `BackendGoneError` (it cannot tell a dead
  backend from a closed wire, and either way the backend is not serving them);
- batched calls (`call_server`, `WireCaller`; `WireCalls` answered by `WireAnswers`): the
  router's `place_many` (cluster/dispatch.py).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import uuid
from typing import Any, Awaitable, Callable

from tandem.actors import messages
from tandem.actors.detached import detached
from tandem.actors.messages import Message, WireAnswer, WireAnswers, WireCall, WireCalls

HEADER = struct.Struct("!I")
TOKEN_BYTES = 16


def frame(message: Message) -> bytes:
    """One frame: the length, then the encoded message."""
    return frame_encoded(messages.encode(message))


def frame_encoded(payload: bytes) -> bytes:
    """One frame of a message encoded already (a relay passes it on without decoding it)."""
    return HEADER.pack(len(payload)) + payload


class FrameSplitter:
    """Frames out of a byte stream that arrives in chunks of any size (a relay's Ray items)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        """The encoded messages of every frame `chunk` completes."""
        self._buffer += chunk
        payloads, start = [], 0
        while len(self._buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer, start)
            end = start + HEADER.size + size
            if end > len(self._buffer):
                break
            payloads.append(bytes(self._buffer[start + HEADER.size:end]))
            start = end
        del self._buffer[:start]
        return payloads


async def read_frame(reader: asyncio.StreamReader) -> Message:
    """The next frame's message; `asyncio.IncompleteReadError` at the end of the stream."""
    return messages.decode(await read_encoded(reader))


async def read_encoded(reader: asyncio.StreamReader) -> bytes:
    """The next frame's encoded message, not decoded."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(size)


async def connect(address: tuple[str, bytes]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection to a `WireServer`'s `address` (path, token)."""
    path, token = address
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)  # a listening Unix socket accepts at once: no wait for a handshake
    except OSError:
        sock.close()
        raise
    # made here, not by asyncio: uvloop (Serve's loop) rejects abstract names given as paths
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    writer.write(token)
    return reader, writer


def node_id() -> str:
    """This process's Ray node id; "" outside Ray (unit tests), without starting Ray for it."""
    import ray

    if not ray.is_initialized():
        return ""
    return ray.get_runtime_context().get_node_id()


async def same_node_address(handle: Any) -> tuple[str, bytes] | None:
    """The wire address of the actor behind `handle` (its `wire_address()`), if it runs on this
    node; None if it does not."""
    actor_node, address = await handle.wire_address.remote()
    return address if actor_node and actor_node == node_id() else None


class WireServer:
    """A Unix socket served on the running event loop, each connection that presents the
    token by `handler(reader, writer)`."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.directory: str | None = None
        if sys.platform.startswith("linux"):
            self.path = f"\0tandem-wire-{uuid.uuid4().hex}"  # abstract: no file
        else:
            self.directory = tempfile.mkdtemp(prefix="tandem-wire-")  # mode 0700: this user only
            self.path = os.path.join(self.directory, "s")
        self._server: asyncio.AbstractServer | None = None

    @property
    def address(self) -> tuple[str, bytes]:
        return self.path, self.token

    async def start(self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                    ) -> tuple[str, bytes]:
        async def checked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                token = await reader.readexactly(TOKEN_BYTES)
            except (asyncio.IncompleteReadError, ConnectionError):
                token = b""
            if not hmac.compare_digest(token, self.token):
                writer.close()
                return
            await handler(reader, writer)

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(1024)
        self._server = await asyncio.start_unix_server(checked, sock=sock)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


class WireClosed(ConnectionError):
    """The wire closed with calls in flight: the serving actor's process is gone (or was)."""


def call_server(fn: Callable[[list[tuple]], list[Any]]) -> Callable[..., Awaitable[None]]:
    """A `WireServer` handler answering `WireCaller`s: each `WireCalls` frame is answered in
    one `WireAnswers` frame (a result or an exception per call) by `fn` (a list of argument
    tuples -> a list of answers, as an actor's `*_many` method)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                calls = (await read_frame(reader)).calls
                answers = fn([tuple(call.args) for call in calls])
                writer.write(frame(WireAnswers([WireAnswer(call.call_id, answer)
                                                for call, answer in zip(calls, answers)])))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller is gone
        finally:
            writer.close()

    return serve


class WireCaller:
    """`CallBatcher`'s twin on the same-node wire: the calls of one event-loop turn go out as
    one frame and each caller awaits its own answer (an exception in the answer is raised).

    `address()` (awaited once, by a task started here) says where the server listens, or None
    when it is on another node; then every call goes to `fallback` (a `CallBatcher` on the
    same actor method) instead. Calls made before that is known wait for it. If the wire
    closes, the calls in flight and every later one raise `WireClosed`: the caller's owner
    drops this object and makes a new one, which asks for the address again."""

    def __init__(self, address: Callable[[], Awaitable[tuple[str, bytes] | None]], fallback: Any) -> None:
        self._fallback = fallback
        self._use_fallback = False
        self._writer: asyncio.StreamWriter | None = None
        self._futures: dict[int, asyncio.Future] = {}
        self._unsent: list[tuple[int, tuple]] = []
        self._next_id = 0
        self.error: BaseException | None = None
        self._task = detached(asyncio.get_running_loop().create_task, self._run(address))

    @property
    def closed(self) -> bool:
        return self.error is not None

    async def call(self, *args: Any) -> Any:
        if self._use_fallback:
            return await self._fallback.call(*args)
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        call_id, self._next_id = self._next_id, self._next_id + 1
        future = self._futures[call_id] = loop.create_future()
        if not self._unsent and self._writer is not None:
            detached(loop.call_soon, self._flush)
        self._unsent.append((call_id, args))
        try:
            return await future
        finally:
            self._futures.pop(call_id, None)  # answered, or cancelled: a late answer is dropped

    def _flush(self) -> None:
        calls, self._unsent = self._unsent, []
        calls = [WireCall(call_id, list(args)) for call_id, args in calls if call_id in self._futures]
        if calls and self._writer is not None:
            self._writer.write(frame(WireCalls(calls)))

    async def _run(self, address: Callable[[], Awaitable[tuple[str, bytes] | None]]) -> None:
        try:
            where = await address()
            if where is None:
                self._to_fallback()
                return
            reader, self._writer = await connect(where)
            self._flush()
            while True:
                for answer in (await read_frame(reader)).answers:
                    future = self._futures.get(answer.call_id)
                    if future is None or future.done():
                        continue
                    if isinstance(answer.value, BaseException):
                        future.set_exception(answer.value)
                    else:
                        future.set_result(answer.value)
        except (asyncio.IncompleteReadError, ConnectionError):
            self._close(WireClosed("the wire closed with calls in flight"))
        except BaseException as exc:  # the address call failed (the actor is gone), or the loop closes
            self._close(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _to_fallback(self) -> None:
        """Another node: the calls that waited, and all later ones, go over Ray."""
        self._use_fallback = True
        calls, self._unsent = self._unsent, []
        for call_id, args in calls:
            future = self._futures.get(call_id)
            if future is not None:
                asyncio.get_running_loop().create_task(_settle(future, self._fallback.call(*args)))

    def _close(self, error: BaseException) -> None:
        self.error = error
        if self._writer is not None:
            self._writer.close()
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)


async def _settle(future: asyncio.Future, call: Awaitable[Any]) -> None:
    try:
        result = await call
    except Exception as exc:
        if not future.done():
            future.set_exception(exc)
        return
    if not future.done():
        future.set_result(result)
