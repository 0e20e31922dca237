"""Per-run metrics and their means and spreads across runs.

As in the design's write-up and routing/sim_report.py: makespan is the last request's end minus
the first one's send, output tok/s all output tokens over it, TTFT and E2E per request
(bench/client.py) with percentiles interpolated linearly, requests per backend from the
`x-tandem-backend` header. Across runs each metric gets its mean, sample standard deviation,
min and max; "worse beyond the run-to-run spread" means worse than the baseline's mean by more
than the larger of the two standard deviations (one run has no spread, and the verdict says so).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from tandem.routing import sim_report

# metric -> True if higher is better
METRICS: dict[str, bool] = {
    "makespan_s": False,
    "output_tok_s": True,
    "ttft_p50_s": False,
    "ttft_p95_s": False,
    "e2e_p50_s": False,
    "e2e_p95_s": False,
}


def percentile(values: Sequence[float], q: float) -> float | None:
    """Every bench's percentile: linear between closest ranks, as routing/sim_report.py's; None
    without values."""
    return sim_report.percentile(values, q) if values else None


@dataclass
class RunMetrics:
    num_requests: int
    num_ok: int
    makespan_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p50_s: float
    e2e_p95_s: float
    num_output_tokens: int
    requests_by_backend: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def run_metrics(requests: Sequence[dict[str, Any]], backend_ids: Sequence[str] = ()) -> RunMetrics:
    """Metrics of one run from its per-request dicts (`RequestResult.to_dict()`)."""
    ok = [r for r in requests if r.get("error") is None and r.get("end_s") is not None]
    counts = {b: 0 for b in backend_ids}
    for r in ok:
        counts[r["backend"]] = counts.get(r["backend"], 0) + 1
    if not ok:
        nan = math.nan
        return RunMetrics(len(requests), 0, nan, nan, nan, nan, nan, nan, 0, counts)
    first_send = min(r["send_s"] for r in requests)
    makespan = max(r["end_s"] for r in ok) - first_send
    num_tokens = sum(r["num_output_tokens"] for r in ok)
    ttfts = [r["ttft_s"] for r in ok]
    e2es = [r["e2e_s"] for r in ok]
    return RunMetrics(
        num_requests=len(requests), num_ok=len(ok), makespan_s=makespan,
        output_tok_s=num_tokens / makespan if makespan > 0 else math.nan,
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        e2e_p50_s=percentile(e2es, 50), e2e_p95_s=percentile(e2es, 95),
        num_output_tokens=num_tokens, requests_by_backend=counts)


@dataclass
class Spread:
    mean: float
    sd: float  # sample standard deviation; 0 with one run
    min: float
    max: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def spread(values: Sequence[float]) -> Spread:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return Spread(math.nan, math.nan, math.nan, math.nan, 0)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return Spread(statistics.fmean(values), sd, min(values), max(values), len(values))


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread of every metric over runs (each a `RunMetrics.to_dict()`)."""
    out: dict[str, Any] = {name: spread([r[name] for r in runs]).to_dict() for name in METRICS}
    backends = sorted({b for r in runs for b in r["requests_by_backend"]})
    out["requests_by_backend"] = {b: [r["requests_by_backend"].get(b, 0) for r in runs] for b in backends}
    out["num_runs"] = len(runs)
    out["num_failed_requests"] = sum(r["num_requests"] - r["num_ok"] for r in runs)
    return out


def relative_change(baseline: float, value: float) -> float:
    """(value - baseline) / baseline; NaN if the baseline is 0 or missing."""
    if baseline is None or value is None or not baseline or math.isnan(baseline) or math.isnan(value):
        return math.nan
    return (value - baseline) / baseline


def compare(baseline: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any]:
    """Per metric: relative change of the means and whether the candidate is worse beyond the spread.

    `worse` is True/False, or None when either arm has a single run (no spread to judge by).
    """
    out = {}
    for name, higher_is_better in METRICS.items():
        b, c = baseline[name], candidate[name]
        delta = c["mean"] - b["mean"]
        worse_by = -delta if higher_is_better else delta
        tolerance = max(b["sd"], c["sd"])
        judged = b["n"] > 1 and c["n"] > 1
        out[name] = {"change": round(relative_change(b["mean"], c["mean"]), 6), "worse_by": round(worse_by, 6),
                     "tolerance": round(tolerance, 6), "worse": (worse_by > tolerance) if judged else None}
    return out
