"""`tandem bench sweep`: the questions the design left open, one dimension at a time.

The base cell is the design's setting with a unique suffix per request (so every request hits
exactly the seeded prefix): N requests every 50 ms, 516-token prompts, 96% of them cached,
128 output tokens, accelerator max_active 4 (the CPU backend stays at `--cpu-max-active`).
Each dimension varies one parameter from the base:

  --accel-max-active 1,2,4,8,16,32   the accelerator's concurrency
  --arrival-rates 5,10,20            Poisson arrivals at these rates (requests/s)
  --cache-hit 0,0.5,0.96             shared, seeded fraction of each prompt
  --lengths 516:32,128:128           prompt:output token lengths

An empty list skips a dimension; cells that coincide (the base appears in several) run once.
bench/runner.py runs them: the cells at the base max_active share their clusters (and, with
`--with-seed`, the design's cells share them too), each other max_active needs clusters of its
own. `--time-budget-s` stops starting clusters and cells once the budget is spent.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from bench.runner import PlanItem
from bench.workload import CellSpec


def build_cells(args: argparse.Namespace) -> tuple[list[CellSpec], dict[str, list[str]]]:
    """The unique cells, base max_active first, and for each dimension the names of its cells."""
    base = CellSpec(num_requests=args.num_requests, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                    cache_hit=args.base_cache_hit, interval_s=args.interval_s, accel_max_active=args.base_max_active)
    dims = {
        "accel_max_active": [replace(base, accel_max_active=m) for m in args.accel_max_active],
        "arrival_rate": [replace(base, arrival="poisson", rate_per_s=r) for r in args.arrival_rates],
        "cache_hit": [replace(base, cache_hit=h) for h in args.cache_hit],
        "lengths": [replace(base, prompt_tokens=p, max_tokens=o) for p, o in args.lengths],
    }
    cells: dict[str, CellSpec] = {}
    for dim_cells in dims.values():
        for cell in dim_cells:
            cells.setdefault(cell.name, cell)
    order = list(cells)
    ordered = sorted(cells.values(), key=lambda c: (c.accel_max_active != args.base_max_active, order.index(c.name)))
    return ordered, {dim: [c.name for c in dim_cells] for dim, dim_cells in dims.items() if dim_cells}


def sweep_items(cells: list[CellSpec], runs: int, other_runs: int | None, base_max_active: int) -> list[PlanItem]:
    """Cells at the base max_active get `runs`; the others `other_runs` (default: the same)."""
    other = runs if other_runs is None else other_runs
    return [PlanItem(c, runs if c.accel_max_active == base_max_active else other, "sweep") for c in cells]


def settings(args: argparse.Namespace, dims: dict[str, list[str]]) -> dict[str, Any]:
    return {"num_requests": args.num_requests, "runs": args.runs, "other_max_active_runs": args.other_max_active_runs,
            "arms": args.arms, "dimensions": dims, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "interval_s": args.interval_s, "base_cache_hit": args.base_cache_hit,
            "base_max_active": args.base_max_active}
