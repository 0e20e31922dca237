"""Every metric Tandem exports, declared once, and a recorder over `ray.util.metrics` that keeps
every series in every scrape.

The actors record through Ray's metrics API, so all of them land on one Prometheus scrape
endpoint per node (Ray's metrics export port, which Tandem's page on `--metrics-port` and
`/metrics` on the API port is built from) without each process opening its own port, and the
Ray dashboard's Prometheus sees them too. Ray prefixes every name with `ray_`, and counters get a `_total` suffix;
`MetricSpec.exported_series` spells out what Prometheus actually sees, and the dashboards test
checks every query in `dashboards/` against it, so a renamed metric cannot leave a dashboard
panel silently empty.

Ray's export has two gaps that would leave panels empty, and `Recorder` closes both:
- Ray 2.60's metrics agent drops a gauge that was not set for two report intervals (20 s), and
  Tandem sets most gauges on events (a decision, a request), so an idle server lost them. The
  recorder re-sets every gauge's last value, per label set, every `GAUGE_REFRESH_S`.
- A counter appears only once incremented, and Ray refuses `Counter.inc(0)`. The recorder
  declares each counter at 0 for every label set it can name: the actor's default tags (a
  backend's id), values known up front (`MetricSpec.known_values`, e.g. finish reasons), and
  values it has seen on any other metric (a router learns a backend id from its first gauge),
  or that a caller names with `declare`. It records the 0 through the counter's internal
  `_record`, below the public `inc`'s check.
Inside Ray, counters and gauges are buffered and flushed every `FLUSH_S`: each Ray metric call
costs ~10-20 us of the caller's CPU, and the router and the ingress would otherwise pay several
per request on their serial loops (a decision sets a gauge per backend), where a scrape every
few seconds only ever sees the latest value and the sum. Histogram observations are queued
and recorded by the same flush (one Ray call each still, but on the recorder's thread, not on
the backend's step path or the router's decision path).
Ray has no way to export a histogram before its first observation; Tandem's scrape page adds
those at zero (cluster/metrics_route.py).

Token counters are per backend; latency histograms are per backend and observed when a
request finishes, from the engine's own timestamps (arrival, first scheduled, first token,
finished). Router metrics are per backend and policy.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
RAY_PREFIX = "ray_"

logger = logging.getLogger("tandem.metrics")

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
STAGE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# |observed - projected| TTFT: Ray's histograms take only positive bounds, so the error's sign
# is the metric (tandem_router_ttft_late_seconds / _early_seconds), its size the value.
TTFT_ERROR_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

FLUSH_S = 0.5
# Ray drops a gauge after 2 x metrics_report_interval_ms (10 s by default) without a new value.
GAUGE_REFRESH_S = 5.0

FINISH_REASONS = ("stop", "length", "abort")
MAX_MEMOISED_LABEL_SETS = 4096  # tag values are ids of backends, policies, reasons: a few dozen
HTTP_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as passed to ray.util.metrics
    kind: str
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()
    known_values: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (tag key, values to declare up front)

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
    MetricSpec("tandem_backend_prefix_cache_host_hits", COUNTER,
               "Prompt tokens found in the host KV tier (part of the prefix cache hits), reloaded.", B),
    MetricSpec("tandem_backend_kv_host_offload_bytes", COUNTER, "KV bytes copied from the device to the host tier.", B),
    MetricSpec("tandem_backend_kv_host_reload_bytes", COUNTER, "KV bytes copied from the host tier to the device.", B),
    MetricSpec("tandem_backend_kv_host_usage", GAUGE, "Fraction of the host KV tier's blocks holding a prefix (0-1).", B),
    MetricSpec("tandem_backend_prompt_tokens", COUNTER, "Prompt tokens computed (prefill, cache hits excluded).", B),
    MetricSpec("tandem_backend_generation_tokens", COUNTER, "Tokens generated (decode).", B),
    MetricSpec("tandem_backend_preemptions", COUNTER, "Requests preempted for lack of KV blocks.", B),
    MetricSpec("tandem_backend_requests_finished", COUNTER, "Requests finished, by reason.", ("backend", "finish_reason"),
               known_values=(("finish_reason", FINISH_REASONS),)),
    MetricSpec("tandem_backend_steps", COUNTER, "Engine steps run.", B),
    MetricSpec("tandem_backend_ttft_seconds", HISTOGRAM, "Time to first token (arrival at the server to first token).", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_backend_e2e_seconds", HISTOGRAM, "End-to-end request latency (arrival to finish).", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_backend_queue_time_seconds", HISTOGRAM, "Time from arrival to first scheduled.", B, LATENCY_BUCKETS_S),
    MetricSpec("tandem_backend_step_time_seconds", HISTOGRAM, "Wall time of one engine step.", B, STEP_BUCKETS_S),
    # Ray 2.60 exports a histogram's _sum from bucket midpoints, not the observed values, so
    # an exact mean step time needs its own sum: this counter over tandem_backend_steps.
    MetricSpec("tandem_backend_step_seconds", COUNTER, "Engine step wall time, summed (exact).", B),
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
    MetricSpec("tandem_router_mirrored_host_blocks", GAUGE,
               "Blocks in the router's mirror of each backend's host-memory KV tier (held there only).", B),
    MetricSpec("tandem_router_backends_alive", GAUGE, "Backends currently routable.", ()),
    MetricSpec("tandem_router_backend_failures", COUNTER, "Backends dropped from routing after a failure.", B),
    MetricSpec("tandem_router_reroutes", COUNTER, "Requests routed again after their backend failed.", B),
    MetricSpec("tandem_router_ttft_late_seconds", HISTOGRAM, "Observed minus projected time to first token, for "
               "requests whose first token came later than projected (observed: decision to the first report "
               "of a token).", B, TTFT_ERROR_BUCKETS_S),
    MetricSpec("tandem_router_ttft_early_seconds", HISTOGRAM, "Projected minus observed time to first token, for "
               "requests whose first token came no later than projected.", B, TTFT_ERROR_BUCKETS_S),
    MetricSpec("tandem_router_deadline_refusals", COUNTER, "Requests refused because no backend could meet their "
               "TTFT deadline, by the backend with the best projection.", B),
)

# cluster/dispatch.py's `admission_stages`, declared up front so a panel has every stage at 0
# before the first request.
ADMISSION_STAGES = ("prepare", "route", "to_backend", "to_core", "to_engine", "prefill", "back", "admit")

INGRESS_METRICS = (
    MetricSpec("tandem_http_requests", COUNTER, "HTTP API requests, by endpoint and status code.", ("endpoint", "status"),
               known_values=(("endpoint", HTTP_ENDPOINTS), ("status", ("200",)))),
    MetricSpec("tandem_http_pending_requests", GAUGE, "Requests admitted by the HTTP ingress and not yet finished.", ()),
    MetricSpec("tandem_http_stage_seconds", HISTOGRAM, "A request's time from arrival to admission, per stage "
               "(prepare, route, to_backend, to_core, to_engine, prefill, back; admit when queued).", ("stage",), STAGE_BUCKETS_S,
               known_values=(("stage", ADMISSION_STAGES),)),
    # The exact sum behind each stage's mean (see tandem_backend_step_seconds).
    MetricSpec("tandem_http_stage_time_seconds", COUNTER, "Seconds per admission stage, summed (exact).", ("stage",),
               known_values=(("stage", ADMISSION_STAGES),)),
)

REGISTRY: dict[str, MetricSpec] = {
    spec.name: spec for spec in (*BACKEND_METRICS, *ROUTER_METRICS, *INGRESS_METRICS)
}


def exported_series() -> set[str]:
    return {series for spec in REGISTRY.values() for series in spec.exported_series}




Tags = tuple[tuple[str, str], ...]  # a label set, hashable


class Recorder:
    """Records Tandem metrics through Ray with default tags, and keeps every series exported.

    Metric objects are created inside the process that records (a `ray.util.metrics` object
    belongs to the worker that made it), on first use. While Ray is running, a daemon thread
    declares counters and re-sets gauges every `refresh_s` (see the module docstring); it holds
    the recorder weakly, so it ends when the recorder is gone. The same thread flushes the
    buffered counters and gauges every `flush_s`; outside Ray (`buffered=False`) they are
    recorded at once. Histogram observations are queued and recorded by the flush too. Thread-safe.
    """

    def __init__(self, specs: tuple[MetricSpec, ...], default_tags: dict[str, str] | None = None,
                 refresh_s: float = GAUGE_REFRESH_S, flush_s: float = FLUSH_S,
                 buffered: bool | None = None) -> None:
        self._specs = {spec.name: spec for spec in specs}
        self._default_tags = {k: str(v) for k, v in (default_tags or {}).items()}
        self._metrics: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._known: dict[str, set[str]] = {k: {v} for k, v in self._default_tags.items()}
        for spec in specs:
            for key, values in spec.known_values:
                self._known.setdefault(key, set()).update(values)
        self._label_sets: dict[Any, Tags] = {}  # `_tags`'s memo
        self._gauges: dict[tuple[str, Tags], float] = {}
        self._dirty_gauges: set[tuple[str, Tags]] = set()
        self._counts: dict[tuple[str, Tags], float] = {}
        self._declared: set[tuple[str, Tags]] = set()
        self._observations: collections.deque[tuple[tuple[str, Tags], float]] = collections.deque()
        ray_running = _ray_running()
        self.buffered = ray_running if buffered is None else buffered
        if ray_running:
            threading.Thread(target=_refresh_loop, args=(weakref.ref(self), refresh_s, flush_s),
                             name="tandem-metrics", daemon=True).start()

    # -- recording ---------------------------------------------------------------------------
    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value <= 0:
            return
        key = (name, self._tags(name, tags))
        if self.buffered:
            with self._lock:
                self._counts[key] = self._counts.get(key, 0.0) + value
        else:
            self._metric(name).inc(value, tags=dict(key[1]))

    def set(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        key = (name, self._tags(name, tags))
        with self._lock:  # with refresh's re-set under the same lock, an old value never lands last
            self._gauges[key] = float(value)
            if self.buffered:
                self._dirty_gauges.add(key)
            else:
                self._metric(name).set(float(value), tags=dict(key[1]))

    def flush(self) -> None:
        """Record the buffered increments (one call per series, their sum) and the gauges set
        since the last flush (their latest value)."""
        with self._lock:
            counts, self._counts = self._counts, {}
            dirty, self._dirty_gauges = self._dirty_gauges, set()
            for name, tags in dirty:
                self._metric(name).set(self._gauges[(name, tags)], tags=dict(tags))
        for (name, tags), value in counts.items():
            self._metric(name).inc(value, tags=dict(tags))
        for _ in range(len(self._observations)):  # deque: appends from other threads are never lost
            (name, tags), value = self._observations.popleft()
            self._metric(name).observe(value, tags=dict(tags))

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        key = (name, self._tags(name, tags))
        if self.buffered:
            self._observations.append((key, value))  # deque.append: atomic, no lock on the hot path
        else:
            self._metric(name).observe(value, tags=dict(key[1]))

    # -- keeping series alive ----------------------------------------------------------------
    def declare(self, tags: dict[str, str]) -> None:
        """Export every counter and gauge these tag values (with the defaults and the known
        values) complete, from now on: counters at 0 at once, gauges at 0 until set, from the
        next refresh."""
        if self._learn({k: str(v) for k, v in tags.items()}):
            self._declare_new()

    def refresh(self) -> None:
        """Declare what is new and re-set every gauge to its last value (the thread's slow tick)."""
        self._declare_new()
        self.flush()
        with self._lock:
            for (name, tags), value in self._gauges.items():
                self._metric(name).set(value, tags=dict(tags))

    # -- internals ---------------------------------------------------------------------------
    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            with self._lock:
                metric = self._metrics.get(name)
                if metric is None:
                    metric = self._metrics[name] = _make_metric(self._specs[name])
        return metric

    def _tags(self, name: str, tags: dict[str, str] | None) -> Tags:
        """The metric's label set for these tags. Memoised: the router and the ingress record
        several series per request on their serial loops, with a handful of distinct tag sets."""
        memo_key = (name, tuple(tags.items())) if tags else name
        label_set = self._label_sets.get(memo_key)
        if label_set is not None:
            return label_set
        merged = {**self._default_tags, **(tags or {})}
        label_set = tuple((k, str(merged[k])) for k in self._specs[name].tag_keys)
        if tags and self._learn(dict(label_set)):
            self._declare_new()
        if len(self._label_sets) >= MAX_MEMOISED_LABEL_SETS:
            self._label_sets.clear()
        self._label_sets[memo_key] = label_set
        return label_set

    def _learn(self, tags: dict[str, str]) -> bool:
        with self._lock:
            new = [(k, v) for k, v in tags.items() if v not in self._known.get(k, ())]
            for k, v in new:
                self._known.setdefault(k, set()).add(v)
        return bool(new)

    def _declare_new(self) -> None:
        with self._lock:
            todo = [(spec, tags) for spec in self._specs.values() if spec.kind != HISTOGRAM
                    for tags in _label_sets(spec.tag_keys, self._known)
                    if (spec.name, tags) not in self._declared]
            self._declared.update((spec.name, tags) for spec, tags in todo)
            for spec, tags in todo:
                if spec.kind == GAUGE:
                    self._gauges.setdefault((spec.name, tags), 0.0)
        for spec, tags in todo:  # gauges go out with the next refresh
            if spec.kind == COUNTER:
                _record_zero(self._metric(spec.name), dict(tags))


def _label_sets(tag_keys: tuple[str, ...], known: dict[str, set[str]]) -> list[Tags]:
    """Every label set the known values complete for these keys (none if a key has no value)."""
    choices = [sorted(known.get(key, ())) for key in tag_keys]
    return [tuple(zip(tag_keys, values)) for values in itertools.product(*choices)]


def _make_metric(spec: MetricSpec) -> Any:
    from ray.util import metrics

    if spec.kind == COUNTER:
        return metrics.Counter(spec.name, spec.description, tag_keys=spec.tag_keys)
    if spec.kind == GAUGE:
        return metrics.Gauge(spec.name, spec.description, tag_keys=spec.tag_keys)
    return metrics.Histogram(spec.name, spec.description, boundaries=list(spec.boundaries), tag_keys=spec.tag_keys)


def _record_zero(counter: Any, tags: dict[str, str]) -> None:
    """Export a counter at 0. `Counter.inc` refuses 0, but the point it would record is valid
    (Ray 2.60 exports it as 0); `_record` is the step below that check."""
    record = getattr(counter, "_record", None)
    if record is not None:
        record(0, tags=tags)


def _ray_running() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _refresh_loop(recorder_ref: weakref.ref, refresh_s: float, flush_s: float) -> None:
    next_refresh = 0.0
    while True:
        recorder = recorder_ref()
        if recorder is None:
            return
        try:
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + refresh_s
                recorder.refresh()
            else:
                recorder.flush()
        except Exception as exc:  # a failed tick must not end the thread; the next one retries
            logger.warning("metrics refresh failed: %s: %s", type(exc).__name__, exc)
        del recorder
        time.sleep(flush_s)
