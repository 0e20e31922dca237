"""`tandem bench route-sim-grid`: the multi-tenant routing grid in the simulator, every (tenants,
prefix, rate, seed) cell and every arm: one JSON, one table and a plot of TTFT p95 against rate.

The live grid (`tandem bench tenants`) needs GPUs; this runs the same cells through routing's
simulator on any CPU in about a minute, so a routing change is judged on every cell-seed. It runs
route-sim's own backends (`tandem route-sim --fast-backends`), faster than the engine's scheduler
and KV cache that `tandem route-sim` runs by default, and less faithful under cache pressure: a
sweep to compare routing changes, not a prediction of a live cell. The
scenario is docs/route-sim-examples/tenants-2gpu.yaml (two H200-profiled GPUs); each backend's
prefix cache holds `--cache-prefixes` prefixes. The verdict per cell-seed: `cost` at least as
good as the best other arm on TTFT p50, TTFT p95 and output tok/s, within a rounding tolerance
(a simulator run is exact), and its hit rate within 5 points of prefix-affinity's. Writes
OUT.json, OUT.md and OUT.png; a hand-written OUT.notes.md is kept atop OUT.md on re-renders.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bench._machine import stamp
from bench.harness import floats, ints, write_json
from tandem.routing.scenario import load_scenario
from tandem.routing.sim_report import summarize
from tandem.routing.simulator import simulate

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = REPO / "docs" / "route-sim-examples" / "tenants-2gpu.yaml"
HYBRID_ARM = "cost"
DEFAULT_ARMS = (HYBRID_ARM, "prefix-affinity", "least-requests", "round-robin", "random")
TTFT_TOLERANCE_S = 50e-6
THROUGHPUT_TOLERANCE = 0.001
HIT_RATE_POINTS = 0.05
METRICS = ("cache_hit_rate", "ttft_p50_s", "ttft_p95_s", "e2e_p95_s", "output_tok_s")


@dataclass
class GridSpec:
    scenario: Path = DEFAULT_SCENARIO
    tenants: Sequence[int] = (4, 16)
    prefix_tokens: Sequence[int] = (1024, 4096)
    rates: Sequence[float] = (10, 40, 100)
    seeds: Sequence[int] = (0, 1, 2)
    num_requests: int = 600
    arms: Sequence[str] = DEFAULT_ARMS
    cache_prefixes: int = 6  # each backend's prefix cache holds this many prefixes
    overrides: Sequence[str] = field(default_factory=tuple)  # extra `--set`s, e.g. router.replication=null


def cell_overrides(spec: GridSpec, num_backends: int, block_size: int, num_tenants: int,
                   prefix_tokens: int, rate: float, seed: int) -> list[str]:
    num_kv_blocks = spec.cache_prefixes * prefix_tokens // block_size
    return [f"tenants.num_tenants={num_tenants}", f"tenants.prefix_tokens={prefix_tokens}",
            f"tenants.rate_per_s={rate:g}", f"tenants.seed={seed}",
            *(f"backends.{i}.num_kv_blocks={num_kv_blocks}" for i in range(num_backends)), *spec.overrides]


def run_cell(spec: GridSpec, num_tenants: int, prefix_tokens: int, rate: float, seed: int) -> dict[str, Any]:
    """Every arm on one cell-seed: the same arrivals, tenants and simulated caches."""
    base = load_scenario(spec.scenario, num_requests=spec.num_requests)
    overrides = cell_overrides(spec, len(base.backends), base.block_size, num_tenants, prefix_tokens, rate, seed)
    scenario = load_scenario(spec.scenario, num_requests=spec.num_requests, overrides=overrides)
    backend_ids = [b.spec.backend_id for b in scenario.backends]
    arms = {}
    for arm in spec.arms:
        summary = summarize(arm, simulate(scenario, arm).outcomes, backend_ids).to_dict()
        arms[arm] = {k: summary[k] for k in (*METRICS, "makespan_s", "num_requests_by_backend")}
    cell = {"tenants": num_tenants, "prefix_tokens": prefix_tokens, "rate_per_s": rate, "seed": seed, "arms": arms}
    cell["verdict"] = verdict(arms)
    return cell


def verdict(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Is `cost` at least as good as the best other arm (see the module doc), and where not, by
    how much."""
    cost = arms.get(HYBRID_ARM)
    others = {a: s for a, s in arms.items() if a != HYBRID_ARM}
    if cost is None or not others:
        return {"met": None, "lost": []}
    lost = []
    for metric in ("ttft_p50_s", "ttft_p95_s"):
        arm, best = min(others.items(), key=lambda item: item[1][metric])
        if cost[metric] > best[metric] + TTFT_TOLERANCE_S:
            lost.append({"metric": metric, "cost": cost[metric], "best_arm": arm, "best": best[metric]})
    arm, best = max(others.items(), key=lambda item: item[1]["output_tok_s"])
    if cost["output_tok_s"] < best["output_tok_s"] * (1 - THROUGHPUT_TOLERANCE):
        lost.append({"metric": "output_tok_s", "cost": cost["output_tok_s"], "best_arm": arm,
                     "best": best["output_tok_s"]})
    affinity = arms.get("prefix-affinity")
    if affinity is not None and cost["cache_hit_rate"] < affinity["cache_hit_rate"] - HIT_RATE_POINTS:
        lost.append({"metric": "cache_hit_rate", "cost": cost["cache_hit_rate"], "best_arm": "prefix-affinity",
                     "best": affinity["cache_hit_rate"]})
    return {"met": not lost, "lost": lost}


