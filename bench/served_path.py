"""What serving through the Ray actors costs, against the engine's own speed in the same run.

Serving adds work per request and per streamed message (the router, the backend front's
hand-offs, the channel). Default mode: the same N concurrent requests (a) in-process through
`LLMEngine` and (b) through `cluster.start(...)`'s driver API (router + backend actor + engine
core on the serving path's channels, no HTTP), with output tok/s beside the in-process
baseline.

`--http` (the GPU mode, see bench/served_http.py): the in-process engine against the same
workloads through `tandem serve`'s HTTP API with a streaming HTTP client, the ratio per row,
single-request TTFT, and a request-rate capacity curve.

    python -m bench.served_path                       # tiny model: the overhead dominates
    python -m bench.served_path --model smollm2-135m --num-requests 8 --max-tokens 64
    python3 -m bench.served_path --http --model qwen2.5-0.5b-random --device cuda --dtype bfloat16
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
    parser.add_argument("--repeats", type=int, default=2, help="runs per system; the best is reported")
    parser.add_argument("--out", default="out/bench_served_path.json", help="JSON output path")
    http = parser.add_argument_group("--http mode")
    http.add_argument("--http", action="store_true", help="in-process engine vs tandem serve's HTTP API")
    http.add_argument("--device", default="cpu", help="engine device (default cpu)")
    http.add_argument("--dtype", default="auto", help="engine dtype (default auto: bfloat16 on cuda)")
    http.add_argument("--scale", type=float, default=1.0,
                      help="scale every size (requests, prompt and output lengths, max_active) for a small run")
    http.add_argument("--ttft-requests", type=int, default=20, help="one-at-a-time requests for TTFT")
    http.add_argument("--capacity-rates", default="250,500,1000,1500",
                      help="comma-separated request rates of short requests ('' to skip)")
    http.add_argument("--capacity-seconds", type=float, default=3.0, help="seconds per capacity rate")
    http.add_argument("--capacity-clients", type=int, default=4, help="client processes for the capacity curve")
    http.add_argument("--http-replicas", type=int, default=0, help="Serve ingress replicas (0: the default)")
    http.add_argument("--ingress", choices=("auto", "direct", "proxy"), help="tandem serve --ingress (default auto)")
    http.add_argument("--max-pending", type=int, default=4096, help="the ingress's pending-request limit")
    http.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
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


def run_served(args: argparse.Namespace, tmp: Path) -> dict:
    from tandem import cluster

    tandem = cluster.start(model=args.model, backends=["cpu"], cpu_threads=args.threads,
                           max_active=args.num_requests, serve_http=False, rates=str(tmp / "rates.json"),
                           rates_cache=str(tmp / "rates-cache.json"), profile="never",
                           routing_log=str(tmp / "routing.jsonl"), metrics_port=_free_port(),
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
    if args.http:
        return main_http(args)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-served-"))
    (tmp / "rates.json").write_text(json.dumps({"cpu": {"prefill_tok_s": 500.0, "decode_tok_s": 50.0}}))
    baseline = run_in_process(args)
    rows = [{"system": "in-process LLMEngine", "output_tok_s": baseline, "messages_per_request": None}]
    rows.append({"system": "through actors, one channel per caller on the same-node wire", **run_served(args, tmp)})
    print(f"{args.num_requests} x ({args.prompt_tokens} -> {args.max_tokens}), model {args.model}, "
          f"{args.threads} engine thread(s), best of {args.repeats}")
    print(f"{'system':<72} {'out tok/s':>10} {'vs engine':>10} {'msgs/req':>9}")
    for row in rows:
        msgs = "" if row["messages_per_request"] is None else f"{row['messages_per_request']:.0f}"
        print(f"{row['system']:<72} {row['output_tok_s']:>10.0f} {row['output_tok_s'] / baseline:>9.2f}x {msgs:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "machine": machine_info(args.threads),
                               **run_stamp()}, indent=1) + "\n")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main_http(args: argparse.Namespace) -> int:
    from bench.served_http import run

    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **result, "machine": machine_info(args.threads, args.device),
                               **run_stamp()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
