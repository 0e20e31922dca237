"""What a backend tells the router about its requests, and records as metrics, per engine step.

The router's ledgers need each request's progress, its cost model each step's size and time,
and its mirror of this backend's prefix cache the block hashes published or evicted. All of it
comes in the engine core's one control message per step, with the finished requests' timings
for the latency metrics (their tokens go to their callers, not here). The router gets it in
batches, at most every `interval_s` (and when the engine goes idle, so that a finished request
stops counting as load before its caller's next request is placed), as one fire-and-forget
`router.report.remote(...)` carrying the latest state of each request (reports carry absolute
counts, so between two reports only the last state matters), without Ray's task events (see
`_report`). Runs on the backend actor's core reader thread.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.actors.messages import EngineCoreOutputs, FinishedRequest, StatsTotals
from tandem.actors.metrics import BACKEND_METRICS, Recorder


class ProgressReporter:
    def __init__(self, backend_id: str, instance_id: str, router: Any, interval_s: float) -> None:
        self.backend_id = backend_id
        self.instance_id = instance_id
        self.router = router  # None: nothing to report to (tests, a lone engine)
        self.interval_s = interval_s
        self.metrics = Recorder(BACKEND_METRICS, {"backend": backend_id})
        self.totals = StatsTotals(0, 0, 0.0, 0, 0, 0, 0, 0, 0)  # the counters' last values
        self._progress: dict[str, Any] = {}
        self._steps: list[Any] = []
        self._cache_changes: dict[int, int] = {}
        self._last_report = 0.0

    def on_step(self, message: EngineCoreOutputs) -> None:
        step = message.step
        if step is not None:
            self.metrics.observe("tandem_backend_step_time_seconds", step.elapsed_s)
            self.metrics.inc("tandem_backend_step_seconds", step.elapsed_s)
            self.metrics.inc("tandem_backend_steps")
            self._steps.append(step)
        for finished in message.finished:
            self._record_finished(finished)
        for p in message.progress:
            self._progress[p.req_id] = p
        if message.cache_changes:
            self._cache_changes.update(message.cache_changes)
        now = time.monotonic()
        if step is None or now - self._last_report >= self.interval_s:
            self._report(now)
        if message.stats is not None:
            self._record_stats(message.stats)

    def drop_cache_changes(self) -> None:
        """A prefix-cache snapshot went to the router: it supersedes the changes held."""
        self._cache_changes = {}

    def _report(self, now: float) -> None:
        self._last_report = now
        if not (self._progress or self._steps or self._cache_changes):
            return
        progress, self._progress = list(self._progress.values()), {}
        steps, self._steps = self._steps, []
        cache_changes, self._cache_changes = self._cache_changes, {}
        if self.router is not None:
            # Without Ray's task events: Ray keeps a record of each actor call in its GCS for the
            # dashboard, and at one report per interval per backend those records alone grow the
            # GCS for as long as the server serves (docs/benchmarks/soak-2core.notes.md), for
            # calls nobody looks up one by one.
            self.router.report.options(enable_task_events=False).remote(
                self.backend_id, self.instance_id, progress, steps, cache_changes)

    def _record_finished(self, out: FinishedRequest) -> None:
        self.metrics.inc("tandem_backend_requests_finished", tags={"finish_reason": out.finish_reason or "unknown"})
        if out.finish_reason == "abort":
            return
        arrival = out.arrival_time
        if out.first_token_time is not None:
            self.metrics.observe("tandem_backend_ttft_seconds", max(0.0, out.first_token_time - arrival))
        if out.first_scheduled_time is not None:
            self.metrics.observe("tandem_backend_queue_time_seconds", max(0.0, out.first_scheduled_time - arrival))
        if out.finished_time is not None:
            self.metrics.observe("tandem_backend_e2e_seconds", max(0.0, out.finished_time - arrival))

    def _record_stats(self, stats: StatsTotals) -> None:
        m, old = self.metrics, self.totals
        m.set("tandem_backend_up", 1)
        m.set("tandem_backend_running_requests", stats.num_running)
        m.set("tandem_backend_waiting_requests", stats.num_waiting)
        m.set("tandem_backend_kv_cache_usage", stats.kv_cache_usage)
        m.set("tandem_backend_kv_cache_free_blocks", stats.num_free_blocks)
        m.inc("tandem_backend_prefix_cache_queries", stats.prefix_cache_queries - old.prefix_cache_queries)
        m.inc("tandem_backend_prefix_cache_hits", stats.prefix_cache_hits - old.prefix_cache_hits)
        m.inc("tandem_backend_prompt_tokens", stats.prompt_tokens - old.prompt_tokens)
        m.inc("tandem_backend_generation_tokens", stats.generation_tokens - old.generation_tokens)
        m.inc("tandem_backend_preemptions", stats.preemptions - old.preemptions)
        if stats.kv_host_usage or stats.prefix_cache_host_hits:  # a backend with a host KV tier
            m.set("tandem_backend_kv_host_usage", stats.kv_host_usage)
            m.inc("tandem_backend_prefix_cache_host_hits", stats.prefix_cache_host_hits - old.prefix_cache_host_hits)
            m.inc("tandem_backend_kv_host_offload_bytes", stats.kv_host_offloaded_bytes - old.kv_host_offloaded_bytes)
            m.inc("tandem_backend_kv_host_reload_bytes", stats.kv_host_reloaded_bytes - old.kv_host_reloaded_bytes)
        self.totals = stats