def run_grid(spec: GridSpec) -> list[dict[str, Any]]:
    return [run_cell(spec, t, p, r, seed)
            for t in spec.tenants for p in spec.prefix_tokens for r in spec.rates for seed in spec.seeds]


def aggregate(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (tenants, prefix, rate) and arm: each metric's mean, min and max over seeds."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["tenants"], cell["prefix_tokens"], cell["rate_per_s"]), []).append(cell)
    rows = []
    for (t, p, r), group in groups.items():
        arms = {}
        for arm in group[0]["arms"]:
            arms[arm] = {m: _stats([c["arms"][arm][m] for c in group]) for m in METRICS}
        rows.append({"tenants": t, "prefix_tokens": p, "rate_per_s": r, "seeds": [c["seed"] for c in group],
                     "arms": arms, "num_met": sum(bool(c["verdict"]["met"]) for c in group)})
    return rows


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


# --- report ---------------------------------------------------------------------------------

def _fmt(metric: str, value: float) -> str:
    if metric == "cache_hit_rate":
        return f"{100 * value:.1f}%"
    if metric == "output_tok_s":
        return f"{value:,.0f}"
    return f"{1000 * value:.2f}"


def table_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| tenants | prefix | rate/s | arm | hit rate | TTFT p50 ms | TTFT p95 ms (min–max) | E2E p95 ms | out tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for arm, s in row["arms"].items():
            name = f"**{arm}**" if arm == HYBRID_ARM else arm
            p95 = s["ttft_p95_s"]
            lines.append(
                f"| {row['tenants']} | {row['prefix_tokens']} | {row['rate_per_s']:g} | {name} "
                f"| {_fmt('cache_hit_rate', s['cache_hit_rate']['mean'])} | {_fmt('ttft_p50_s', s['ttft_p50_s']['mean'])} "
                f"| {_fmt('ttft_p95_s', p95['mean'])} ({_fmt('ttft_p95_s', p95['min'])}–{_fmt('ttft_p95_s', p95['max'])}) "
                f"| {_fmt('e2e_p95_s', s['e2e_p95_s']['mean'])} | {_fmt('output_tok_s', s['output_tok_s']['mean'])} |")
    return lines


def verdict_lines(cells: Sequence[dict[str, Any]]) -> list[str]:
    met = sum(bool(c["verdict"]["met"]) for c in cells)
    lines = [f"`cost` is at least as good as the best other arm on TTFT p50, TTFT p95 and throughput "
             f"(within {1e6 * TTFT_TOLERANCE_S:.0f} µs and {100 * THROUGHPUT_TOLERANCE:.1f}%), with a hit rate within "
             f"{100 * HIT_RATE_POINTS:.0f} points of prefix-affinity's, in **{met} of {len(cells)}** cell-seeds."]
    misses = [c for c in cells if not c["verdict"]["met"]]
    if misses:
        lines += ["", "Where it is not:", "", "| tenants | prefix | rate/s | seed | metric | cost | best other |",
                  "|---|---|---|---|---|---|---|"]
        for c in misses:
            for loss in c["verdict"]["lost"]:
                m = loss["metric"]
                lines.append(f"| {c['tenants']} | {c['prefix_tokens']} | {c['rate_per_s']:g} | {c['seed']} | {m} "
                             f"| {_fmt(m, loss['cost'])} | {_fmt(m, loss['best'])} ({loss['best_arm']}) |")
    return lines


def render_markdown(meta: dict[str, Any], cells: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
                    path: Path, png: Path | None) -> None:
    spec = meta["spec"]
    lines = [f"# route-sim tenants grid: {spec['num_requests']} requests per cell-seed", ""]
    notes = path.with_name(path.stem + ".notes.md")
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    lines += [
        "## Setup", "",
        "These are **simulator cells** (routing's what-if simulator, two GPUs with rates profiled on an "
        "H200), not a live run on two GPUs.", "",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']['cpu_model']} ({meta['machine']['platform']}, Python "
        f"{meta['machine']['python']}); the simulator's times are simulated, not this machine's; "
        f"the grid took {meta['elapsed_s']:.0f} s of wall time here.",
        f"- Code: {meta['machine']['git_revision']}; scenario `{spec['scenario']}` with each backend's prefix cache "
        f"holding {spec['cache_prefixes']} prefixes; arms {', '.join(spec['arms'])}; seeds "
        f"{', '.join(map(str, spec['seeds']))}" + (f"; overrides {', '.join(spec['overrides'])}" if spec['overrides'] else "")
        + ".",
        "- Values are means over seeds; TTFT p95 also gives the seeds' range.", "",
        "## Verdict", "", *verdict_lines(cells), "", "## Results", "", *table_lines(rows)]
    if png is not None:
        lines += ["", "TTFT p95 against arrival rate, per arm (mean over seeds, bars: min to max):", "",
                  f"![TTFT p95]({png.name})"]
    path.write_text("\n".join(lines) + "\n")


def plot_ttft_p95(rows: Sequence[dict[str, Any]], arms: Sequence[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, NullLocator

    panels = sorted({(r["tenants"], r["prefix_tokens"]) for r in rows})
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, (t, p) in zip(axes.flat, panels):
        group = sorted((r for r in rows if (r["tenants"], r["prefix_tokens"]) == (t, p)), key=lambda r: r["rate_per_s"])
        rates = [r["rate_per_s"] for r in group]
        for i, arm in enumerate(arms):
            stats = [r["arms"][arm]["ttft_p95_s"] for r in group]
            mean = [1000 * s["mean"] for s in stats]
            err = [[1000 * max(0.0, s["mean"] - s["min"]) for s in stats],  # a mean can round past its bounds
                   [1000 * max(0.0, s["max"] - s["mean"]) for s in stats]]
            ax.errorbar([x * (1 + 0.03 * (i - 1.5)) for x in rates], mean, yerr=err, marker="o", capsize=3,
                        label=arm, color=f"C{i}", linewidth=2.2 if arm == HYBRID_ARM else 1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates)
        ax.set_xticklabels([f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(NullLocator())  # y keeps its minor labels: a panel may span less than a decade
        ax.yaxis.set_major_formatter(LogFormatter())  # plain numbers, not powers of ten
        ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.5)))
        ax.set_title(f"{t} tenants, {p}-token prefixes", fontsize=10)
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel("TTFT p95, ms")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_outputs(spec: GridSpec, cells: list[dict[str, Any]], out: Path, elapsed_s: float,
                  plot: bool = True) -> list[Path]:
    rows = aggregate(cells)
    spec_dict = asdict(spec)
    spec_dict["scenario"] = _relative(spec.scenario)
    meta = {**stamp(), "elapsed_s": elapsed_s, "spec": spec_dict}
    json_path = out.with_suffix(".json")
    write_json(json_path, {"meta": meta, "cells": cells, "aggregate": rows})
    png = None
    if plot:
        title = f"route-sim (simulated, H200-profiled rates), {spec.num_requests} requests per cell-seed"
        png = plot_ttft_p95(rows, spec.arms, out.with_suffix(".png"), title)
    md = out.with_suffix(".md")
    render_markdown(meta, cells, rows, md, png)
    return [p for p in (json_path, md, png) if p is not None]


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output prefix: writes OUT.json, OUT.md, OUT.png")
    parser.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO)
    parser.add_argument("--tenants", type=ints, default=[4, 16])
    parser.add_argument("--prefix-tokens", type=ints, default=[1024, 4096])
    parser.add_argument("--arrival-rates", type=floats, default=[10.0, 40.0, 100.0])
    parser.add_argument("--seeds", type=ints, default=[0, 1, 2])
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--arms", type=lambda text: text.split(","), default=list(DEFAULT_ARMS))
    parser.add_argument("--cache-prefixes", type=int, default=6, help="prefixes each backend's cache holds")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="extra scenario override for every cell, e.g. router.replication=null")
    parser.add_argument("--no-plot", action="store_true")


def run(args: argparse.Namespace) -> int:
    spec = GridSpec(args.scenario, args.tenants, args.prefix_tokens, args.arrival_rates, args.seeds,
                    args.num_requests, args.arms, args.cache_prefixes, tuple(args.set))
    start = time.perf_counter()
    cells = run_grid(spec)
    for path in write_outputs(spec, cells, args.out, time.perf_counter() - start, plot=not args.no_plot):
        print(f"wrote {path}")
    print("\n".join(verdict_lines(cells)))
    return 0
