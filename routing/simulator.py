"""The what-if simulator: replay a scenario's arrivals through a Router and simulated backends.

At each arrival, every backend is advanced to the arrival time and reports its progress to the
router (the same `ProgressEvent`s a live backend sends: admitted, prefill, generated, finished;
and observed step timings, used if calibration is on); then the router routes the request and
the chosen backend queues it. Backends are modelled in routing/sim_backend.py. The result
holds every decision and each request's timings; routing/sim_report.py summarises them.

In a tenants scenario each backend simulates a prefix cache, and the router sees it as the
live router does: through a mirror that learns published and evicted blocks from the
backends' reports (at the end of the step that published them), plus its own record of the
prefixes it has in flight. The request carries its block hashes, so `prefix-affinity` can
home it and the in-flight accounting can count it. A backend with a host KV tier (the engine
model's, cluster/engine_sim_backend.py) reports each hash by the best tier holding it, and the
mirror keeps the two tiers apart as the live router's does (actors/cache_mirror.py): a request
is told each backend's device hit and the run of host-tier blocks right after it.

Backends that name the same `device` share it (routing/sim_device.py): their steps are timed
together by one `SimDevice`, which advancing any of them advances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tandem.routing.decision import DecisionRecord
from tandem.routing.errors import ConfigError
from tandem.routing.messages import ProgressEvent, RouteRequest
from tandem.routing.router import Router
from tandem.routing.scenario import Scenario, SimBackendSpec, SimRequest
from tandem.routing.sim_backend import Reporter, SimBackend, SimJob
from tandem.routing.sim_device import SimDevice
from tandem.routing.sim_prefix_cache import SimPrefixCache
from tandem.routing.tier_mirror import TierMirror


@dataclass
class TimedDecision:
    time_s: float
    record: DecisionRecord


@dataclass
class RequestOutcome:
    req_id: str
    backend_id: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_output_tokens: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the backend reused (its prefix-cache hit)
    sent_s: float | None = None  # the client's send, before the serving path (None: arrival_s)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self._sent_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self._sent_s

    @property
    def _sent_s(self) -> float:
        return self.arrival_s if self.sent_s is None else self.sent_s


@dataclass
class SimResult:
    policy: str
    decisions: list[TimedDecision]
    outcomes: list[RequestOutcome]  # in scenario order

    @property
    def assignment(self) -> list[str]:
        return [o.backend_id for o in self.outcomes]


class _RouterReporter:
    """Feeds a simulated backend's reports into the router, like the live actors do, and
    keeps the router's mirror of each backend's prefix cache."""

    def __init__(self, router: Router, backend_ids: list[str]) -> None:
        self.router = router
        self.mirrors: dict[str, TierMirror] = {backend_id: TierMirror() for backend_id in backend_ids}

    def on_cache_changes(self, backend_id: str, changes: dict[int, int]) -> None:
        self.mirrors[backend_id].apply(changes)

    def cache_answers(self, request: SimRequest, block_size: int) -> tuple[dict[str, int], dict[str, int]]:
        """Every backend's device hit, and the host-tier run after it on the backends whose run
        is not empty (what the live router's mirrors answer)."""
        num_cached, num_host = {}, {}
        for backend_id, mirror in self.mirrors.items():
            n = num_cached[backend_id] = mirror.num_cached_tokens(request.block_hashes, request.num_prompt_tokens,
                                                                  block_size)
            host = mirror.num_host_cached_tokens(request.block_hashes, request.num_prompt_tokens, block_size, n)
            if host:
                num_host[backend_id] = host
        return num_cached, num_host

    def on_events(self, backend_id: str, events: list[ProgressEvent]) -> None:
        self.router.on_progress(backend_id, events)

    def on_step(self, backend_id: str, num_prefill_tokens: int, num_decode_tokens: int,
                batch_size: int, elapsed_s: float) -> None:
        if elapsed_s > 0:
            self.router.observe_step(backend_id, num_prefill_tokens, num_decode_tokens, batch_size, elapsed_s)


def make_job(index: int, request: SimRequest, backend_id: str) -> SimJob:
    num_cached = min(request.num_cached_tokens.get(backend_id, 0), request.num_prompt_tokens)
    return SimJob(
        index=index,
        req_id=request.req_id,
        arrival_s=request.arrival_s,
        num_prompt_tokens=request.num_prompt_tokens,
        num_prefill_tokens=request.num_prompt_tokens - num_cached,
        num_output_tokens_target=request.num_output_tokens,
        block_hashes=request.block_hashes,
    )


def make_backend(scenario: Scenario, sim_spec: SimBackendSpec, reporter: Reporter | None = None,
                 device: SimDevice | None = None) -> SimBackend:
    """A simulated backend at its actual rates, with a prefix cache in tenants scenarios."""
    if sim_spec.num_host_kv_blocks:
        raise ConfigError(f"backend {sim_spec.spec.backend_id}: num_host_kv_blocks "
                          f"({sim_spec.num_host_kv_blocks}): route-sim's own backends do not model a host KV "
                          "tier; simulate on the engine's scheduler and KV cache (tandem route-sim without "
                          "--fast-backends), or set num_host_kv_blocks to 0")
    cache = None
    if scenario.has_prefix_caches:
        cache = SimPrefixCache(sim_spec.num_kv_blocks, scenario.block_size)
    return SimBackend(sim_spec.spec.backend_id, sim_spec.actual_rates, sim_spec.spec.max_active, reporter, cache,
                      device, sim_spec.step_time())


class BackendFactory(Protocol):
    """Builds one simulated backend (`make_backend`'s signature); another model of a backend, such
    as the engine's own scheduler (cluster/engine_sim_backend.py), plugs in here."""

    def __call__(self, scenario: Scenario, sim_spec: SimBackendSpec, reporter: Reporter | None,
                 device: SimDevice | None) -> Any: ...


def make_backends(scenario: Scenario, reporter: Reporter | None = None,
                  sim_specs: list[SimBackendSpec] | None = None,
                  backend_factory: BackendFactory | None = None) -> dict[str, Any]:
    """Every backend of `sim_specs` (default: the scenario's), those naming one device on one
    `SimDevice`; a device named by a single backend is that backend's alone."""
    sim_specs = scenario.backends if sim_specs is None else sim_specs
    shared = scenario.shared_devices
    devices = {name: SimDevice(name) for name in shared}
    make = backend_factory or make_backend
    return {b.spec.backend_id: make(scenario, b, reporter, devices.get(b.device)) for b in sim_specs}


def route_request(request: SimRequest, scenario: Scenario, reporter: _RouterReporter) -> RouteRequest:
    if not scenario.has_prefix_caches:
        return RouteRequest(request.req_id, request.num_prompt_tokens, request.max_tokens,
                            request.num_cached_tokens, num_host_cached_tokens=request.num_host_cached_tokens)
    num_cached, num_host = reporter.cache_answers(request, scenario.block_size)
    return RouteRequest(request.req_id, request.num_prompt_tokens, request.max_tokens, num_cached,
                        request.block_hashes, scenario.block_size, num_host_cached_tokens=num_host)


def simulate(scenario: Scenario, policy: str | None = None,
             backend_factory: BackendFactory | None = None) -> SimResult:
    """Run the scenario under `policy` (default: the scenario's), on `backend_factory`'s
    backends (default: routing/sim_backend.py's)."""
    router = Router(scenario.backend_specs, policy or scenario.policy, scenario.new_token_ratio,
                    scenario.calibration, scenario.spill_guard, scenario.prefix_affinity,
                    scenario.recompute_weight, scenario.inflight_prefixes, scenario.replication,
                    scenario.queue_weight, scenario.device_shares)
    reporter = _RouterReporter(router, [b.spec.backend_id for b in scenario.backends])
    backends = make_backends(scenario, reporter, backend_factory=backend_factory)
    decisions = []
    for index, request in enumerate(scenario.requests):
        for backend_id, backend in backends.items():
            backend.advance_to(request.arrival_s)
            router.on_progress(backend_id, backend.progress_events_at(request.arrival_s))
        record = router.route(route_request(request, scenario, reporter))
        decisions.append(TimedDecision(request.arrival_s, record))
        backends[record.backend_id].enqueue(make_job(index, request, record.backend_id))
    for backend in backends.values():
        backend.run_to_completion()
    return SimResult(router.policy, decisions, collect_outcomes(scenario, backends.values()))


def collect_outcomes(scenario: Scenario, backends) -> list[RequestOutcome]:
    """Per-request timings, in scenario order, from finished simulated backends."""
    by_index: dict[int, RequestOutcome] = {}
    for backend in backends:
        for job in backend.finished:
            by_index[job.index] = RequestOutcome(
                job.req_id, backend.backend_id, job.arrival_s, job.first_token_s,
                job.finish_s, job.num_output_tokens, job.num_prompt_tokens,
                job.num_prompt_tokens - job.num_prefill_tokens, scenario.requests[job.index].sent_s,
            )
    return [by_index[i] for i in range(len(scenario.requests))]
