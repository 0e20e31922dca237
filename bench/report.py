"""The seed and sweep reports: markdown tables and PNG plots from a bench's JSON (OUT/summary.json
and OUT/runs/*.json), regenerated at any time with `tandem bench report`, so every number is the
measured one. Plots beside the markdown, named after it: `-timeline.png` (one run of each arm,
every request a bar on its backend's lane, light to its first text, dark to its end),
`-cdf-<cell>.png` (TTFT and E2E CDFs per arm, seed) and `-gain.png` (the hybrid's makespan gain
next to the oracle's per cell, sweep).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

BASELINE_ARM, HYBRID_ARM = "accelerator-only", "cost"
METRIC_COLUMNS = [("makespan_s", "makespan s"), ("output_tok_s", "output tok/s"), ("ttft_p50_s", "TTFT p50 s"),
                  ("ttft_p95_s", "TTFT p95 s"), ("e2e_p50_s", "E2E p50 s"), ("e2e_p95_s", "E2E p95 s")]
# The design's M2 results (3-run means), printed beside the seed table.
SPEC_M2 = {
    8: {"makespan": "11.47 → 10.35 s (−9.8%)", "offloaded": "0, 1, 6",
        "other": "median TTFT improved, p95 TTFT 3.5% worse"},
    48: {"makespan": "68.43 → 60.88 s (−11.0%)", "offloaded": "6, 6, 6",
         "other": "output tok/s +12.4%; TTFT and E2E p50 and p95 all improved"},
}


def load_bench(out_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The bench's meta (meta.json, else summary.json's) and every run record under runs/."""
    meta_path = out_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else \
        json.loads((out_dir / "summary.json").read_text())["meta"]
    runs = [json.loads(p.read_text()) for p in sorted((out_dir / "runs").glob("*.json"))]
    return meta, runs


def settings_of(meta: dict[str, Any], which: str) -> dict[str, Any]:
    settings = meta.get("settings", {})
    return settings.get(which, settings)


