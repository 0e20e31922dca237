"""Every metric Tandem exports, declared once, and a thin recorder over `ray.util.metrics`.

The actors record through Ray's metrics API, so all of them land on one Prometheus scrape
endpoint per node (Ray's metrics export port, `--metrics-port`) without each process opening
its own port. Ray prefixes every name with `ray_`, and counters get a `_total` suffix;
`MetricSpec.exported_series` spells out what Prometheus actually sees, and the dashboards test
checks every query in `dashboards/` against it, so a renamed metric cannot leave a dashboard
panel silently empty.

Token counters are per backend; latency histograms are per backend and observed when a
request finishes, from the engine's own timestamps (arrival, first scheduled, first token,
finished). Router metrics are per backend and policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
RAY_PREFIX = "ray_"

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as passed to ray.util.metrics
    kind: str
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()

    @property
    def exported_name(self) -> str:
        suffix = "_total" if self.kind == COUNTER else ""
        return f"{RAY_PREFIX}{self.name}{suffix}"

    @property
    def exported_series(self) -> tuple[str, ...]:
        """Series names a Prometheus query may use for this metric."""
        base = self.exported_name
        if self.kind == HISTOGRAM:
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (base,)


B = ("backend",)
BACKEND_METRICS = (
    MetricSpec("tandem_backend_running_requests", GAUGE, "Requests in the running batch.", B),
    MetricSpec("tandem_backend_waiting_requests", GAUGE, "Requests queued in the backend's scheduler.", B),
    MetricSpec("tandem_backend_kv_cache_usage", GAUGE, "Fraction of KV blocks held by requests (0-1).", B),
    MetricSpec("tandem_backend_kv_cache_free_blocks", GAUGE, "Free KV blocks (cached-but-unused count as free).", B),
    MetricSpec("tandem_backend_prefix_cache_queries", COUNTER, "Prompt tokens looked up in the prefix cache.", B),
    MetricSpec("tandem_backend_prefix_cache_hits", COUNTER, "Prompt tokens found in the prefix cache.", B),
    MetricSpec("tandem_backend_prompt_tokens", COUNTER, "Prompt tokens computed (prefill, cache hits excluded).", B),
    MetricSpec("tandem_backend_generation_tokens", COUNTER, "Tokens generated (decode).", B),
    MetricSpec("tandem_backend_preemptions", COUNTER, "Requests preempted for lack of KV blocks.", B),
    MetricSpec("tandem_backend_requests_finished", COUNTER, "Requests finished, by reason.", ("backend", "finish_reason")),
    MetricSpec("tandem_backend_steps", COUNTER, "Engine steps run.", B),
    MetricSpec("tandem_backend_ttft_seconds", HISTOGRAM, "Time to first token (arrival at the server to first token).", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_backend_e2e_seconds", HISTOGRAM, "End-to-end request latency (arrival to finish).", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_backend_queue_time_seconds", HISTOGRAM, "Time from arrival to first scheduled.", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_backend_step_time_seconds", HISTOGRAM, "Wall time of one engine step.", B, STEP_BUCKETS_S),
    MetricSpec("tandem_backend_up", GAUGE, "1 while the backend actor is serving.", B),
)

ROUTER_METRICS = (
    MetricSpec("tandem_router_decisions", COUNTER, "Routing decisions, by chosen backend and policy.", ("backend", "policy")),
    MetricSpec("tandem_router_estimated_cost_seconds", GAUGE, "The chosen and rejected backends' scores at the last decision.", B),
    MetricSpec("tandem_router_pending_seconds", GAUGE, "Estimated seconds of work already on each backend.", B),
    MetricSpec("tandem_router_pending_requests", GAUGE, "Requests the router's ledger holds per backend.", B),
    MetricSpec("tandem_router_estimated_completion_seconds", HISTOGRAM, "Chosen backend's score at decision time.", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_router_realised_completion_seconds", HISTOGRAM, "Decision to finish, as observed.", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_router_completion_ratio", HISTOGRAM, "Realised over estimated completion time.", B, RATIO_BUCKETS),
    MetricSpec("tandem_router_mirrored_cached_blocks", GAUGE, "Blocks in the router's mirror of each backend's prefix cache.", B),
    MetricSpec("tandem_router_backends_alive", GAUGE, "Backends currently routable.", ()),
    MetricSpec("tandem_router_backend_failures", COUNTER, "Backends dropped from routing after a failure.", B),
    MetricSpec("tandem_router_reroutes", COUNTER, "Requests routed again after their backend failed.", B),
)

INGRESS_METRICS = (
    MetricSpec("tandem_http_requests", COUNTER, "HTTP API requests, by endpoint and status code.", ("endpoint", "status")),
    MetricSpec("tandem_http_pending_requests", GAUGE, "Requests admitted by the HTTP ingress and not yet finished.", ()),
)

REGISTRY: dict[str, MetricSpec] = {
    spec.name: spec for spec in (*BACKEND_METRICS, *ROUTER_METRICS, *INGRESS_METRICS)
}


def exported_series() -> set[str]:
    return {series for spec in REGISTRY.values() for series in spec.exported_series}


class Recorder:
    """Creates Ray metric objects for a set of specs and records with default tags.

    Metric objects are created lazily (on first use), inside the actor that records, since a
    `ray.util.metrics` object belongs to the worker process that made it.
    """

    def __init__(self, specs: tuple[MetricSpec, ...], default_tags: dict[str, str] | None = None) -> None:
        self._specs = {spec.name: spec for spec in specs}
        self._default_tags = default_tags or {}
        self._metrics: dict[str, Any] = {}

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util import metrics

            spec = self._specs[name]
            if spec.kind == COUNTER:
                metric = metrics.Counter(spec.name, spec.description, tag_keys=spec.tag_keys)
            elif spec.kind == GAUGE:
                metric = metrics.Gauge(spec.name, spec.description, tag_keys=spec.tag_keys)
            else:
                metric = metrics.Histogram(spec.name, spec.description, boundaries=list(spec.boundaries),
                                           tag_keys=spec.tag_keys)
            self._metrics[name] = metric
        return metric

    def _tags(self, name: str, tags: dict[str, str] | None) -> dict[str, str]:
        merged = {**self._default_tags, **(tags or {})}
        return {k: str(merged[k]) for k in self._specs[name].tag_keys}

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            self._metric(name).inc(value, tags=self._tags(name, tags))

    def set(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        self._metric(name).set(value, tags=self._tags(name, tags))

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        self._metric(name).observe(value, tags=self._tags(name, tags))
