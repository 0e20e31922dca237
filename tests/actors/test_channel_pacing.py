"""The merge of a request's outputs and a channel's pacing, without Ray (milliseconds).

`merge_outputs` keeps one delta per choice whatever the sequence, choices and logprobs
included, and survives the wire. The core writes every step to its channels as it comes; the
caller's `RequestStream` hands a request's first and last outputs over at once and paces the
rest by its channel's size.
"""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from tandem.actors.channel import CHANNEL_PACE_PER_STREAM_S, MAX_STREAM_DELAY_S, Channel, RequestStream
from tandem.actors.fanout import ChannelState, Fanout
from tandem.actors.messages import ChannelBatch, EngineCoreRequest, decode, encode
from tandem.engine.errors import BackendGoneError
from tandem.engine.outputs import RequestOutput, Usage, merge_outputs
from tandem.engine.sampling_params import SamplingParams


def _output(rng: random.Random, step: int, index: int, finished: bool, with_logprobs: bool) -> RequestOutput:
    ids = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
    logprobs = [(-0.5, [i], [-0.5]) for i in ids] if with_logprobs else None
    return RequestOutput("r", ids, "".join(chr(97 + i % 26) for i in ids), finished,
                         "length" if finished else None, Usage(7, step, 2), 1.0, 1.1, 1.2 + step,
                         2.0 if finished else None, index, logprobs)


def test_merged_outputs_are_one_delta_per_choice_and_cross_the_wire_unchanged():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 3)
        length = rng.randint(1, 8)
        with_logprobs = trial % 2 == 0
        outs = [_output(rng, step, rng.randrange(n), step == length - 1 and rng.random() < 0.5, with_logprobs)
                for step in range(length)]
        merged = merge_outputs(outs)
        assert sorted(o.index for o in merged) == sorted({o.index for o in outs})
        for out in merged:  # each choice's tokens, text and logprobs, in order
            own = [o for o in outs if o.index == out.index]
            assert out.new_token_ids == [t for o in own for t in o.new_token_ids]
            assert out.new_text == "".join(o.new_text for o in own)
            assert out.usage == own[-1].usage and out.finished == own[-1].finished
            if with_logprobs:
                assert out.logprobs == [lp for o in own for lp in o.logprobs]
        assert decode(encode(ChannelBatch(merged))).items == merged


def _output_of(req_id: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(req_id, [1], "a", finished, "stop" if finished else None, Usage(3, 1, 0))


def test_the_core_writes_every_step_one_frame_per_channel():
    fanout = Fanout("b", to_core=lambda command: None)
    channels = [RecordingChannel("c0"), RecordingChannel("c1")]
    for i, channel in enumerate(channels * 2):
        channel.req_ids.add(f"r{i}")
        fanout.channel_of[f"r{i}"] = channel
    for step in range(3):
        fanout.on_step([], [], [_output_of(f"r{i}", finished=step == 2) for i in range(4)])
    assert [[o.req_id for o in batch] for batch in channels[0].sent] == [["r0", "r2"]] * 3
    assert [[o.req_id for o in batch] for batch in channels[1].sent] == [["r1", "r3"]] * 3
    assert not fanout.channel_of and not channels[0].req_ids  # finished: they left their channels


def _stream(interval: float) -> tuple[RequestStream, SimpleNamespace]:
    channel = SimpleNamespace(streams={}, interval=lambda: interval)
    stream = RequestStream(channel, EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=8)))
    stream._admitted = True  # past its admission: what is paced is the outputs after it
    channel.streams["r"] = stream
    return stream, channel


def _out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [ord(text)], text, finished, "length" if finished else None, Usage(2, 1, 0))


def test_after_its_first_output_a_request_gets_merged_deltas_at_most_every_interval():
    async def scenario():
        stream, _ = _stream(interval=0.2)
        stream._first = [_out("a")]
        t0 = time.monotonic()
        assert (await stream.next()).new_text == "a"  # the first: at once
        stream.deliver(_out("b"))
        stream.deliver(_out("c"))
        second = await stream.next()  # waits for its turn, then one delta of what piled up
        assert second.new_text == "bc" and time.monotonic() - t0 >= 0.2
        stream.deliver(_out("d"))
        reader = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.01)
        assert not reader.done()  # its turn has not come
        stream.deliver(_out("e", finished=True))  # the last output ends the wait
        last = await asyncio.wait_for(reader, 0.1)
        assert last.new_text == "de" and last.finished and time.monotonic() - t0 < 0.35
        assert isinstance(last, RequestOutput) and last.usage == Usage(2, 1, 0)  # handed out as the engine's type

    asyncio.run(scenario())


def test_an_error_ends_the_wait_and_a_small_interval_does_not_hold():
    async def scenario():
        stream, _ = _stream(interval=10.0)
        stream._first = [_out("a")]
        await stream.next()
        reader = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.01)
        stream.deliver(BackendGoneError("gone"))
        with pytest.raises(BackendGoneError):
            await asyncio.wait_for(reader, 0.5)
        quick, _ = _stream(interval=0.0)
        quick._first = [_out("a")]
        await quick.next()
        quick.deliver(_out("b"))
        assert (await asyncio.wait_for(quick.next(), 0.5)).new_text == "b"

    asyncio.run(scenario())


def test_the_interval_grows_with_the_channel_and_stops_at_the_cap():
    small = SimpleNamespace(streams=dict.fromkeys("ab"))
    big = SimpleNamespace(streams=dict.fromkeys(range(10_000)))
    assert Channel.interval(small) == 2 * CHANNEL_PACE_PER_STREAM_S  # 0.5 ms
    assert Channel.interval(big) == MAX_STREAM_DELAY_S


def test_a_dropped_request_sends_nothing_more():
    channel = ChannelState()
    channel.req_ids.add("r")
    channel.hold([_output_of("r")])
    channel.drop("r")
    assert channel.take_held() == [] and not channel.req_ids


class RecordingChannel(ChannelState):
    def __init__(self, channel_id: str) -> None:
        super().__init__(channel_id)
        self.sent: list = []

    def send(self, items: list) -> None:
        self.sent.append(items)
