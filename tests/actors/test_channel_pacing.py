"""The backend's merge of the core's outputs and a channel's pacing, without Ray (milliseconds).

`merge_core_outputs` is `merge_outputs` for the core's `EngineCoreOutput`s: they must agree on
every sequence of outputs, choices and logprobs included. `ChannelState.take_due` hands a
request's first and last outputs over at once and paces the rest by the channel's size.
"""

from __future__ import annotations

import random

from tandem.actors.fanout import CHANNEL_PACE_PER_STREAM_S, MAX_STREAM_DELAY_S, ChannelState
from tandem.actors.messages import EngineCoreOutput, merge_core_outputs
from tandem.engine.outputs import RequestOutput, Usage, merge_outputs


def _output(rng: random.Random, step: int, index: int, finished: bool, with_logprobs: bool) -> RequestOutput:
    ids = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
    logprobs = [(-0.5, [i], [-0.5]) for i in ids] if with_logprobs else None
    return RequestOutput("r", ids, "".join(chr(97 + i % 26) for i in ids), finished,
                         "length" if finished else None, Usage(7, step, 2), 1.0, 1.1, 1.2 + step,
                         2.0 if finished else None, index, logprobs)


def test_merge_core_outputs_agrees_with_merge_outputs():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 3)
        length = rng.randint(1, 8)
        with_logprobs = trial % 2 == 0
        outs = [_output(rng, step, rng.randrange(n), step == length - 1 and rng.random() < 0.5, with_logprobs)
                for step in range(length)]
        expected = [EngineCoreOutput.of(o) for o in merge_outputs(outs)]
        assert merge_core_outputs([EngineCoreOutput.of(o) for o in outs]) == expected


def _output_of(req_id: str, finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, [1], "a", finished, "stop" if finished else None, 3, 1, 0)


def test_first_and_last_outputs_go_at_once_the_rest_by_the_channel_size():
    channel = ChannelState()
    channel.req_ids.update(f"r{i}" for i in range(40))
    interval = min(MAX_STREAM_DELAY_S, 40 * CHANNEL_PACE_PER_STREAM_S)
    channel.held["r0"] = [_output_of("r0")]
    assert [o.req_id for o in channel.take_due(100.0)] == ["r0"]  # first output: at once
    channel.held["r0"] = [_output_of("r0")]
    assert channel.take_due(100.0 + interval / 2) == []  # held
    channel.held["r0"].append(_output_of("r0"))
    due = channel.take_due(100.0 + interval)  # due: both steps in one output
    assert len(due) == 1 and due[0].new_token_ids == [1, 1] and due[0].new_text == "aa"
    channel.held["r0"] = [_output_of("r0", finished=True)]
    assert [o.finished for o in channel.take_due(100.0 + interval + 1e-4)] == [True]  # last: at once
    assert "r0" not in channel.next_send and not channel.held


def test_a_small_channel_is_not_held_and_a_big_one_at_most_the_cap():
    small, big = ChannelState(), ChannelState()
    small.req_ids.update({"a", "b"})
    big.req_ids.update(f"r{i}" for i in range(10_000))
    for channel, req_id in ((small, "a"), (big, "r0")):
        channel.held[req_id] = [_output_of(req_id)]
        channel.take_due(0.0)
    small.held["a"] = [_output_of("a")]
    assert small.take_due(2 * CHANNEL_PACE_PER_STREAM_S)  # 2 streams: 0.5 ms
    big.held["r0"] = [_output_of("r0")]
    assert big.take_due(MAX_STREAM_DELAY_S)  # never longer than the cap


def test_a_dropped_request_sends_nothing_more():
    channel = ChannelState()
    channel.req_ids.add("r")
    channel.held["r"] = [_output_of("r")]
    channel.drop("r")
    assert channel.take_due(1.0) == [] and not channel.req_ids
