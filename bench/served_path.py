"""What serving through the Ray actors costs, against the engine's own speed in the same run.

A backend actor adds work per streamed message (Ray's streaming-generator item, the event-loop
hand-off, pickling an output) and that work shares the actor process's GIL with the engine
thread. This script runs the same N concurrent requests (a) in-process through `LLMEngine` and
(b) through `cluster.start(...)`'s driver API (router + backend actor, no HTTP) once per
`--stream-intervals` value (uncapped) and once per `--max-stream-messages` cap, and prints
output tok/s for each beside the in-process baseline.

    python -m bench.served_path                       # tiny model: the overhead dominates
    python -m bench.served_path --model smollm2-135m --num-requests 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from bench._machine import machine_info, run_stamp
from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.served_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama-random", help="model preset (default tiny-llama-random)")
    parser.add_argument("--num-requests", type=int, default=16, help="concurrent requests (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=40, help="prompt tokens per request (default 40)")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per request, EOS ignored")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine (default 1)")
    parser.add_argument("--stream-intervals", default="0,0.01",
                        help="comma-separated stream_interval_s values to serve with (default 0,0.01)")
    parser.add_argument("--max-stream-messages", default="0,500",
                        help="comma-separated caps on one backend's messages per second, all streams "
                             "together, each served with the last stream interval (default 0,500; 0: none)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system; the best is reported")
    parser.add_argument("--out", default="out/bench_served_path.json", help="JSON output path")
    return parser.parse_args(argv)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    return [[3 + (i * 5 + j) % 250 for j in range(args.prompt_tokens)] for i in range(args.num_requests)]


def params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)


def run_in_process(args: argparse.Namespace) -> float:
    from tandem.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, max_active=args.num_requests, num_threads=args.threads))
    best = 0.0
    for rep in range(args.repeats + 1):  # the first run warms up
        for i, ids in enumerate(prompts(args)):
            engine.add_request(f"r{rep}-{i}", ids, params(args))
        start, num_tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        if rep:
            best = max(best, num_tokens / (time.perf_counter() - start))
    return best


def run_served(args: argparse.Namespace, stream_interval_s: float, max_messages: float, tmp: Path) -> dict:
    from tandem import cluster

    tandem = cluster.start(model=args.model, backends=["cpu"], cpu_threads=args.threads,
                           max_active=args.num_requests, serve_http=False, rates=str(tmp / "rates.json"),
                           rates_cache=str(tmp / "rates-cache.json"), profile="never",
                           routing_log=str(tmp / "routing.jsonl"), stream_interval_s=stream_interval_s,
                           max_stream_messages_per_s=max_messages,
                           log=lambda line: None)
    try:
        runs = [asyncio.run(_served_run(tandem, args)) for _ in range(args.repeats + 1)][1:]
    finally:
        tandem.shutdown()
    return max(runs, key=lambda r: r["output_tok_s"])


async def _served_run(tandem, args: argparse.Namespace) -> dict:
    async def one(ids: list[int]) -> tuple[int, int]:
        num_tokens = num_messages = 0
        async for out in tandem.agenerate(ids, params(args)):
            num_tokens += len(out.new_token_ids)
            num_messages += 1
        return num_tokens, num_messages

    start = time.perf_counter()
    results = await asyncio.gather(*(one(ids) for ids in prompts(args)))
    elapsed = time.perf_counter() - start
    return {"output_tok_s": sum(t for t, _ in results) / elapsed,
            "messages_per_request": sum(m for _, m in results) / len(results)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    tmp = Path(tempfile.mkdtemp(prefix="tandem-served-"))
    (tmp / "rates.json").write_text(json.dumps({"cpu": {"prefill_tok_s": 500.0, "decode_tok_s": 50.0}}))
    baseline = run_in_process(args)
    rows = [{"system": "in-process LLMEngine", "output_tok_s": baseline, "messages_per_request": None}]
    intervals = [float(v) for v in args.stream_intervals.split(",")]
    caps = [float(v) for v in args.max_stream_messages.split(",")]
    settings = [(i, 0.0) for i in intervals] + [(intervals[-1], c) for c in caps if c > 0]
    for interval, cap in settings:
        served = run_served(args, interval, cap, tmp)
        name = f"through actors, stream_interval_s={interval:g}" + (f", <= {cap:g} msgs/s" if cap else "")
        rows.append({"system": name, **served})
    print(f"{args.num_requests} x ({args.prompt_tokens} -> {args.max_tokens}), model {args.model}, "
          f"{args.threads} engine thread(s), best of {args.repeats}")
    print(f"{'system':<56} {'out tok/s':>10} {'vs engine':>10} {'msgs/req':>9}")
    for row in rows:
        msgs = "" if row["messages_per_request"] is None else f"{row['messages_per_request']:.0f}"
        print(f"{row['system']:<56} {row['output_tok_s']:>10.0f} {row['output_tok_s'] / baseline:>9.2f}x {msgs:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "machine": machine_info(args.threads),
                               **run_stamp()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
