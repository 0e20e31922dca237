"""The multi-tenant bench's report: tables per cell, cost against the best other arm, what the
routing log says where cost lost, and TTFT p95 against arrival rate per arm.

Input is what `tandem bench tenants` wrote (OUT/meta.json, OUT/runs/*.json). Output is one
markdown file with `<name>-ttft-p95.png` and `<name>.json` (every number it shows) beside it; a
hand-written `<name>.notes.md` beside it is kept at the top across re-renders, as for the other
reports. Regenerate with `tandem bench report OUT --tenants-report X.md`.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from bench.tenants import HYBRID_ARM, VERDICT_METRICS, summarize

METRIC_LABELS = {"ttft_p50_s": "TTFT p50", "ttft_p95_s": "TTFT p95", "output_tok_s": "out tok/s",
                 "e2e_p95_s": "E2E p95", "hit_rate": "hit rate"}


def render_tenants_report(meta: dict[str, Any], runs: Sequence[dict[str, Any]], path: Path,
                          title: str | None = None, predictions: dict[str, Any] | None = None) -> list[Path]:
    """`predictions`: cell -> arm -> route-sim's figures for it (bench/tenants.py), shown beside the live ones."""
    from bench.report import _plot

    cells = summarize(runs)
    for cell in cells:
        if predictions and cell["cell"] in predictions:
            cell["route_sim"] = predictions[cell["cell"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title or default_title(meta)}", ""]
    notes = path.with_name(path.stem + ".notes.md")
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    lines += header_lines(meta, runs)
    lines += result_lines(cells, meta)
    lines += verdict_lines(cells)
    lines += why_lines(cells, runs)
    written = []
    for suffix, plot, caption in (("ttft-p95", plot_ttft_p95, "TTFT p95"), ("hit-rate", plot_hit_rate, "hit rate"),
                                  ("busiest-share", plot_busiest_share, "the busiest backend's share of requests")):
        png = path.with_name(f"{path.stem}-{suffix}.png")
        drawn = _plot(plot, cells, png, meta.get("arms", []))
        written += drawn
        if drawn:
            lines += ["", f"{caption[0].upper()}{caption[1:]} against arrival rate, per arm (mean over runs, bars: ± sd):",
                      "", f"![{caption}]({png.name})"]
    path.write_text("\n".join(lines) + "\n")
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps({"meta": meta, "cells": cells,
                                     "diagnostics": {c["cell"]: diagnose_cell(c["cell"], runs) for c in cells}},
                                    separators=(",", ":"), default=str) + "\n")
    return [path, *written, json_path]


def default_title(meta: dict[str, Any]) -> str:
    machine = meta.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu_count', '?')}-core CPU"
    return f"tandem bench tenants: {meta.get('model')} on {where}"


