"""`tandem bench {seed,sweep,report}`: the end-to-end benchmarks through the HTTP endpoint.

    tandem bench seed  --out out/seed  [--num-requests 8,48] [--runs 3] [--report docs/benchmarks/x.md]
    tandem bench sweep --out out/sweep [--accel-max-active 1,2,4,8,16,32] [--cache-hit 0,0.5,0.96] ...
    tandem bench report out/seed --report docs/benchmarks/x.md      # re-render from the JSON

`seed` and `sweep` write one JSON per run under OUT/runs/, then OUT/summary.json (cells, means
and spreads, oracle), then the report if `--report` is given. See bench/seed.py and
bench/sweep.py for what each measures, bench/report.py for what the report shows.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        prompt, _, output = item.partition(":")
        if not output:
            raise argparse.ArgumentTypeError(f"--lengths wants PROMPT:OUTPUT pairs, got {item!r}")
        pairs.append((int(prompt), int(output)))
    return pairs


def _arms(text: str) -> list[str]:
    arms = [x.strip() for x in text.split(",") if x.strip()]
    if "accelerator-only" not in arms or "cost" not in arms:
        raise argparse.ArgumentTypeError("--arms must include accelerator-only and cost (the baseline and the hybrid)")
    return arms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{seed,sweep,report}", required=True)
    seed = sub.add_parser("seed", help="the spec's experiment: accelerator-only vs hybrid, 8 and 48 requests")
    _common(seed)
    seed.add_argument("--num-requests", type=_ints, default=[8, 48], help="request counts (default 8,48)")
    seed.add_argument("--runs", type=int, default=3, help="runs per arm, each on a fresh cluster (default 3)")
    seed.add_argument("--seed-prefix-tokens", type=int, default=508,
                      help="prompt tokens seeded into both caches (default 508: 496 reusable in 16-token blocks)")
    seed.add_argument("--max-active", type=int, default=4, help="accelerator max_active (default 4)")
    sweep = sub.add_parser("sweep", help="GPU concurrency, Poisson arrivals, cache-hit rate, prompt/output lengths")
    _common(sweep)
    sweep.add_argument("--num-requests", type=int, default=24, help="requests per cell (default 24)")
    sweep.add_argument("--runs", type=int, default=2, help="runs per arm and cell (default 2)")
    sweep.add_argument("--accel-max-active", type=_ints, default=[1, 2, 4, 8, 16, 32],
                       help="accelerator max_active values ('' skips; default 1,2,4,8,16,32)")
    sweep.add_argument("--arrival-rates", type=_floats, default=[5.0, 10.0, 20.0],
                       help="Poisson arrival rates, requests/s ('' skips; default 5,10,20)")
    sweep.add_argument("--cache-hit", type=_floats, default=[0.0, 0.5, 0.96],
                       help="seeded shared fraction of each prompt ('' skips; default 0,0.5,0.96)")
    sweep.add_argument("--lengths", type=_lengths, default=[(516, 32), (516, 512), (128, 128)],
                       help="PROMPT:OUTPUT token lengths ('' skips; default 516:32,516:512,128:128)")
    sweep.add_argument("--base-cache-hit", type=float, default=0.96, help="the base cell's cache hit (default 0.96)")
    sweep.add_argument("--base-max-active", type=int, default=4, help="the base cell's accelerator max_active (4)")
    report = sub.add_parser("report", help="render the markdown report and plots from a finished bench's JSON")
    report.add_argument("out", help="the bench's output folder (holds summary.json and runs/)")
    report.add_argument("--report", required=True, help="markdown file to write; plots go beside it")
    report.add_argument("--json", help="also write one JSON with the summary and every run here")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder for the JSON (runs/, summary.json, logs/)")
    parser.add_argument("--report", help="markdown report to write; plots go beside it")
    parser.add_argument("--json", help="also write one JSON with the summary and every run here")
    parser.add_argument("--model", default="smollm2-135m", help="model preset (default smollm2-135m)")
    parser.add_argument("--backends", default="cpu,auto", help="backends (default cpu,auto)")
    parser.add_argument("--cpu-threads", type=int, help="torch threads per cpu backend (default cores / cpu backends)")
    parser.add_argument("--cpu-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="cpu backends' dtype (default auto: float32)")
    parser.add_argument("--cpu-max-active", type=int, default=4, help="cpu backends' max_active (default 4)")
    parser.add_argument("--rates", help="rates file for every cluster (default: run tandem profile first)")
    parser.add_argument("--arms", type=_arms, default=["accelerator-only", "cost"],
                        help="policies to compare (default accelerator-only,cost; e.g. add least-requests)")
    parser.add_argument("--prompt-tokens", type=int, default=516, help="prompt tokens (default 516)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens, EOS ignored (default 128)")
    parser.add_argument("--interval-s", type=float, default=0.05, help="fixed arrival interval (default 0.05 s)")
    parser.add_argument("--temperature", type=float,
                        help="sampling temperature (default 0, or 1.0 seeded per request for *-random presets)")
    parser.add_argument("--time-budget-s", type=float, help="stop starting clusters/cells after this many seconds")
    parser.add_argument("--verbose", action="store_true", help="show the actors' logs")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "report":
        return _render(Path(args.out), args.report, args.json)
    from tqdm import tqdm

    from bench import harness, seed, sweep

    command = "tandem bench " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("bench") + 1:]) \
        if "bench" in sys.argv else "tandem bench " + args.bench_command
    out_dir = Path(args.out)
    if args.bench_command == "seed":
        max_ma, cells, dims = args.max_active, None, None
    else:
        cells, dims = sweep.build_cells(args)
        max_ma = max(c.accel_max_active for c in cells)
    ctx = harness.prepare(out_dir, args.model, args.backends, args.cpu_threads, args.cpu_dtype, args.cpu_max_active,
                          max_ma, args.rates, args.temperature, args.time_budget_s, args.verbose, command)
    if args.bench_command == "seed":
        ctx.meta.update(bench="seed", settings=seed.settings(args))
        with tqdm(total=seed.total_requests(args), unit="req", dynamic_ncols=True) as bar:
            records = seed.run_seed(ctx, args, bar)
    else:
        ctx.meta.update(bench="sweep", settings=sweep.settings(args, dims))
        with tqdm(total=sweep.total_requests(args, cells), unit="req", dynamic_ncols=True) as bar:
            records = sweep.run_sweep(ctx, args, cells, bar)
    _write_summary(out_dir, ctx.meta, records)
    if args.report:
        return _render(out_dir, args.report, args.json)
    return 0


def _write_summary(out_dir: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    from bench.harness import write_json
    from bench.summary import summarize

    summary = {"meta": meta, "cells": summarize(records, meta["accel_id"]),
               "runs": sorted(f"{r['cell']}-{r['arm']}-run{r['run']}.json" for r in records)}
    write_json(out_dir / "summary.json", summary)
    print(f"wrote {out_dir / 'summary.json'} ({len(records)} runs)")


def _render(out_dir: Path, report_path: str, json_path: str | None) -> int:
    from bench.report import load_bench, render_report

    summary, runs = load_bench(out_dir)
    written = render_report(summary, runs, Path(report_path))
    if json_path:
        Path(json_path).write_text(json.dumps({"summary": summary, "runs": runs}, separators=(",", ":")) + "\n")
        written.append(Path(json_path))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
