"""The same-node wire without Ray: frames round-trip whole and in order whatever their size, a
connection without the server's token is dropped unread, and batched calls get their own
answers (exceptions raised), wait for the connection, fail when it closes, or fall back."""

from __future__ import annotations

import asyncio
import pytest

from tandem.actors import wire
from tandem.actors.messages import ChannelAdds, ChannelOpen, EngineCoreRequest, WireAnswer, WireAnswers
from tandem.engine.sampling_params import SamplingParams


def test_frames_round_trip_in_order_across_a_unix_socket():
    received: list = []
    big = list(range(200_000))  # larger than any socket buffer: read in several chunks

    async def echo(reader, writer):
        try:
            while True:
                received.append(await wire.read_frame(reader))
                writer.write(wire.frame(WireAnswers([WireAnswer(len(received), "got")])))
        except asyncio.IncompleteReadError:
            writer.close()

    async def main():
        server = wire.WireServer()
        reader, writer = await wire.connect(await server.start(echo))
        for message in sent:
            writer.write(wire.frame(message))
        answers = [await wire.read_frame(reader) for _ in range(3)]
        writer.close()
        server.close()
        return answers

    sent = [ChannelOpen("ch-1"), ChannelAdds([EngineCoreRequest("r1", [1, 2], SamplingParams(), 1.5)]),
            ChannelAdds([EngineCoreRequest("big", big, SamplingParams(max_tokens=3))])]
    answers = asyncio.run(asyncio.wait_for(main(), 30))
    assert received == sent
    assert answers == [WireAnswers([WireAnswer(i, "got")]) for i in (1, 2, 3)]


def test_a_closed_wire_reads_as_an_incomplete_frame():
    async def hang_up(reader, writer):
        writer.write(wire.frame(ChannelOpen("partial"))[:3])  # half a header, then gone
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


def test_a_connection_without_the_token_is_closed_before_anything_is_decoded():
    reached = []

    async def handler(reader, writer):
        reached.append(True)

    async def main():
        server = wire.WireServer()
        path, token = await server.start(handler)
        reader, writer = await wire.connect((path, bytes(len(token))))  # the wrong token
        writer.write(wire.frame(ChannelOpen("hello")))
        closed = await reader.read() == b""
        writer.close()
        server.close()
        return closed

    assert asyncio.run(asyncio.wait_for(main(), 30)) and reached == []


def _square_server():
    def square_all(calls):
        return [ValueError(f"bad {x}") if x < 0 else x * x for (x,) in calls]

    return wire.call_server(square_all)


def test_calls_of_one_turn_share_a_frame_and_each_gets_its_answer():
    frames = []

    async def main():
        server = wire.WireServer()
        serve = _square_server()

        async def counting(reader, writer):  # counts the frames the caller sends
            real_read = reader.readexactly

            async def readexactly(n):
                data = await real_read(n)
                if n == wire.HEADER.size:
                    frames.append(n)
                return data

            reader.readexactly = readexactly
            await serve(reader, writer)

        address = await server.start(counting)

        async def where():
            await asyncio.sleep(0.05)  # calls made meanwhile wait for the connection
            return address

        caller = wire.WireCaller(where, fallback=None)
        results = await asyncio.gather(*(caller.call(x) for x in (1, 2, -3, 4)), return_exceptions=True)
        later = await caller.call(5)
        server.close()
        return results, later

    results, later = asyncio.run(asyncio.wait_for(main(), 30))
    assert results[:2] == [1, 4] and results[3] == 16 and isinstance(results[2], ValueError)
    assert later == 25 and len(frames) == 2  # the first four in one frame, then one


def test_a_closed_wire_fails_calls_in_flight_and_later_ones():
    async def main():
        server = wire.WireServer()
        gone = asyncio.Event()

        async def hang_up(reader, writer):
            await wire.read_frame(reader)  # take the call, never answer
            writer.close()
            gone.set()

        address = await server.start(hang_up)

        async def where():
            return address

        caller = wire.WireCaller(where, fallback=None)
        with pytest.raises(wire.WireClosed):
            await caller.call(1)
        assert caller.closed
        with pytest.raises(wire.WireClosed):
            await caller.call(2)
        server.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_calls_go_to_the_fallback_when_the_server_is_elsewhere():
    class Fallback:
        async def call(self, x):
            return ("fallback", x)

    async def main():
        async def elsewhere():
            await asyncio.sleep(0.01)
            return None

        caller = wire.WireCaller(elsewhere, Fallback())
        early = caller.call(1)  # made before the answer came: resent to the fallback
        return await asyncio.gather(early, asyncio.sleep(0.05, result=None)), await caller.call(2)

    (early, _), late = asyncio.run(asyncio.wait_for(main(), 30))
    assert early == ("fallback", 1) and late == ("fallback", 2)


def test_the_wire_works_on_uvloop_too():
    """Serve's replicas run on uvloop, which rejects Linux's abstract socket names as paths."""
    uvloop = pytest.importorskip("uvloop")

    async def echo(reader, writer):
        writer.write(wire.frame(await wire.read_frame(reader)))

    async def main():
        server = wire.WireServer()
        reader, writer = await wire.connect(await server.start(echo))
        writer.write(wire.frame(ChannelOpen("hello")))
        answer = await wire.read_frame(reader)
        writer.close()
        server.close()
        return answer

    assert uvloop.run(asyncio.wait_for(main(), 30)) == ChannelOpen("hello")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_adds_on_a_wire_that_closed_under_them_fail_as_backend_gone(loop, monkeypatch):
    """A backend killed between the reader task's last read and the next add: the add fails as
    BackendGoneError (which the dispatcher fails over), not as the transport's error (a 500)."""
    from tandem.actors import channel as channel_module
    from tandem.engine.errors import BackendGoneError

    run = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run
    opened = []

    async def backend(reader, writer):
        opened.append(await wire.read_frame(reader))  # the channel id, then it stays quiet

    async def main():
        server = wire.WireServer()
        address = await server.start(backend)

        async def same_node(handle):
            return address

        monkeypatch.setattr(channel_module.wire, "same_node_address", same_node)
        chan = channel_module.Channel(handle=None, key=(0, "backend"))
        while chan.transport != "wire":
            await asyncio.sleep(0.01)
        chan._writer.close()  # the wire is gone; the reader task has not seen it yet
        stream = channel_module.RequestStream(chan, EngineCoreRequest("r1", [1, 2, 3], SamplingParams()))
        try:
            await stream.next()
        except BackendGoneError as exc:
            return exc
        finally:
            chan.task.cancel()
            server.close()

    assert isinstance(run(asyncio.wait_for(main(), 30)), BackendGoneError)


def test_frames_split_back_out_of_chunks_of_any_size():
    """A relay passes the core's bytes on in whatever chunks arrived: the caller gets every
    frame back whole, in order, however the chunks cut them."""
    payloads = [bytes([i]) * n for i, n in enumerate((1, 0, 300, 5, 70_000))]
    stream = b"".join(wire.frame_encoded(p) for p in payloads)
    for size in (1, 3, 7, 4096, len(stream)):
        frames, got = wire.FrameSplitter(), []
        for start in range(0, len(stream), size):
            got += frames.feed(stream[start:start + size])
        assert got == payloads, size
    assert wire.FrameSplitter().feed(stream[:3]) == []  # a header cut short waits for the rest
