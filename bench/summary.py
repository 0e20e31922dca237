"""From run records to cells: per arm the mean and spread of every metric over runs
(bench/metrics.py); every other arm against accelerator-only, each metric's change and whether it
is worse beyond the run-to-run spread; the oracle and the router's share of its gain
(bench/oracle.py); and the routing decisions around each hybrid run's first offload (the
design's worked example shows those).
"""

from __future__ import annotations

from typing import Any, Sequence

from bench.metrics import aggregate, compare
from bench.oracle import cell_oracle, meets_target

BASELINE_ARM = "accelerator-only"
HYBRID_ARM = "cost"


def group_by_cell(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    cells: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        cells.setdefault(record["cell"], []).append(record)
    return cells


def summarize_cell(records: Sequence[dict[str, Any]], accel_id: str) -> dict[str, Any]:
    arms: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (r["arm"], r["run"])):
        arms.setdefault(record["arm"], []).append(record)
    out: dict[str, Any] = {"cell": records[0]["cell"], "workload": _workload_brief(records[0]["workload"]),
                           "arms": {arm: aggregate([r["metrics"] for r in runs]) for arm, runs in arms.items()},
                           "runs": {arm: [r["run"] for r in runs] for arm, runs in arms.items()}}
    baseline = arms.get(BASELINE_ARM)
    if baseline:
        out["vs_baseline"] = {arm: compare(out["arms"][BASELINE_ARM], out["arms"][arm]) for arm in arms
                              if arm != BASELINE_ARM}
    hybrid = arms.get(HYBRID_ARM)
    if baseline and hybrid:
        oracle = cell_oracle(baseline, hybrid, accel_id)
        oracle["meets_target"] = meets_target(oracle)
        out["oracle"] = oracle
    if hybrid:
        out["first_offload"] = [first_offload_window(r, accel_id) for r in hybrid]
    return out


def _workload_brief(workload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in workload.items() if k != "arrivals_s"}


def first_offload_window(record: dict[str, Any], accel_id: str, before: int = 2, after: int = 1) -> dict[str, Any]:
    """The decisions around the first one that chose a backend other than the accelerator."""
    decisions = record.get("decisions", [])
    first = next((i for i, d in enumerate(decisions) if d["backend_id"] != accel_id), None)
    window = [] if first is None else decisions[max(0, first - before): first + after + 1]
    return {"run": record["run"], "first_offload_position": None if first is None else first + 1,
            "decisions": [compact_decision(d, position) for position, d in
                          enumerate(window, start=1 + max(0, (first or 0) - before))]}


def compact_decision(decision: dict[str, Any], position: int) -> dict[str, Any]:
    keep = ("num_active", "num_queued", "num_cached_tokens", "num_prefill_tokens", "num_decode_tokens",
            "prefill_term_s", "decode_term_s", "score_s", "prefill_tok_s", "decode_tok_s")
    return {"position": position, "index": decision["index"], "backend_id": decision["backend_id"],
            "per_backend": {b: {k: s.get(k) for k in keep} for b, s in decision["per_backend"].items()},
            "cache_answers": decision.get("cache_answers")}


def summarize(records: Sequence[dict[str, Any]], accel_id: str) -> list[dict[str, Any]]:
    return [summarize_cell(runs, accel_id) for runs in group_by_cell(records).values()]
