"""The soak bench's verdict and its files: the checks over a finished run's intervals, and the
JSON, the markdown table and the plot.

The checks read only the report's JSON (plus the bounds given on the command line), so a run's
verdict can be recomputed from its file. Each check is `{name, passed, value, bound, detail}`
with `passed` None when the run was too short to judge it (fewer than three intervals: the
first is warm-up and the second the reference).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from bench.harness import write_json

MIN_INTERVALS = 3


def _check(name: str, passed: bool | None, value: Any, bound: Any, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": passed, "value": value, "bound": bound, "detail": detail}


def rss_slope_mib_per_min(intervals: list[dict[str, Any]], kills_at_s: Sequence[float] = ()) -> float | None:
    """Least-squares slope of the server's RSS over the intervals' end times, from the second on.

    A killed backend's processes go and fresh ones come back with their start-up memory: a step
    in the RSS, not a trend. So the samples are split at each kill, the first sample after a
    kill (taken while the replacement starts) is left out, and the slope is fitted with one
    intercept per segment (the pooled within-segment slope)."""
    segments: list[list[tuple[float, float]]] = [[]]
    kills = sorted(kills_at_s)
    for row in intervals[1:]:
        passed = [k for k in kills if k <= row["end_s"]]
        if passed:
            kills = kills[len(passed):]
            segments.append([])
            continue  # the sample the kill's restart falls in
        segments[-1].append((row["end_s"] / 60.0, row["rss_mib"]))
    cov = var = 0.0
    for points in (p for p in segments if len(p) >= 2):
        mean_t = sum(t for t, _ in points) / len(points)
        mean_m = sum(m for _, m in points) / len(points)
        var += sum((t - mean_t) ** 2 for t, _ in points)
        cov += sum((t - mean_t) * (m - mean_m) for t, m in points)
    return round(cov / var, 2) if var > 0 else None


def checks(report: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    outcomes = report["totals"]["outcomes"]
    intervals = report["intervals"]
    enough = len(intervals) >= MIN_INTERVALS
    out = [
        _check("lost", outcomes["lost"] == 0, outcomes["lost"], 0,
               "requests without their answer, a deserved 4xx or a 429/503"),
        _check("hung", outcomes["hung"] == 0, outcomes["hung"], 0, f"requests with no byte for {args.hang_s:g} s"),
        _check("server_alive", bool(report["server"].get("alive_at_end")), report["server"].get("alive_at_end"), True,
               "the server process is still running after the traffic"),
    ]
    growth = round(intervals[-1]["rss_mib"] - intervals[1]["rss_mib"], 1) if enough else None
    out.append(_check("rss_growth_mib", None if growth is None else growth <= args.max_rss_growth_mib, growth,
                      args.max_rss_growth_mib, "server RSS (idle pool workers aside), last interval minus the second"))
    slope = rss_slope_mib_per_min(intervals, [k["at_s"] for k in report.get("kills", [])]) if enough else None
    out.append(_check("rss_slope_mib_per_min", None if slope is None else slope <= args.max_rss_slope_mib_per_min,
                      slope, args.max_rss_slope_mib_per_min, "least-squares slope of server RSS from the second "
                      "interval on, fitted per segment between backend kills"))
    gpu = [row.get("gpu_mib") for row in (intervals[1], intervals[-1])] if enough else [None, None]
    gpu_growth = round(gpu[1] - gpu[0], 1) if None not in gpu else None
    out.append(_check("gpu_growth_mib", None if gpu_growth is None else gpu_growth <= args.max_gpu_growth_mib,
                      gpu_growth, args.max_gpu_growth_mib, "GPU memory of the server, last interval minus the second"))
    second, last = (intervals[1].get("p99_ms"), intervals[-1].get("p99_ms")) if enough else (None, None)
    ratio = round(last / second, 3) if second and last is not None else None
    out.append(_check("p99_last_over_second", None if ratio is None else ratio <= 1 + args.max_p99_growth, ratio,
                      round(1 + args.max_p99_growth, 3), f"p99 latency of the last interval ({last} ms) over the "
                      f"second's ({second} ms), requests that succeeded"))
    idle = report["idle_kv"]["end"]
    kv = idle.get("kv")
    out.append(_check("idle_kv_blocks", None if not kv else idle["idle"],
                      None if not kv else {b: v["blocks_in_use"] for b, v in kv.items()}, 0,
                      "KV blocks in use per backend once the traffic drained (from /metrics)"))
    return out


# -- files ---------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def growth_by_process(intervals: list[dict[str, Any]]) -> dict[str, float]:
    """Each process's RSS in the last interval minus the second, largest change first (the
    processes present in both)."""
    if len(intervals) < MIN_INTERVALS:
        return {}
    second, last = intervals[1]["rss_mib_by_process"], intervals[-1]["rss_mib_by_process"]
    growth = {role: round(last[role] - second[role], 1) for role in last if role in second}
    return dict(sorted(growth.items(), key=lambda item: -abs(item[1])))


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Soak: {report.get('model')} for {report['settings']['duration_s']:.0f} s, "
             f"{report['settings']['clients']} clients", "",
             f"Command: `{report['command']}`", "",
             f"Server: `{report['server']['command']}`", "",
             f"Machine: {report['machine'].get('cpu_model')}, {report['machine'].get('cpus_usable')} usable CPUs, "
             f"{report['machine'].get('gpu') or 'no GPU'}; git {report['machine'].get('git_revision')}; "
             f"{report['started']} to {report['finished']}.", "",
             "| interval (s) | done | ok | rejected | refused | hung up | hung | lost | p50 ms | p99 ms "
             "| RSS MiB | fds | GPU MiB | KV blocks in use |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["intervals"]:
        o = row["outcomes"]
        kv = ", ".join(f"{b} {v['blocks_in_use']}" for b, v in (row["kv"] or {}).items()) or "-"
        lines.append(f"| {row['start_s']:.0f}-{row['end_s']:.0f} | {row['num_finished']} | {o['ok']} | "
                     f"{o['rejected']} | {o['refused']} | {o['hung_up']} | {o['hung']} | {o['lost']} | "
                     f"{_fmt(row['p50_ms'])} | {_fmt(row['p99_ms'])} | {row['rss_mib']:.0f} | {row['num_fds']} | "
                     f"{_fmt(row['gpu_mib'])} | {kv} |")
    totals = report["totals"]
    lines += ["", f"Sent {totals['num_sent']}: " + ", ".join(f"{k} {v}" for k, v in totals["outcomes"].items()) + ".",
              "", "| kind | " + " | ".join(totals["outcomes"]) + " |", "|---" * (len(totals["outcomes"]) + 1) + "|"]
    for kind, counts in totals["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(v) for v in counts.values()) + " |")
    growth = growth_by_process(report["intervals"])
    if growth:
        lines += ["", "RSS growth by process, last interval minus the second (MiB): "
                  + ", ".join(f"{role} {mib:+.1f}" for role, mib in growth.items()) + "."]
    if report.get("kills"):
        lines += ["", "Killed: " + "; ".join(f"{k['killed']} at {k['at_s']} s" for k in report["kills"])]
    lines += ["", "| check | passed | value | bound | what |", "|---|---|---|---|---|"]
    for c in report["checks"]:
        verdict = {True: "yes", False: "**NO**", None: "skipped"}[c["passed"]]
        lines.append(f"| {c['name']} | {verdict} | {json.dumps(c['value'])} | {c['bound']} | {c['detail']} |")
    if totals["failure_samples"]:
        lines += ["", "Failures (first 20):", ""] + [f"- {f}" for f in totals["failure_samples"]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    """RSS (total and per process), GPU memory and p99 over time; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["intervals"]
    minutes = [row["end_s"] / 60.0 for row in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(minutes, [row["rss_mib"] for row in rows], marker="o", label="server total")
    roles = sorted({role for row in rows for role in row["rss_mib_by_process"]})
    top = sorted(roles, key=lambda r: -max(row["rss_mib_by_process"].get(r, 0) for row in rows))[:6]
    for role in top:
        axes[0].plot(minutes, [row["rss_mib_by_process"].get(role) for row in rows], lw=1, label=role)
    axes[0].set_ylabel("RSS (MiB)")
    axes[0].legend(fontsize=7)
    gpu = [row["gpu_mib"] for row in rows]
    if any(g is not None for g in gpu):
        axes[1].plot(minutes, gpu, marker="o")
    else:
        axes[1].text(0.5, 0.5, "no GPU", ha="center", va="center", transform=axes[1].transAxes)
    axes[1].set_ylabel("GPU memory (MiB)")
    axes[2].plot(minutes, [row["p99_ms"] for row in rows], marker="o", label="p99")
    axes[2].plot(minutes, [row["p50_ms"] for row in rows], marker=".", label="p50")
    axes[2].set_ylabel("latency (ms)")
    axes[2].set_xlabel("minutes (interval end)")
    axes[2].legend(fontsize=7)
    for kill in report.get("kills", []):
        for ax in axes:
            ax.axvline(kill["at_s"] / 60.0, color="red", ls="--", lw=1)
    fig.suptitle(f"soak: {report.get('model')}, {report['settings']['clients']} clients")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_report(report: dict[str, Any], out: Path, stem: str) -> list[Path]:
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    write_json(paths[0], report)
    paths[1].write_text(markdown(report))
    if plot(report, out / f"{stem}.png"):
        paths.append(out / f"{stem}.png")
    return paths
