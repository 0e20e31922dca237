"""The same-node wire's framing and server, without Ray: frames round-trip whole, in order,
whatever their size, and the server's private directory goes when it closes."""

from __future__ import annotations

import asyncio
import os
import stat

from tandem.actors import wire


def test_frames_round_trip_in_order_across_a_unix_socket():
    received: list = []
    big = list(range(200_000))  # larger than any socket buffer: read in several chunks

    async def echo(reader, writer):
        try:
            while True:
                received.append(await wire.read_frame(reader))
                writer.write(wire.encode(("got", len(received))))
        except asyncio.IncompleteReadError:
            writer.close()

    async def main():
        server = wire.WireServer()
        path = await server.start(echo)
        assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
        reader, writer = await wire.connect(path)
        for message in ("ch-1", [("r1", [1, 2], None, 1.5)], big):
            writer.write(wire.encode(message))
        answers = [await wire.read_frame(reader) for _ in range(3)]
        writer.close()
        server.close()
        return answers, server.directory

    answers, directory = asyncio.run(asyncio.wait_for(main(), 30))
    assert received == ["ch-1", [("r1", [1, 2], None, 1.5)], big]
    assert answers == [("got", 1), ("got", 2), ("got", 3)]
    assert not os.path.exists(directory)


def test_a_closed_wire_reads_as_an_incomplete_frame():
    async def hang_up(reader, writer):
        writer.write(wire.encode("partial")[:3])  # half a header, then gone
        writer.close()

    async def main():
        server = wire.WireServer()
        reader, writer = await wire.connect(await server.start(hang_up))
        try:
            await wire.read_frame(reader)
        except asyncio.IncompleteReadError:
            return True
        finally:
            writer.close()
            server.close()
        return False

    assert asyncio.run(asyncio.wait_for(main(), 30))
