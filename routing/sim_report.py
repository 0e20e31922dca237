"""Summaries of simulated runs: makespan, throughput, latency percentiles, the oracle's share.

`percentile` interpolates linearly between order statistics (numpy's default), so results
match what a notebook would compute. Makespan is last finish minus first arrival, as the
design's "completion time"; output tok/s is total output tokens over the makespan. The cache
hit rate is prompt tokens reused from a prefix cache over all prompt tokens (the engine's
prefix_cache_hits / prefix_cache_queries).

A policy's gain is measured against `accelerator-only` and set against the oracle's:
`share = (makespan_acc_only - makespan_policy) / (makespan_acc_only - makespan_oracle)`,
undefined (None) when the oracle gains nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from tandem.routing.simulator import RequestOutcome

GAIN_EPSILON_S = 1e-9


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (position - lo) * (ordered[hi] - ordered[lo])


@dataclass
class Summary:
    name: str  # policy name or "oracle"
    makespan_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p50_s: float
    e2e_p95_s: float
    num_requests_by_backend: dict[str, int]
    cache_hit_rate: float = 0.0
    gain_s: float | None = None  # vs accelerator-only
    share_of_oracle_gain: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def summarize(name: str, outcomes: Sequence[RequestOutcome], backend_ids: Sequence[str]) -> Summary:
    first_arrival_s = min(o.arrival_s for o in outcomes)
    makespan_s = max(o.finish_s for o in outcomes) - first_arrival_s
    num_output_tokens = sum(o.num_output_tokens for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes]
    e2es = [o.e2e_s for o in outcomes]
    num_prompt_tokens = sum(o.num_prompt_tokens for o in outcomes)
    counts = {backend_id: 0 for backend_id in backend_ids}
    for o in outcomes:
        counts[o.backend_id] += 1
    return Summary(
        name=name,
        makespan_s=makespan_s,
        output_tok_s=num_output_tokens / makespan_s if makespan_s > 0 else math.inf,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p95_s=percentile(e2es, 95),
        num_requests_by_backend=counts,
        cache_hit_rate=sum(o.num_cached_tokens for o in outcomes) / num_prompt_tokens if num_prompt_tokens else 0.0,
    )


def add_gains(summaries: Sequence[Summary], baseline: Summary | None, oracle: Summary | None) -> None:
    """Fill gain_s and share_of_oracle_gain in place (needs the accelerator-only baseline)."""
    if baseline is None:
        return
    oracle_gain_s = None if oracle is None else baseline.makespan_s - oracle.makespan_s
    for summary in summaries:
        summary.gain_s = baseline.makespan_s - summary.makespan_s
        if oracle_gain_s is not None and oracle_gain_s > GAIN_EPSILON_S:
            summary.share_of_oracle_gain = summary.gain_s / oracle_gain_s


def format_table(summaries: Sequence[Summary]) -> str:
    header = ("policy", "makespan_s", "out_tok/s", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95",
              "requests", "hit_rate", "gain_s", "of_oracle_gain")
    rows = [header] + [_row(s) for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i in (0, 7) else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _row(s: Summary) -> tuple[str, ...]:
    requests = " ".join(f"{k}={v}" for k, v in s.num_requests_by_backend.items())
    gain = "-" if s.gain_s is None else f"{s.gain_s:+.3f}"
    share = "-" if s.share_of_oracle_gain is None else f"{100 * s.share_of_oracle_gain:.0f}%"
    return (s.name, f"{s.makespan_s:.3f}", f"{s.output_tok_s:.1f}", f"{s.ttft_p50_s:.3f}",
            f"{s.ttft_p95_s:.3f}", f"{s.e2e_p50_s:.3f}", f"{s.e2e_p95_s:.3f}", requests,
            f"{100 * s.cache_hit_rate:.1f}%", gain, share)