def header_lines(meta: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[str]:
    machine = meta.get("machine", {})
    s = meta.get("settings", {}).get("tenants", {})
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ", no GPU"
    lines = ["## Setup", "",
             f"- Machine: {machine.get('cpu_model', '?')}, {machine.get('cpu_count', '?')} cores{gpu}; "
             f"torch {machine.get('torch', '?')}, Python {machine.get('python', '?')}",
             f"- Date: {meta.get('date', '?')}", f"- Command: `{meta.get('command', '?')}`",
             f"- Model: `{meta.get('model')}`; sampling temperature {meta.get('temperature')}",
             f"- Workload: tenants {s.get('tenants')}, shared prefixes of {s.get('prefix_tokens')} tokens, a unique "
             f"{s.get('suffix_tokens')}-token suffix and {s.get('max_tokens')} output tokens (EOS ignored) per request, "
             f"Zipf({s.get('zipf_s')}) popularity, Poisson arrivals at {s.get('arrival_rates')} requests/s for "
             f"{s.get('duration_s')} s (at least {s.get('min_requests')} requests a cell); token-id prompts; "
             f"route-sim's `tenants:` generator with the same seed gives the arrivals and tenants "
             "(OUT/scenarios/ holds each cell's scenario)",
             f"- Arms: {', '.join(meta.get('arms', []))}; {s.get('runs')} runs per arm and cell, arms alternating, "
             f"all on one cluster; each arm has prefixes of its own",
             f"- Drain: {'every request awaited' if not s.get('drain_timeout_s') else str(s['drain_timeout_s']) + ' s after the last arrival, then the rest is cut off'}",
             f"- KV cache: {s.get('num_kv_blocks') or 'the engine default'} blocks of 16 tokens per backend; "
             f"max_active {s.get('max_active')} on accelerators, {s.get('cpu_max_active')} on cpu backends"]
    backends = max((r["cluster"]["backends"] for r in runs), key=len) if runs else []
    for b in backends:
        threads = f"{b['threads']} torch thread{'s' if b['threads'] != 1 else ''}"
        lines.append(f"- Backend `{b['backend_id']}`: {b['device']}, dtype {b['dtype']}, {threads}, "
                     f"max_active {b['max_active']}")
    latency = meta.get("serving_latency")
    if latency:
        lines.append(f"- The serving path's latency before the router, measured with lone requests and given to "
                     f"route-sim: {1000 * latency['fixed_s']:.2f} ms + {1e6 * latency['per_prompt_token_s']:.2f} µs "
                     f"a prompt token")
    router = next((r["cluster"].get("router") for r in runs if r["cluster"].get("router")), None)
    if router:
        lines.append(f"- Router: online calibration alpha {router.get('calibration_alpha')}, spill margin "
                     f"{router.get('spill_margin')}, warm-up {router.get('warmup_tokens')} tokens on every backend at once")
    lines += ["", "Rates the cluster loaded:", "", "| backend | prefill tok/s | decode tok/s by batch |", "|---|---|---|"]
    for bid, r in meta.get("rates", {}).items():
        table = ", ".join(f"{b}: {v:.0f}" for b, v in (r.get("decode_tok_s_by_batch") or {}).items())
        lines.append(f"| {bid} | {r['prefill_tok_s']:.0f} | {table} |")
    return lines


def fmt(s: dict[str, Any] | None, scale: float = 1.0, digits: int = 1) -> str:
    if not s or not s.get("n") or s.get("mean") is None or math.isnan(s["mean"]):
        return "–"
    text = f"{scale * s['mean']:.{digits}f}"
    return text if s["n"] == 1 else f"{text} ± {scale * s['sd']:.{digits}f}"


def _mark(cell: dict[str, Any], arm: str, metric: str) -> str:
    v = cell.get("verdict", {}).get(metric)
    if arm != HYBRID_ARM or not v or v.get("ok") is None:
        return ""
    return " ✓" if v["ok"] else " ✗"


def result_lines(cells: Sequence[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    lines = ["", "## Results", "",
             "Means ± sample sd over runs. Hit rate: cached prompt tokens over all prompt tokens (responses' usage). "
             "✓/✗ on `cost`'s row: at least as good as the best other arm / worse by more than the larger of the two "
             "arms' sds (2+ runs each); the hit rate's mark is the 5-point band around prefix-affinity's. Requests "
             "cut off at the drain deadline count in TTFT and E2E with their time so far (lower bounds) and not in "
             "the hit rate or output tokens.", "",
             "route-sim: the simulator's prediction of the cell under the arm (run 1's arrivals, the served rates), "
             "TTFT p50 ms / hit rate %, on the engine's scheduler and KV cache (`tandem route-sim`; older summaries "
             "also give route-sim's own backends, `--fast-backends`); in brackets the engine's part of TTFT p50 ms "
             "(its queue and first step), route-sim's and the live answers' (Server-Timing), the rest being the "
             "serving path's.", "",
             "| tenants | prefix | rate/s | arm | hit rate % | TTFT p50 ms | TTFT p90 ms | TTFT p95 ms | E2E p95 ms | "
             "out tok/s | requests per backend (mean) | cut off / failed | route-sim |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in sorted(cells, key=_cell_order):
        spec = cell["spec"]
        for arm, agg in _arms_in_order(cell, meta):
            shares = " ".join(f"{b}={sum(v) / len(v):.0f}" for b, v in agg["requests_by_backend"].items())
            name = f"**{arm}**" if arm == HYBRID_ARM else arm
            lines.append(
                f"| {spec['num_tenants']} | {spec['prefix_tokens']} | {spec['rate_per_s']:g} | {name} | "
                f"{fmt(agg['hit_rate'], 100)}{_mark(cell, arm, 'hit_rate')} | "
                f"{fmt(agg['ttft_p50_s'], 1000)}{_mark(cell, arm, 'ttft_p50_s')} | {fmt(agg.get('ttft_p90_s'), 1000)} | "
                f"{fmt(agg['ttft_p95_s'], 1000)}{_mark(cell, arm, 'ttft_p95_s')} | {fmt(agg['e2e_p95_s'], 1000)} | "
                f"{fmt(agg['output_tok_s'], 1, 0)}{_mark(cell, arm, 'output_tok_s')} | {shares} | "
                f"{agg['num_cut_requests']} / {agg['num_failed_requests']} | {_predicted(cell, arm)} |")
    return lines + _prediction_error_lines(cells)


def prediction_error(cells: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """How far route-sim's predictions were from the live cells, per backend model: over every
    (cell, arm) pair predicted, the median factor between predicted and live TTFT p50 (1.0:
    exact; 1.25 either way) and the median gap in hit rate, in points."""
    errors: dict[str, tuple[list[float], list[float]]] = {}
    for cell in cells:
        for arm, agg in cell["arms"].items():
            predicted = (cell.get("route_sim") or {}).get(arm) or {}
            if "ttft_p50_s" in predicted:  # a summary from before the engine model
                predicted = {"route-sim": predicted}
            live_ttft, live_hit = _mean(agg.get("ttft_p50_s")), _mean(agg.get("hit_rate"))
            for model, p in predicted.items():
                ttft, hit = errors.setdefault(model, ([], []))
                if live_ttft and p.get("ttft_p50_s"):
                    ttft.append(abs(math.log(p["ttft_p50_s"] / live_ttft)))
                if live_hit is not None and p.get("hit_rate") is not None:
                    hit.append(100 * abs(p["hit_rate"] - live_hit))
    return {model: {"pairs": len(ttft), "ttft_p50_factor": math.exp(statistics.median(ttft)),
                    "hit_rate_points": statistics.median(hit) if hit else math.nan}
            for model, (ttft, hit) in errors.items() if ttft}


def _mean(value: Any) -> float | None:
    return value.get("mean") if isinstance(value, dict) else value


def _prediction_error_lines(cells: Sequence[dict[str, Any]]) -> list[str]:
    errors = prediction_error(cells)
    if not errors:
        return []
    return ["", "route-sim against the live cells, median over the (cell, arm) pairs: " + "; ".join(
        f"{model}: TTFT p50 off by x{e['ttft_p50_factor']:.2f}, hit rate by {e['hit_rate_points']:.1f} points "
        f"({e['pairs']} pairs)" for model, e in errors.items()) + "."]


def _predicted(cell: dict[str, Any], arm: str) -> str:
    """route-sim's TTFT p50 ms / hit rate % for the arm, and where both were measured, the
    engine's part of TTFT in route-sim against the live answers' (bench/tenants.py)."""
    predicted = (cell.get("route_sim") or {}).get(arm)
    if not predicted:
        return ""
    if "ttft_p50_s" in predicted:  # a summary from before the engine model: route-sim's own alone
        predicted = {"route-sim": predicted}
    live_engine = _mean(cell["arms"][arm].get("engine_ttft_p50_s"))
    parts = []
    for model, p in predicted.items():
        text = f"{model}: {1000 * p['ttft_p50_s']:.1f} / {100 * p['hit_rate']:.1f}"
        if p.get("engine_ttft_p50_s") is not None and live_engine is not None and not math.isnan(live_engine):
            text += f" (engine part {1000 * p['engine_ttft_p50_s']:.1f}, live {1000 * live_engine:.1f})"
        parts.append(text)
    return "; ".join(parts)


def verdict_lines(cells: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["", "## cost against the best other arm", "",
             "| cell | " + " | ".join(METRIC_LABELS[m] for m in VERDICT_METRICS) + " | hit rate vs prefix-affinity |",
             "|---|" + "---|" * (len(VERDICT_METRICS) + 1)]
    met = total = 0
    for cell in sorted(cells, key=_cell_order):
        v = cell.get("verdict", {})
        row = []
        for metric in VERDICT_METRICS:
            m = v.get(metric)
            if not m:
                row.append("–")
                continue
            scale, unit = (1, "") if metric == "output_tok_s" else (1000, " ms")
            status = {True: "ok", False: "**worse**", None: "one run"}[m["ok"]]
            row.append(f"{scale * m['cost']:.1f} vs {scale * m['best_other']:.1f}{unit} ({m['best_other_arm']}): {status}")
            total += m["ok"] is not None
            met += m["ok"] is True
        h = v.get("hit_rate")
        row.append("–" if not h else f"{100 * h['cost']:.1f}% vs {100 * h['prefix_affinity']:.1f}%: "
                   + ("ok" if h["ok"] else "**more than 5 points below**"))
        lines.append(f"| {cell['cell']} | " + " | ".join(row) + " |")
    lines += ["", f"`cost` at least as good as the best other arm in {met} of {total} judged (cell, metric) pairs."]
    return lines


def why_lines(cells: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]) -> list[str]:
    """For each cell where cost missed, what its routing decisions did (mean over cost's runs)."""
    missed = [c for c in sorted(cells, key=_cell_order)
              if any(m.get("ok") is False for m in c.get("verdict", {}).values())]
    if not missed:
        return []
    lines = ["", "## Where cost lost: its routing decisions", "",
             "Per cell, over `cost`'s runs: decisions that chose a backend holding less of the prompt than the "
             "best-cached routable backend (a hit given up) and the tokens given up per such decision; decisions "
             "that found no cached prefix anywhere (in flight included); requests sent to a cpu backend; the "
             "largest backend's share.", "",
             "| cell | decisions | hit given up | tokens given up per such decision | no prefix anywhere | to cpu | "
             "largest share |", "|---|---|---|---|---|---|---|"]
    for cell in missed:
        d = diagnose_cell(cell["cell"], runs)
        if not d:
            continue
        lines.append(f"| {cell['cell']} | {d['decisions']} | {100 * d['gave_up_hit']:.1f}% | "
                     f"{d['tokens_given_up']:.0f} | {100 * d['cold']:.1f}% | {100 * d['to_cpu']:.1f}% | "
                     f"{100 * d['largest_share']:.1f}% |")
    return lines


def diagnose_cell(cell_name: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    decisions = [d for r in runs if r["cell"] == cell_name and r["arm"] == HYBRID_ARM for d in r.get("decisions", [])]
    if not decisions:
        return {}
    cpu_ids = {b["backend_id"] for r in runs for b in r["cluster"]["backends"] if b["device_kind"] == "cpu"}
    gave_up, tokens, cold, counts = 0, 0, 0, {}
    for d in decisions:
        cached = {b: s.get("num_cached_tokens") or 0 for b, s in d["per_backend"].items()}
        best = max(cached.values())
        if best == 0:
            cold += 1
        elif cached[d["backend_id"]] < best:
            gave_up += 1
            tokens += best - cached[d["backend_id"]]
        counts[d["backend_id"]] = counts.get(d["backend_id"], 0) + 1
    n = len(decisions)
    return {"decisions": n, "gave_up_hit": gave_up / n, "tokens_given_up": tokens / gave_up if gave_up else 0.0,
            "cold": cold / n, "to_cpu": sum(v for b, v in counts.items() if b in cpu_ids) / n,
            "largest_share": max(counts.values()) / n, "by_backend": counts}


def _cell_order(cell: dict[str, Any]) -> tuple:
    s = cell["spec"]
    return s["num_tenants"], s["prefix_tokens"], s["rate_per_s"]


def _arms_in_order(cell: dict[str, Any], meta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    order = list(meta.get("arms") or cell["arms"])
    return sorted(cell["arms"].items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))


def plot_ttft_p95(plt: Any, cells: Sequence[dict[str, Any]], arms: Sequence[str]) -> Any:
    return plot_by_rate(plt, cells, arms, lambda agg: agg["ttft_p95_s"], "TTFT p95, ms", 1000, log_y=True)


def plot_hit_rate(plt: Any, cells: Sequence[dict[str, Any]], arms: Sequence[str]) -> Any:
    return plot_by_rate(plt, cells, arms, lambda agg: agg["hit_rate"], "prefix-cache hit rate, %", 100)


def plot_busiest_share(plt: Any, cells: Sequence[dict[str, Any]], arms: Sequence[str]) -> Any:
    return plot_by_rate(plt, cells, arms, busiest_share, "busiest backend's share of requests, %", 100)


def busiest_share(agg: dict[str, Any]) -> dict[str, Any]:
    """The largest backend's share of the requests (mean over runs; 1/N is an even spread)."""
    counts = agg["requests_by_backend"]
    runs = list(zip(*counts.values())) if counts else []
    shares = [max(run) / sum(run) for run in runs if sum(run)]
    if not shares:
        return {"mean": math.nan, "sd": 0.0, "n": 0}
    mean = sum(shares) / len(shares)
    sd = (sum((x - mean) ** 2 for x in shares) / (len(shares) - 1)) ** 0.5 if len(shares) > 1 else 0.0
    return {"mean": mean, "sd": sd, "n": len(shares)}


def plot_by_rate(plt: Any, cells: Sequence[dict[str, Any]], arms: Sequence[str], metric: Any, label: str,
                 scale: float, log_y: bool = False) -> Any:
    """One panel per (tenants, prefix), `metric(arm's aggregate)` against the arrival rate per arm."""
    panels: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for cell in cells:
        panels.setdefault((cell["spec"]["num_tenants"], cell["spec"]["prefix_tokens"]), []).append(cell)
    if not panels:
        return None
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    arms = list(arms) or sorted({a for c in cells for a in c["arms"]})
    for ax, key in zip(axes[0], keys):
        group = sorted(panels[key], key=lambda c: c["spec"]["rate_per_s"])
        for i, arm in enumerate(arms):
            points = [(c["spec"]["rate_per_s"], metric(c["arms"][arm])) for c in group if arm in c["arms"]]
            points = [(x, s) for x, s in points if s["n"]]
            if not points:
                continue
            ax.errorbar([x for x, _ in points], [scale * s["mean"] for _, s in points],
                        yerr=[scale * s["sd"] for _, s in points], marker="o", capsize=3, label=arm,
                        linewidth=2.2 if arm == HYBRID_ARM else 1.2, color=f"C{i}")
        rates = [c["spec"]["rate_per_s"] for c in group]
        ax.set_xscale("log")
        ax.set_xticks(rates)
        ax.set_xticklabels([f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_title(f"{key[0]} tenants, {key[1]}-token prefixes", fontsize=9)
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel(label)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    return fig
