"""`tandem bench sweep`: the questions the spec left open, one dimension at a time.

The base cell is the spec's setting with a unique suffix per request (so every request hits
exactly the seeded prefix): N requests every 50 ms, 516-token prompts, 96% of them cached,
128 output tokens, accelerator max_active 4 (the CPU backend stays at `--cpu-max-active`).
Each dimension varies one parameter from the base:

  --accel-max-active 1,2,4,8,16,32   the accelerator's concurrency
  --arrival-rates 5,10,20            Poisson arrivals at these rates (requests/s)
  --cache-hit 0,0.5,0.96             shared, seeded fraction of each prompt
  --lengths 516:32,516:512,128:128   prompt:output token lengths

An empty list skips a dimension; cells that coincide (the base appears in several) run once.
Clusters are fresh per arm and run and per accelerator max_active (that needs new engines);
the cells that share a max_active run one after another in the same cluster, each with its
own prompts and seeded prefix. Cells run in that grouping, the base group first, and with
`--time-budget-s` the sweep stops starting clusters and cells once the budget is spent.
"""

from __future__ import annotations

import argparse
import zlib
from dataclasses import replace
from typing import Any

from bench.harness import BenchContext, measure, write_json
from bench.seed import arm_order
from bench.workload import CellSpec


def build_cells(args: argparse.Namespace) -> tuple[list[CellSpec], dict[str, list[str]]]:
    """The unique cells, in run order, and for each dimension the names of its cells."""
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
    ordered = sorted(cells.values(), key=lambda c: (c.accel_max_active != args.base_max_active,
                                                     list(cells).index(c.name)))
    return ordered, {dim: [c.name for c in dim_cells] for dim, dim_cells in dims.items() if dim_cells}


def groups(cells: list[CellSpec]) -> list[tuple[int, list[CellSpec]]]:
    """Cells grouped by accelerator max_active, in first-appearance order."""
    out: dict[int, list[CellSpec]] = {}
    for cell in cells:
        out.setdefault(cell.accel_max_active, []).append(cell)
    return list(out.items())


def token_seed(cell: CellSpec, run: int) -> int:
    return zlib.crc32(cell.name.encode()) % 100_000 * 100 + run


def run_sweep(ctx: BenchContext, args: argparse.Namespace, cells: list[CellSpec], bar: Any) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for run in range(1, args.runs + 1):
        for max_active, group in groups(cells):
            for arm in arm_order(args.arms, run):
                if ctx.budget.spent():
                    bar.write(f"time budget spent: skipping run {run}, max_active {max_active}, {arm} and later")
                    return records
                bar.set_description(f"run {run} ma={max_active} {arm}: starting cluster")
                pending = max(c.num_requests for c in group) + 16
                with ctx.cluster(arm, max_active, max_pending_requests=pending) as cluster:
                    records += _run_group(ctx, cluster, group, arm, run, bar)
    return records


def _run_group(ctx: BenchContext, cluster: Any, group: list[CellSpec], arm: str, run: int,
               bar: Any) -> list[dict[str, Any]]:
    records = []
    for cell in group:
        if ctx.budget.spent():
            break
        bar.set_description(f"run {run} {arm} {cell.name}")
        record = measure(cluster, cell.workload(token_seed(cell, run)), ctx.temperature,
                         on_done=lambda _: bar.update(1))
        record.update(bench="sweep", cell=cell.name, cell_spec=cell.to_dict(), arm=arm, run=run)
        write_json(ctx.out_dir / "runs" / f"{cell.name}-{arm}-run{run}.json", record)
        records.append(record)
    return records


def total_requests(args: argparse.Namespace, cells: list[CellSpec]) -> int:
    return args.runs * len(args.arms) * sum(c.num_requests for c in cells)


def settings(args: argparse.Namespace, dims: dict[str, list[str]]) -> dict[str, Any]:
    return {"num_requests": args.num_requests, "runs": args.runs, "arms": args.arms, "dimensions": dims,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "interval_s": args.interval_s,
            "base_cache_hit": args.base_cache_hit, "base_max_active": args.base_max_active}
