"""Run a plan of benchmark cells over fresh clusters, grouped so that clusters are few, or over one
reused cluster.

A cluster's engines are fixed at start, so cells are grouped by the accelerator's max_active;
for each group, run and arm one fresh cluster is started (bench/harness.py) and every cell of
the group that still wants that run is measured in it, each with its own prompts and seeded
prefix. Groups run in plan order (the design's cells and the sweep's base first), so a time
budget that runs out leaves the most important cells complete; arms alternate their order from
run to run, so slow drift does not favour one arm. With `reuse`, the sweep's cells share one
cluster started at the largest max_active (a fresh one costs 20-25 s on the H200) and
reconfigured before each measurement, each arm with its own prompts (same shapes and arrival
times). The design's cells (bench "seed") always get fresh clusters, as the design prescribes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from bench.harness import BenchContext, measure, write_json
from bench.workload import CellSpec


@dataclass(frozen=True)
class PlanItem:
    cell: CellSpec
    runs: int
    bench: str  # "seed" or "sweep": which report shows it


def arm_order(arms: list[str], run: int) -> list[str]:
    return list(arms) if run % 2 else list(reversed(arms))


def groups(items: list[PlanItem]) -> list[tuple[int, list[PlanItem]]]:
    """Items grouped by accelerator max_active, in first-appearance order."""
    out: dict[int, list[PlanItem]] = {}
    for item in items:
        out.setdefault(item.cell.accel_max_active, []).append(item)
    return list(out.items())


def token_seed(cell: CellSpec, run: int, arm: str | None = None) -> int:
    """Different prompts for every cell and run; the same for every arm unless `arm` is given."""
    key = cell.name if arm is None else f"{cell.name}|{arm}"
    return zlib.crc32(key.encode()) % 100_000 * 100 + run


def total_requests(items: list[PlanItem], arms: list[str]) -> int:
    return len(arms) * sum(i.runs * i.cell.num_requests for i in items)


def run_plan(ctx: BenchContext, items: list[PlanItem], arms: list[str], bar: Any,
             only: set[tuple[int, str]] | None = None, reuse: bool = False) -> list[dict[str, Any]]:
    """Measure every item's runs under every arm; returns the run records (also written as JSON).

    `only`, if given, limits the clusters (or, with `reuse`, the measurements) to these
    (run, arm) pairs, to complete a bench whose first invocation ran out of time."""
    if reuse:
        fresh = [i for i in items if i.bench == "seed"]
        shared = [i for i in items if i.bench != "seed"]
        return _run_fresh(ctx, fresh, arms, bar, only) + _run_reused(ctx, shared, arms, bar, only)
    return _run_fresh(ctx, items, arms, bar, only)


def _run_reused(ctx: BenchContext, items: list[PlanItem], arms: list[str], bar: Any,
                only: set[tuple[int, str]] | None) -> list[dict[str, Any]]:
    if not items or ctx.budget.spent():
        return []
    records: list[dict[str, Any]] = []
    largest = max(i.cell.accel_max_active for i in items)
    bar.set_description(f"one cluster for {len(items)} cells (max_active up to {largest}): starting")
    pending = max(i.cell.num_requests for i in items) + 16
    with ctx.cluster("cost", largest, max_pending_requests=pending) as cluster:  # every backend in it
        for run in range(1, max(i.runs for i in items) + 1):
            for item in (i for i in items if i.runs >= run):
                for arm in arm_order(arms, run):
                    if only is not None and (run, arm) not in only:
                        continue
                    if ctx.budget.spent():
                        bar.write(f"time budget spent: stopping before {item.cell.name}, run {run}, {arm}")
                        return records
                    cluster.configure(arm, item.cell.accel_max_active)
                    records.append(_measure_item(ctx, cluster, item, arm, run, bar, token_seed(item.cell, run, arm),
                                                 arrival_seed=token_seed(item.cell, run)))
    return records


def _run_fresh(ctx: BenchContext, items: list[PlanItem], arms: list[str], bar: Any,
               only: set[tuple[int, str]] | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for max_active, group in groups(items):
        for run in range(1, max(i.runs for i in group) + 1):
            wanted = [i for i in group if i.runs >= run]
            for arm in arm_order(arms, run):
                if only is not None and (run, arm) not in only:
                    continue
                if ctx.budget.spent():
                    bar.write(f"time budget spent: stopping before max_active {max_active}, run {run}, {arm}")
                    return records
                bar.set_description(f"ma={max_active} run {run} {arm}: starting cluster")
                pending = max(i.cell.num_requests for i in wanted) + 16
                with ctx.cluster(arm, max_active, max_pending_requests=pending) as cluster:
                    records += _run_cells(ctx, cluster, wanted, arm, run, bar)
    return records


def _run_cells(ctx: BenchContext, cluster: Any, items: list[PlanItem], arm: str, run: int,
               bar: Any) -> list[dict[str, Any]]:
    records = []
    for item in items:
        if ctx.budget.spent() and item.bench != "seed":  # a started cluster always runs the design's cells
            break
        records.append(_measure_item(ctx, cluster, item, arm, run, bar, token_seed(item.cell, run)))
    return records


def _measure_item(ctx: BenchContext, cluster: Any, item: PlanItem, arm: str, run: int, bar: Any,
                  seed: int, arrival_seed: int | None = None) -> dict[str, Any]:
    cell = item.cell
    bar.set_description(f"run {run} {arm} {cell.name}")
    workload = cell.workload(seed, arrival_seed=arrival_seed)
    record = measure(cluster, workload, ctx.temperature, on_done=lambda _: bar.update(1))
    record.update(bench=item.bench, cell=cell.name, cell_spec=cell.to_dict(), arm=arm, run=run)
    write_json(ctx.out_dir / "runs" / f"{cell.name}-{arm}-run{run}.json", record)
    return record
