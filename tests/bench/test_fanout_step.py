"""`tandem bench fanout-step` runs the real fan-out on a few steps and reports every pair it was asked."""

from __future__ import annotations

import json

from bench.fanout_step import _Sink, measure, measure_caller
from tandem.cluster.cli import main
from tandem.engine.outputs import RequestOutput, Usage


def test_the_report_has_every_pair_and_round(tmp_path):
    assert measure(num_outputs=8, num_channels=2, num_steps=3, step_s=0.0) > 0
    out = tmp_path / "fanout.json"
    assert measure_caller(num_streams=4, steps_per_read=2, num_reads=2) > 0
    assert main(["bench", "fanout-step", "--outputs", "4,8", "--channels", "1,2", "--steps", "4", "--rounds", "2", "--step-ms", "0",
                 "--caller-streams", "2,3", "--steps-per-read", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(c["streams"], len(c["rounds_us"])) for c in report["caller"]] == [(2, 2), (3, 2)]
    rows = report["rows"]
    assert [(r["outputs"], r["channels"]) for r in rows] == [(4, 1), (4, 2), (8, 1), (8, 2)]
    assert all(len(r["rounds_us"]) == 2 and r["us_per_step"] > 0 for r in rows)


def test_a_step_writes_one_frame_per_channel_with_every_first_output():
    from tandem.actors.fanout import ChannelState, Fanout
    from tandem.actors.messages import ChannelBatch, decode
    from tandem.actors.wire import HEADER

    frames: list[bytes] = []

    class Recording(_Sink):
        def write(self, data: bytes) -> None:
            frames.append(data)

    fanout = Fanout("b", lambda command: None)
    channel = ChannelState("c", writer=Recording())  # type: ignore[arg-type]
    outputs = [RequestOutput(f"r{i}", [i], "x", False, None, Usage(3, 1, 0)) for i in range(5)]
    for out in outputs:
        channel.req_ids.add(out.req_id)
        fanout.channel_of[out.req_id] = channel
    fanout.on_step([], [], outputs)
    assert len(frames) == 1
    batch = decode(frames[0][HEADER.size:])
    assert isinstance(batch, ChannelBatch) and [o.req_id for o in batch.items] == [f"r{i}" for i in range(5)]
