"""`tandem bench fanout-step`: what one engine step costs the engine core's I/O thread.

The I/O thread (actors/core_io.py) shares the engine core's GIL, so its Python per step is taken
from a host-bound step loop (a small model at a large batch on a GPU). This times that work
alone on the real code path: `Fanout.on_step` sorts a step's `RequestOutput`s into one frame
per channel and encodes each, written to memory instead of a socket, steps `--step-ms` apart:
microseconds per step, the median of the rounds' means, per (outputs, channels). And the caller's side (an ingress replica): decoding the frames, handing each item
to its stream (`deliver`, as the channel's reader does) and each stream's merged delta once per
`--steps-per-read` steps (its pacing).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench._machine import stamp
from bench.harness import ints, write_json
from tandem.actors.fanout import ChannelState, Fanout
from tandem.engine.outputs import RequestOutput, Usage


class _Sink:
    """The part of an `asyncio.StreamWriter` a channel uses, writing into memory."""

    class _Transport:
        @staticmethod
        def get_write_buffer_size() -> int:
            return 0

    transport = _Transport()

    def __init__(self) -> None:
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self.num_bytes += len(data)


def _outputs(num: int) -> list[RequestOutput]:
    return [RequestOutput(f"cmpl-{i:032x}", [1000 + i], " tok", False, None, Usage(512, 10, 0), 1.0, 1.0, 1.0)
            for i in range(num)]


def measure(num_outputs: int, num_channels: int, num_steps: int, step_s: float) -> float:
    """Mean seconds per step of converting and fanning out `num_outputs` outputs."""
    fanout = Fanout("bench", lambda command: None)
    channels = [ChannelState(f"c{k}", writer=_Sink()) for k in range(num_channels)]  # type: ignore[arg-type]
    outputs = _outputs(num_outputs)
    for i, out in enumerate(outputs):
        channel = channels[i % num_channels]
        channel.req_ids.add(out.req_id)
        fanout.channel_of[out.req_id] = channel
    spent = 0.0
    for _ in range(num_steps):
        start = time.perf_counter()  # wall time of one thread's work; the thread's CPU clock is a syscall
        fanout.on_step([], [], outputs)
        spent += time.perf_counter() - start
        time.sleep(step_s)
    return spent / num_steps


def measure_caller(num_streams: int, steps_per_read: int, num_reads: int) -> float:
    """Mean seconds per step that a caller with `num_streams` streams on one channel spends on
    the core's frames: decoding each step's frame, handing its items to the streams (`deliver`)
    and, every `steps_per_read` steps (its pacing), each stream's merged delta (`next()`)."""
    from tandem.actors.channel import RequestStream
    from tandem.actors.messages import Admitted, ChannelBatch, EngineCoreRequest, decode, encode
    from tandem.engine.sampling_params import SamplingParams

    async def run() -> float:
        # The caller's end of a channel without its transport: the streams, the add hook, no pacing.
        channel = SimpleNamespace(streams={}, error=None, interval=lambda: 0.0,
                                  adds=SimpleNamespace(notify=lambda request: None))
        streams = [RequestStream(channel, EngineCoreRequest(f"cmpl-{i:032x}", [1], SamplingParams(max_tokens=1 << 20)))
                   for i in range(num_streams)]
        admissions = [asyncio.ensure_future(stream.next()) for stream in streams]
        await asyncio.sleep(0)
        for stream in streams:
            stream.deliver(Admitted(stream.req_id, "bench", 1, [], 0.0, 0.0))
        await asyncio.gather(*admissions)
        frames = [encode(ChannelBatch(_outputs(num_streams))) for _ in range(steps_per_read)]
        start = time.perf_counter()
        for _ in range(num_reads):
            for payload in frames:
                for item in decode(payload).items:
                    channel.streams[item.req_id].deliver(item)
            for stream in streams:
                await stream.next()
        return (time.perf_counter() - start) / (num_reads * steps_per_read)

    return asyncio.run(run())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--outputs", type=ints, default=[64, 256], help="outputs per step (64,256)")
    parser.add_argument("--channels", type=ints, default=[1, 4], help="channels, i.e. caller processes (1,4)")
    parser.add_argument("--steps", type=int, default=400, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=2.0, help="time between steps")
    parser.add_argument("--caller-streams", type=ints, default=[16, 64], help="streams on the caller's channel")
    parser.add_argument("--steps-per-read", type=int, default=8,
                        help="steps between two reads of a stream (its pacing: 16 ms over 2 ms steps)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    print(f"{'outputs':>8} {'channels':>8} {'us/step':>12} {'rounds':>30}")
    for num_outputs in args.outputs:
        for num_channels in args.channels:
            rounds = [1e6 * measure(num_outputs, num_channels, args.steps, args.step_ms / 1e3)
                      for _ in range(args.rounds)]
            median = statistics.median(rounds)
            rows.append({"outputs": num_outputs, "channels": num_channels, "us_per_step": round(median, 1),
                         "rounds_us": [round(r, 1) for r in rounds]})
            print(f"{num_outputs:>8} {num_channels:>8} {median:>12.1f} {' '.join(f'{r:.0f}' for r in rounds):>30}")
    callers: list[dict[str, Any]] = []
    print(f"\ncaller side, one channel: {'streams':>8} {'steps/read':>10} {'us/step':>10}")
    for num_streams in args.caller_streams:
        rounds = [1e6 * measure_caller(num_streams, args.steps_per_read, max(1, args.steps // args.steps_per_read))
                  for _ in range(args.rounds)]
        median = statistics.median(rounds)
        callers.append({"streams": num_streams, "steps_per_read": args.steps_per_read, "us_per_step": round(median, 1),
                        "rounds_us": [round(r, 1) for r in rounds]})
        print(f"{'':>26}{num_streams:>8} {args.steps_per_read:>10} {median:>10.1f}")
    if args.out is not None:
        write_json(args.out, {**stamp(1), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                              "caller": callers})
    return 0