def render_report(meta: dict[str, Any], all_runs: Sequence[dict[str, Any]], path: Path, which: str = "seed",
                  title: str | None = None) -> list[Path]:
    """Write the `which` ("seed" or "sweep") report's markdown, plots and JSON beside `path`."""
    from bench.summary import summarize

    runs = [r for r in all_runs if r.get("bench", meta.get("bench")) == which]
    cells = summarize(runs, meta["accel_id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, bench=which)
    lines = [f"# {title or default_title(meta)}", ""]
    notes = path.with_name(path.stem + ".notes.md")  # hand-written findings, kept across re-renders
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    lines += header_lines(meta, runs)
    written: list[Path] = []
    if which == "sweep":
        lines += sweep_lines(cells, meta)
        written += _plot(plot_gains, cells, path.with_name(path.stem + "-gain.png"))
        lines += ["", f"![gain vs oracle]({path.stem}-gain.png)"]
    else:
        cells.sort(key=lambda c: c["workload"]["num_requests"])
        lines += seed_lines(cells, meta)
        for cell in cells:
            png = path.with_name(f"{path.stem}-cdf-{cell['cell']}.png")
            written += _plot(plot_cdfs, [r for r in runs if r["cell"] == cell["cell"]], png)
            lines += ["", f"![TTFT and E2E CDFs, {cell['cell']}]({png.name})"]
    timeline_runs = pick_timeline_runs(runs)
    if timeline_runs:
        png = path.with_name(path.stem + "-timeline.png")
        written += _plot(plot_timeline, timeline_runs, png, meta.get("accel_id"))
        lines += ["", f"Per-backend request timeline ({timeline_runs[0]['cell']}, run {timeline_runs[0]['run']}):",
                  "", f"![timeline]({png.name})"]
    path.write_text("\n".join(lines) + "\n")
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps({"meta": meta, "cells": cells, "runs": runs}, separators=(",", ":")) + "\n")
    return [path, *written, json_path]


# -- text ------------------------------------------------------------------------------------
def default_title(meta: dict[str, Any]) -> str:
    machine = meta.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu_count', '?')}-core CPU"
    return f"tandem bench {meta.get('bench', '?')}: {meta.get('model')} on {where}"


def resolved_backends(meta: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Backends as they ran (device, dtype resolved), from the run with the most backends."""
    if runs:
        return max((r["cluster"]["backends"] for r in runs), key=len)
    return [{"backend_id": b["id"], "device": b["device"], "dtype": b.get("dtype"), "threads": b.get("threads")}
            for b in meta.get("backends", [])]


def header_lines(meta: dict[str, Any], runs: Sequence[dict[str, Any]] = ()) -> list[str]:
    machine = meta.get("machine", {})
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ", no GPU"
    lines = ["## Setup", "",
             f"- Machine: {machine.get('cpu_model', '?')}, {machine.get('cpu_count', '?')} cores{gpu}; "
             f"torch {machine.get('torch', '?')}, Python {machine.get('python', '?')}",
             f"- Date: {meta.get('date', '?')}", f"- Command: `{meta.get('command', '?')}`",
             f"- Model: `{meta.get('model')}`; sampling temperature {meta.get('temperature')}"]
    for b in resolved_backends(meta, runs):
        role = ("the accelerator slot (`auto`)" if b["backend_id"] == meta.get("accel_id")
                else "another accelerator backend" if b["device"] != "cpu" else "the CPU backend")
        threads = f"{b['threads']} torch thread{'' if b['threads'] == 1 else 's'}"
        lines.append(f"- Backend `{b['backend_id']}`: {b['device']}, dtype {b['dtype']}, {threads} "
                     f"— {role}")
    lines += [f"- {note}" for note in meta.get("notes", [])]
    router = next((r["cluster"].get("router") for r in runs if r["cluster"].get("router")), None)
    if router:
        lines.append(f"- Router: online calibration alpha {router.get('calibration_alpha')}, spill margin "
                     f"{router.get('spill_margin')}, CPU queueing {'allowed' if router.get('spill_allow_queue') else 'not allowed'}; "
                     f"each cluster first decoded {router.get('warmup_tokens')} tokens on every backend at once")
    if meta.get("reuse_cluster"):
        lines.append("- The sweep's cells shared one cluster, reconfigured between measurements (policy, cordoned "
                     "backends, accelerator max_active); each arm had its own prompts of the same shape")
    if not meta.get("has_accelerator", True):
        lines.append("- **No accelerator on this machine**: `auto` resolved to a second cpu backend, so this is "
                     "CPU + CPU, not CPU + GPU. The accelerator-only arm runs that backend alone.")
    lines += ["", "Rates file the clusters loaded (isolated profile, `tandem profile`):", "",
              "| backend | prefill tok/s | decode tok/s (batch 1) | decode tok/s by batch |", "|---|---|---|---|"]
    for bid, r in meta.get("rates", {}).items():
        table = ", ".join(f"{b}: {v:.0f}" for b, v in (r.get("decode_tok_s_by_batch") or {}).items())
        lines.append(f"| {bid} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {table} |")
    return lines


def fmt(s: dict[str, Any] | None, digits: int = 2) -> str:
    if not s or s.get("n", 0) == 0 or s.get("mean") is None or math.isnan(s["mean"]):
        return "–"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}"


def pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.1f}%"


def arm_label(arm: str) -> str:
    return {"cost": "hybrid (cost)"}.get(arm, arm)


def offloaded(cell: dict[str, Any], arm: str, accel_id: str) -> str:
    counts = cell["arms"][arm]["requests_by_backend"]
    others = {b: v for b, v in counts.items() if b != accel_id}
    return "; ".join(f"{b}: {', '.join(str(x) for x in v)}" for b, v in others.items()) or "–"


def cell_table(cell: dict[str, Any], accel_id: str) -> list[str]:
    head = "| arm | " + " | ".join(label for _, label in METRIC_COLUMNS) + " | requests off the accelerator, per run |"
    lines = [head, "|" + "---|" * (len(METRIC_COLUMNS) + 2)]
    for arm, agg in cell["arms"].items():
        values = " | ".join(fmt(agg[m], 1 if m == "output_tok_s" else 3) for m, _ in METRIC_COLUMNS)
        lines.append(f"| {arm_label(arm)} | {values} | {offloaded(cell, arm, accel_id)} |")
    for arm, cmp in cell.get("vs_baseline", {}).items():
        values = " | ".join(_change_cell(cmp[m]) for m, _ in METRIC_COLUMNS)
        lines.append(f"| change, {arm_label(arm)} vs accelerator-only | {values} | |")
    return lines


def _change_cell(c: dict[str, Any]) -> str:
    if c["worse"] is None:  # an arm with one run: no spread to judge by
        return pct(c["change"]) + (" †" if c["worse_by"] > 0 else "")
    return pct(c["change"]) + (" ✗" if c["worse"] else "")


def oracle_lines(cell: dict[str, Any]) -> list[str]:
    o = cell.get("oracle")
    if not o:
        return []
    sim = o["sim_calibrated"]
    counts = ", ".join(f"{b}={n}" for b, n in sim["oracle_requests_by_backend"].items())
    share = "undefined (no attainable gain)" if o["share"] is None else f"{100 * o['share']:.0f}%"
    target = {True: "meets the bar (≥80% of a ≥5% gain)", False: "**misses the bar** (<80% of a ≥5% gain)",
              None: "bar not applicable (oracle gain < 5%)"}[o["meets_target"]]
    lines = ["", f"Oracle (calibrated route-sim; {sim['search']}): split {counts}, "
             f"{o['oracle_makespan_s']:.3f} s, a gain of {pct(o['oracle_gain'])}. The router's own assignments, "
             f"replayed in the same simulation, gain {pct(o['router_gain'])}: share {share}; {target}. "
             f"Measured hybrid vs accelerator-only (means): {pct(o['measured_router_gain'])}.",
             "Calibration factors (simulated rate / profiled rate): "
             + ", ".join(f"{b} {f:.3f} ({o['factor_sources'][b]})" for b, f in o["factors"].items()) + "."]
    if o.get("note"):
        lines.append(f"Note: {o['note']}.")
    return lines


def decision_lines(cell: dict[str, Any]) -> list[str]:
    windows = [w for w in cell.get("first_offload", []) if w["decisions"]]
    if not windows:
        return ["", "No hybrid run sent a request off the accelerator."] if cell.get("first_offload") else []
    w = windows[0]
    backends = list(w["decisions"][0]["per_backend"])
    head = "| # | chosen | " + " | ".join(f"{b} active/queued · cached · prefill tok · decode tok · score s"
                                         for b in backends) + " |"
    lines = ["", f"Routing decisions around the first request sent off the accelerator (run {w['run']}, "
             f"decision {w['first_offload_position']}; first offload per hybrid run: "
             + ", ".join(str(x['first_offload_position']) for x in cell["first_offload"]) + "):", "",
             head, "|---|---|" + "---|" * len(backends)]
    for d in w["decisions"]:
        cells = []
        for b in backends:
            s = d["per_backend"][b]
            cells.append(f"{s['num_active']}/{s['num_queued']} · {s['num_cached_tokens']} · "
                         f"{s['num_prefill_tokens']:.0f} · {s['num_decode_tokens']:.0f} · {s['score_s']:.3f}")
        lines.append(f"| {d['position']} | {d['backend_id']} | " + " | ".join(cells) + " |")
    return lines


def seed_lines(cells: Sequence[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    accel = meta["accel_id"]
    s = settings_of(meta, "seed")
    lines = ["", "## Results", "",
             f"Up to {s.get('runs')} runs per arm (the tables give each arm's count), each on a fresh cluster; "
             f"{s.get('prompt_tokens')}-token prompts "
             f"(identical), one every {1000 * s.get('interval_s', 0):g} ms, {s.get('max_tokens')} output tokens "
             f"(EOS ignored), max_active {s.get('max_active')} on the accelerator and {meta.get('cpu_max_active')} "
             f"on the CPU, both caches seeded with the prompt's first {s.get('seed_prefix_tokens')} tokens. "
             "Values are mean ± sample standard deviation over runs; ✗ marks a change worse than the "
             "accelerator-only arm by more than the larger of the two arms' standard deviations; † a worse change "
             "where an arm has a single run, so there is no spread to judge it by."]
    for cell in cells:
        n = cell["workload"]["num_requests"]
        runs = ", ".join(f"{arm_label(a)} {len(r)}" for a, r in cell["runs"].items())
        lines += ["", f"### {n} requests", "", f"Runs: {runs}.", "", *cell_table(cell, accel)]
        seeded = cell["workload"].get("expected_cached_tokens")
        lines += ["", f"Reusable prefix after seeding: {seeded} tokens expected."]
        if n in SPEC_M2:
            m = SPEC_M2[n]
            lines += [f"Spec (Apple M2, Qwen2.5-0.5B): GPU only → hybrid {m['makespan']}; requests on the CPU per "
                      f"run {m['offloaded']}; {m['other']}."]
        lines += oracle_lines(cell) + decision_lines(cell)
    return lines


def sweep_lines(cell_list: Sequence[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    accel = meta["accel_id"]
    cells = {c["cell"]: c for c in cell_list}
    lines = ["", "## Results", "",
             "One row per cell: means over runs (± sample sd), runs per arm in the last column. Δ is measured "
             "hybrid vs accelerator-only; ✗ marks worse beyond the run-to-run spread (needs 2+ runs per arm), † worse "
             "with a single-run arm (no spread to judge by). "
             "Oracle gain and router gain are fractions of the accelerator-only makespan in the calibrated "
             "simulation (the router's measured assignments replayed); share = router gain / oracle gain."]
    for dim, names in settings_of(meta, "sweep")["dimensions"].items():
        lines += ["", f"### {dim}", "", "| cell | accelerator-only makespan s | hybrid makespan s | Δ makespan | "
                  "Δ TTFT p95 | Δ E2E p95 | off the accelerator, per run | oracle gain | router gain | share | bar | runs (acc-only/hybrid) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in names:
            lines.append(sweep_row(cells.get(name), name, accel))
    return lines


def sweep_row(cell: dict[str, Any] | None, name: str, accel: str) -> str:
    if cell is None or BASELINE_ARM not in cell["arms"] or HYBRID_ARM not in cell["arms"]:
        return f"| {name} | not run | | | | | | | | | | |"
    cmp = cell["vs_baseline"][HYBRID_ARM]
    o = cell.get("oracle") or {}
    share = "–" if o.get("share") is None else f"{100 * o['share']:.0f}%"
    bar = {True: "ok", False: "**miss**", None: "n/a"}.get(o.get("meets_target"), "–")
    return (f"| {name} | {fmt(cell['arms'][BASELINE_ARM]['makespan_s'], 3)} | {fmt(cell['arms'][HYBRID_ARM]['makespan_s'], 3)}"
            f" | {_change_cell(cmp['makespan_s'])} | {_change_cell(cmp['ttft_p95_s'])} | {_change_cell(cmp['e2e_p95_s'])}"
            f" | {offloaded(cell, HYBRID_ARM, accel)} | {pct(o.get('oracle_gain'))} | {pct(o.get('router_gain'))}"
            f" | {share} | {bar} | {'/'.join(str(len(v)) for v in cell['runs'].values())} |")


# -- plots -----------------------------------------------------------------------------------
def _plot(fn: Any, data: Any, path: Path, *extra: Any) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = fn(plt, data, *extra)
    if fig is None:
        return []
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def pick_timeline_runs(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run 1 of each arm, of the cell with the most requests, preferring one where the hybrid offloaded."""
    if not runs:
        return []
    def offloads(r: dict[str, Any]) -> int:  # requests a hybrid run sent off its most-used backend
        counts = sorted(r["metrics"]["requests_by_backend"].values())
        return sum(counts[:-1]) if r["arm"] != BASELINE_ARM else 0
    biggest = max(runs, key=lambda r: (r["workload"]["num_requests"], offloads(r), r["cell"]))["cell"]
    chosen = {}
    for r in sorted(runs, key=lambda r: r["run"]):
        if r["cell"] == biggest:
            chosen.setdefault(r["arm"], r)
    return [chosen[a] for a in sorted(chosen, key=lambda a: (a != BASELINE_ARM, a))]


def plot_timeline(plt: Any, runs: Sequence[dict[str, Any]], accel_id: str | None) -> Any:
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 0.18 * max(len(r["requests"]) for r in runs) * len(runs)),
                             sharex=True, squeeze=False)
    colors = {}
    for ax, run in zip(axes[:, 0], runs):
        ok = [r for r in run["requests"] if r.get("end_s") is not None]
        ok.sort(key=lambda r: (r["backend"] != accel_id, r["backend"] or "", r["send_s"]))
        for y, r in enumerate(ok):
            color = colors.setdefault(r["backend"], f"C{len(colors)}")
            first = r.get("first_text_s") or r["end_s"]
            ax.barh(y, first - r["send_s"], left=r["send_s"], color=color, alpha=0.3, height=0.8)
            ax.barh(y, r["end_s"] - first, left=first, color=color, height=0.8)
        ax.set_yticks([])
        ax.set_ylabel(arm_label(run["arm"]))
        ax.set_title(f"{arm_label(run['arm'])}: makespan {run['metrics']['makespan_s']:.2f} s", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0, 0].legend(handles, list(colors), loc="upper right", fontsize=8, title="backend (light: to first text)")
    axes[-1, 0].set_xlabel("seconds since the first request was sent")
    return fig


def plot_cdfs(plt: Any, runs: Sequence[dict[str, Any]]) -> Any:
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT s"), (axes[1], "e2e_s", "E2E s")):
        for arm in sorted({r["arm"] for r in runs}, key=lambda a: (a != BASELINE_ARM, a)):
            values = sorted(q[key] for r in runs if r["arm"] == arm for q in r["requests"] if q.get(key) is not None)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=arm_label(arm))
        ax.set_xlabel(label + " (all runs pooled)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{runs[0]['cell']}: {runs[0]['workload']['num_requests']} requests", fontsize=10)
    return fig


def plot_gains(plt: Any, cells: Sequence[dict[str, Any]]) -> Any:
    rows = [c for c in cells if c.get("oracle")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows) + 2), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [100 * c["oracle"]["oracle_gain"] for c in rows], width=0.4, label="oracle gain")
    ax.bar([x + 0.2 for x in xs], [100 * c["oracle"]["router_gain"] for c in rows], width=0.4, label="router (cost) gain")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([c["cell"] for c in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("makespan gain vs accelerator-only, %")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig
