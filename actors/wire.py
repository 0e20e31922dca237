"""The same-node wire between a caller process and a backend actor: a Unix socket carrying
length-prefixed pickles, so a batch of adds and a step's batch of outputs each cost one socket
write instead of a Ray call or a streamed Ray object.

Why. A request's data hops (its add, its admission, its outputs) used to ride Ray: a one-way
`add_many` call per event-loop turn and an item of a `subscribe` streaming generator per
hand-over. Each costs a task or an object on both sides (serialization into Ray's object
format, a gRPC message, the owner's bookkeeping, a cross-thread wake-up), which under a high
rate of short requests made the backend actor the busiest process on the machine and put
tens of milliseconds between the ingress and the engine. When the caller and the backend share
a node, none of that is needed: the backend listens on a socket in a private directory, and
the caller, after learning its path with one Ray call (`BackendActor.wire_address`), talks to
it directly. Ray stays the control plane (placement, restarts, the router, aborts, stats);
only the per-request data leaves it. This is how vLLM's front end and engine core talk (a
local socket, not RPC), one level up.

Frames, both ways: a 4-byte big-endian length, then a pickle (protocol 5). The caller's first
frame is its channel id; every later frame is a list of adds `(req_id, prompt_token_ids,
params, arrival_time)`. The backend's frames are the lists `subscribe` would yield. Either end
closing the socket ends the channel: the backend aborts the channel's unfinished requests, and
the caller fails them with `BackendGone` (it cannot tell a dead backend from a closed wire, and
either way the backend is not serving them). The socket's directory is readable by this user
only, so the pickles are as trusted as Ray's own.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import struct
import tempfile
from typing import Any, Awaitable, Callable

HEADER = struct.Struct("!I")


def encode(obj: Any) -> bytes:
    """One frame: the length, then the pickle."""
    payload = pickle.dumps(obj, protocol=5)
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; `asyncio.IncompleteReadError` at the end of the stream."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


async def connect(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(path)


class WireServer:
    """A Unix socket in a fresh private directory, served on the running event loop, each
    connection by `handler(reader, writer)`."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="tandem-wire-")  # mode 0700: this user only
        self.path = os.path.join(self.directory, "backend.sock")
        self._server: asyncio.AbstractServer | None = None

    async def start(self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> str:
        self._server = await asyncio.start_unix_server(handler, path=self.path)
        return self.path

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        shutil.rmtree(self.directory, ignore_errors=True)
