"""`tandem bench seed`: the spec's experiment through the HTTP endpoint.

For each run (default 3) and arm (accelerator-only, hybrid = `cost`, optionally more policies),
a fresh cluster (bench/harness.py); in it, for each request count (default 8 and 48), a
workload of identical 516-token prompts, one every 50 ms, 128 tokens each with EOS ignored,
both caches seeded with the prompt's first 508 tokens (496 reusable). Each request count uses
its own prompt, so the second measurement in a cluster finds only its own seeded prefix.
Arms alternate their order from run to run, so slow drift (thermal, other load) does not
always favour the same arm.

Writes `OUT/runs/<cell>-<arm>-run<k>.json` per run, `OUT/summary.json`, and, with `--report`,
the markdown report and its plots (bench/report.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.harness import BenchContext, measure, write_json
from bench.workload import spec_workload


def arm_order(arms: list[str], run: int) -> list[str]:
    return list(arms) if run % 2 else list(reversed(arms))


def run_seed(ctx: BenchContext, args: argparse.Namespace, bar: Any) -> list[dict[str, Any]]:
    """Every run and arm; returns the run records (also written as JSON as they finish)."""
    records: list[dict[str, Any]] = []
    max_n = max(args.num_requests)
    for run in range(1, args.runs + 1):
        for arm in arm_order(args.arms, run):
            if ctx.budget.spent():
                bar.write(f"time budget spent: skipping run {run} {arm} and later")
                return records
            bar.set_description(f"run {run} {arm}: starting cluster")
            with ctx.cluster(arm, args.max_active, max_pending_requests=max_n + 16) as cluster:
                for n in args.num_requests:
                    workload = spec_workload(n, args.prompt_tokens, args.seed_prefix_tokens, args.max_tokens,
                                             args.interval_s, token_seed=1000 * run + n, name=f"n{n}")
                    bar.set_description(f"run {run} {arm} n={n}")
                    record = measure(cluster, workload, ctx.temperature, on_done=lambda _: bar.update(1))
                    record.update(bench="seed", cell=f"n{n}", arm=arm, run=run)
                    write_json(ctx.out_dir / "runs" / f"n{n}-{arm}-run{run}.json", record)
                    records.append(record)
    return records


def total_requests(args: argparse.Namespace) -> int:
    return args.runs * len(args.arms) * sum(args.num_requests)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"num_requests": args.num_requests, "runs": args.runs, "arms": args.arms,
            "prompt_tokens": args.prompt_tokens, "seed_prefix_tokens": args.seed_prefix_tokens,
            "max_tokens": args.max_tokens, "interval_s": args.interval_s, "max_active": args.max_active}
