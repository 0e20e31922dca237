"""What one engine step costs the engine core's I/O thread: `python -m bench.fanout_step`.

The I/O thread (actors/core_io.py) runs in the engine core's process, so every microsecond of
Python it spends per step is taken from the step loop under the GIL when the step loop is
host-bound (a small model at a large batch on a GPU). This measures that work alone, on the
real code path: the step's `RequestOutput`s become `EngineCoreOutput`s, and `Fanout.on_step`
sorts and encodes them into one frame per channel. The frames go into an in-memory sink
instead of a socket (the write syscall is not counted). Steps are spaced `--step-ms` apart, as
in serving, for any timing the fan-out keeps.

Prints microseconds per step (median of the rounds' means; wall time of the work, which is
single-threaded, so CPU time on an idle core) for each (outputs per step,
channels) pair, and writes them with every round to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.actors.fanout import ChannelState, Fanout
from tandem.actors.messages import EngineCoreOutput
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
        fanout.on_step([], [], [EngineCoreOutput.of(o) for o in outputs])
        spent += time.perf_counter() - start
        time.sleep(step_s)
    return spent / num_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.fanout_step", description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", default="64,256", help="outputs per step, comma-separated")
    parser.add_argument("--channels", default="1,4", help="channels (caller processes), comma-separated")
    parser.add_argument("--steps", type=int, default=400, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=2.0, help="time between steps")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print(f"{'outputs':>8} {'channels':>8} {'us/step':>12} {'rounds':>30}")
    for num_outputs in (int(x) for x in args.outputs.split(",")):
        for num_channels in (int(x) for x in args.channels.split(",")):
            rounds = [1e6 * measure(num_outputs, num_channels, args.steps, args.step_ms / 1e3)
                      for _ in range(args.rounds)]
            median = statistics.median(rounds)
            rows.append({"outputs": num_outputs, "channels": num_channels, "us_per_step": round(median, 1),
                         "rounds_us": [round(r, 1) for r in rounds]})
            print(f"{num_outputs:>8} {num_channels:>8} {median:>12.1f} {' '.join(f'{r:.0f}' for r in rounds):>30}")
    if args.out is not None:
        from bench._machine import machine_info

        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "machine": machine_info(1),
                                        "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
