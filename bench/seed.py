"""`tandem bench seed`: the design's experiment through the HTTP endpoint.

For each run (default 3) and arm (accelerator-only, hybrid = `cost`, optionally more policies),
a fresh cluster (bench/harness.py); in it, for each request count (default 8 and 48), a
workload of identical 516-token prompts, one every 50 ms, 128 tokens each with EOS ignored,
both caches seeded with the prompt's first 508 tokens (496 reusable). Each request count uses
its own prompt, so the second measurement in a cluster finds only its own seeded prefix.
bench/runner.py runs the plan; `tandem bench sweep --with-seed` runs these cells in the same
clusters as the sweep's base cells.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.runner import PlanItem
from bench.workload import CellSpec


def seed_items(args: argparse.Namespace, runs: int) -> list[PlanItem]:
    return [PlanItem(CellSpec(num_requests=n, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                              interval_s=args.interval_s, accel_max_active=args.max_active, kind="spec",
                              seed_prefix_tokens=args.seed_prefix_tokens), runs, "seed")
            for n in args.seed_num_requests]


def settings(args: argparse.Namespace, runs: int) -> dict[str, Any]:
    return {"num_requests": args.seed_num_requests, "runs": runs, "arms": args.arms,
            "prompt_tokens": args.prompt_tokens, "seed_prefix_tokens": args.seed_prefix_tokens,
            "max_tokens": args.max_tokens, "interval_s": args.interval_s, "max_active": args.max_active}
