"""A backend actor's relay for callers on other nodes: their channels over Ray, passed on to the
engine core's own channel server.

A caller on the backend's node talks to the engine core directly, on the same-node wire
(actors/wire.py). A caller on another node cannot reach that Unix socket, so it uses the
actor's Ray methods instead (`add_many`, sent one-way, and one `subscribe` stream per
channel); the actor connects to its core as that caller's channel and passes the frames on
as they are, encoded (`ChannelAdds` one way; the other way the core's bytes as they arrive,
so the frames written while a Ray item was in flight go as one item), without decoding
them: the core does the admissions for these channels exactly as for local ones, and the
caller paces its streams itself (actors/channel.py), whichever way the frames came.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tandem.actors import wire
from tandem.actors.messages import ChannelOpen
from tandem.engine.errors import BackendGoneError


RELAY_CHUNK_BYTES = 1 << 20  # the most one Ray item carries


class Relay:
    """One remote caller's channel. Its adds may come before its subscription (both are Ray
    calls): they wait for the connection to the core."""

    def __init__(self, channel_id: str, address: tuple[str, bytes]) -> None:
        self.channel_id = channel_id
        self._unsent: list[bytes] = []
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.get_running_loop().create_task(self._connect(address))

    async def _connect(self, address: tuple[str, bytes]) -> asyncio.StreamReader:
        reader, writer = await wire.connect(address)
        writer.write(wire.frame(ChannelOpen(self.channel_id)))
        for adds in self._unsent:
            writer.write(wire.frame_encoded(adds))
        self._unsent, self._writer = [], writer
        return reader

    def add(self, adds: bytes) -> None:
        """Pass on an encoded `ChannelAdds`."""
        if self._writer is None:
            self._unsent.append(adds)
        elif self._writer.is_closing():
            raise BackendGoneError(f"the engine core's wire for channel {self.channel_id} closed")
        else:
            self._writer.write(wire.frame_encoded(adds))

    async def batches(self) -> AsyncIterator[bytes]:
        """The channel's `ChannelBatch` frames, as the core wrote them (length-prefixed), in chunks
        of whatever has arrived: frames that pile up while the caller is slow travel as one Ray
        item, and a frame may end in the next chunk (`FrameSplitter` reassembles them)."""
        try:
            reader = await self._connected
            while True:
                chunk = await reader.read(RELAY_CHUNK_BYTES)
                if not chunk:
                    raise ConnectionError("end of stream")
                yield chunk
        except ConnectionError:
            raise BackendGoneError(f"the engine core's wire for channel {self.channel_id} closed") from None

    def close(self) -> None:
        """End the channel: the core aborts its unfinished requests."""
        self._connected.cancel()
        if self._writer is not None:
            self._writer.close()
