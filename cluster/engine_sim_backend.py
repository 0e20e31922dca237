"""route-sim's backend on the engine's own scheduler and KV cache, in virtual time.

route-sim's first backend model (routing/sim_backend.py) is a small scheduler of its own:
prefill first, no chunking, a prefix cache of prompts' full blocks. The engine does otherwise: it
runs mixed steps (new prompts, in chunks up to `max_num_batched_tokens`, beside the running
decodes), caches generated blocks too, and evicts by its block pool's LRU. Under cache pressure
and load those differences decide TTFT, so a prediction is only as good as the scheduler it runs.
This backend runs the engine's `Scheduler` and `KVCacheManager` themselves, timed by the same
step-time model as the `sim` device (routing/step_time.py, the step's shape from
engine/sim_runner.py): the sim device is this, in real time, behind the real server.

It speaks route-sim's backend protocol (`next_boundary`, `process_boundary`, `enqueue`,
`advance_to`, `progress_events_at`, `finished`), so `routing.simulator.simulate` takes it through
its `backend_factory` and the router sees the same reports: admitted, prefill, generated and
finished events at each step's end, the step's timing for calibration, and the cache's published
and evicted blocks. Every step is its own boundary (no planned runs), which costs speed, not
accuracy.

Host KV tier. A backend with `num_host_kv_blocks` builds its KV cache manager with a host tier of
that many blocks, as a cuda engine with `kv_host_memory_gb` does: blocks the device evicts are
offloaded, and a later prefix hit continues into them. A step lasts what the sim device makes it
last (engine/sim_runner.py): its step time plus its reloads, the reloaded blocks' tokens at the
backend's `actual_rates.reload_tok_s` (StepTimeModel.reload_s); offloads cost nothing. Cache
changes are reported by tier (1 device, 2 host tier only, 0 nowhere), as a live backend reports
them, and the router's mirror in the simulator keeps the tiers apart.

The host's floor. Where the scenario measured the engine's host work per step behind the server
(`step_time.host_s_per_step_by_batch`), a step lasts at least that (StepTimeModel.floor_s): the
sim device's host work is real, this backend's is not.

Token ids. A route-sim request carries its prompt's block hashes, not tokens; the engine hashes
tokens. Each prompt block gets token ids drawn from its route-sim hash (equal hashes, equal
tokens, so the engine's prefix cache shares exactly what route-sim's hashes share), the tail of
the prompt ids of its own; the engine's hash of each block is mapped back to the route-sim hash
in the reports, since the router's mirror speaks route-sim's hashes. Generated blocks have no
route-sim hash and are not reported (the router never asks for them).

Asynchronous scheduling. An engine on cuda or the sim device plans step N+1 while step N runs
(engine/llm_engine.py), so a step's requests are those that had arrived when the step before it
started: a request that arrives while a step runs waits for that step and the one already
planned behind it, one step more than a synchronous engine. With `async_scheduling` this
backend does the same: at each step's start it plans the next one (`Scheduler.schedule` and
`advance`, the placeholders the engine uses), and a step's tokens, events and finished requests
are those planned for it, reported at its end. Where the engine plans synchronously (cpu), so
does this backend; `engine_backend_factory` takes the engine's own rule per device kind.

Engines sharing a device. Backends that name one device (`cuda*4` on one GPU) share its time
through routing/sim_device.py's `SimDevice`, as route-sim's own backends do: a step's time from
the step-time model is its work, done at 1/k speed while k members are in a step, and the device
advances its members in time order.

It lives in the cluster layer because it needs both the engine and routing, which may not
import each other.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

from tandem.engine.config import default_async_scheduling, default_max_num_batched_tokens
from tandem.engine.kv_cache.host_tier import KVTransfers
from tandem.engine.kv_cache.manager import DEFAULT_OFFLOAD_MIN_HITS, KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tandem.engine.sim_runner import SIM_DEVICE, step_shape
from tandem.routing import messages
from tandem.routing.errors import ConfigError
from tandem.routing.messages import ProgressEvent
from tandem.routing.scenario import Scenario, SimBackendSpec
from tandem.routing.sim_backend import Reporter, SimBackend, SimJob
from tandem.routing.sim_device import SimDevice
from tandem.routing.simulator import make_backend
from tandem.routing.step_time import StepTimeModel

DEFAULT_MAX_NUM_BATCHED_TOKENS = default_max_num_batched_tokens("cuda")
# A sim backend's profiles emulate GPUs (a scenario may set its budget per backend).
_ENGINE_DEVICE = {SIM_DEVICE: "cuda"}
_TOKEN = 1  # every generated token (its id does not matter to the schedule)


@dataclass
class _Step:
    """A planned step: what runs, how long it takes alone, and what each scheduled request will
    have at its end (planned with `Scheduler.advance`, as the engine plans a launch)."""

    sched: SchedulerOutput
    shape: tuple[int, int, int]  # engine/sim_runner.py's step_shape, taken before the advance
    work_s: float
    computed: list[int]  # each scheduled request's computed tokens after the step
    output_index: list[int | None]  # the output each scheduled request samples (None: a prefill chunk)
    finishes: list[bool]  # whether the step's token is the request's last


class EngineSimBackend:
    def __init__(self, backend_id: str, step_time: StepTimeModel, max_active: int, num_kv_blocks: int,
                 block_size: int, reporter: Reporter | None = None,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, num_host_kv_blocks: int = 0,
                 offload_min_hits: int = DEFAULT_OFFLOAD_MIN_HITS, device: SimDevice | None = None,
                 async_scheduling: bool = False) -> None:
        """`num_host_kv_blocks` > 0 adds a host KV tier, whose reloads `step_time.reload_s` times;
        `device` is the SimDevice this backend shares with others (None: a device of its own);
        `async_scheduling` plans each step while the one before it runs (module doc)."""
        if num_host_kv_blocks and step_time.host_reload_tok_s is None:
            raise ValueError("a host KV tier needs a step-time model with a reload rate (host_reload_tok_s)")
        self.backend_id = backend_id
        self.step_time = step_time
        self.block_size = block_size
        self.reporter = reporter
        self._changes: dict[int, int] = {}
        self._engine_to_route_hash: dict[int, int] = {}
        kv = KVCacheManager(num_kv_blocks, block_size, on_change=self._changed, num_host_blocks=num_host_kv_blocks,
                            offload_min_hits=offload_min_hits)
        self.kv_cache_manager = kv
        self.scheduler = Scheduler(SchedulerConfig(max_active, max_num_batched_tokens, block_size, num_kv_blocks),
                                   kv, clock=lambda: self.now)
        self.pending: deque[SimJob] = deque()  # enqueued, arriving later (the oracle enqueues ahead)
        self.jobs: dict[str, SimJob] = {}
        self._waiting: set[str] = set()  # added, never scheduled yet
        self.finished: list[SimJob] = []
        self.now = -math.inf
        self.step_end_s = math.inf
        self.async_scheduling = async_scheduling
        self._step: _Step | None = None  # the step running now
        self._step_start_s = -math.inf
        self._planned: _Step | None = None  # the step planned behind it (asynchronous scheduling)
        self.device = device
        if device is not None:
            device.add(self)

    @property
    def step(self) -> _Step | None:
        """The step running now (SimDevice's member protocol: None when idle)."""
        return self._step

    # -- route-sim's backend protocol --------------------------------------------------------
    def next_boundary(self) -> float:
        if self._step is not None:
            return self.step_end_s
        if self.scheduler.has_unfinished_requests():
            return self.now
        if self.pending:
            return max(self.now, self.pending[0].arrival_s)
        return math.inf

    def enqueue(self, job: SimJob) -> None:
        self.pending.append(job)

    def advance_to(self, t: float) -> None:
        """Process every boundary strictly before `t` (through the device, if shared)."""
        if self.device is not None:
            self.device.advance_to(t)
            return
        while self.next_boundary() < t:
            self.process_boundary()

    def run_to_completion(self) -> None:
        self.advance_to(math.inf)

    def progress_events_at(self, t: float) -> list[ProgressEvent]:
        return []  # every step is a boundary: the router has seen everything up to the last one

    def process_boundary(self) -> None:
        """End the running step (its tokens, events, timing, cache changes), admit arrivals,
        start the next step: the one planned while this one ran, else one planned now. With
        asynchronous scheduling, plan the step after it."""
        t = self.next_boundary()
        events: list[ProgressEvent] = []
        if self._step is not None:
            self._end_step(t, events)
        self.now = t
        while self.pending and self.pending[0].arrival_s <= t:
            self._add(self.pending.popleft(), events)
        step, self._planned = self._planned or self._plan(events), None
        if step is not None:
            self._start_step(step, t)
            if self.async_scheduling:
                self._planned = self._plan(events)
        else:
            self.step_end_s = math.inf
        if self.reporter is not None and events:
            self.reporter.on_events(self.backend_id, events)

    # -- steps ---------------------------------------------------------------------------------
    def _plan(self, events: list[ProgressEvent]) -> _Step | None:
        """Schedule a step and advance its requests past it, as the engine does at a launch."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        for s in sched.scheduled:
            request = s.request
            if request.req_id in self._waiting:  # scheduled for the first time: its prefix hit is known
                self._waiting.discard(request.req_id)
                self.jobs[request.req_id].num_prefill_tokens = request.num_prompt_tokens - request.num_cached_tokens
                events.append(ProgressEvent(request.req_id, messages.ADMITTED))
        shape = step_shape(sched)
        work_s = max(self.step_time.step_s(*shape) + self._reload_s(sched.kv_transfers),
                     self.step_time.floor_s(len(sched.scheduled)))
        sampled = {request.req_id: index for request, index in self.scheduler.advance(sched)}
        scheduled = [s.request for s in sched.scheduled]
        return _Step(sched, shape, work_s, [r.num_computed_tokens for r in scheduled],
                     [sampled.get(r.req_id) for r in scheduled], [r.is_finished for r in scheduled])

    def _start_step(self, step: _Step, t: float) -> None:
        self._step, self._step_start_s = step, t
        if self.device is None:
            self.step_end_s = t + step.work_s
        else:
            self.device.begin_step(self, step.work_s)  # it sets the end, once it knows who else is busy

    def _reload_s(self, transfers: KVTransfers | None) -> float:
        """The step's reloads from the host tier (engine/sim_runner.py's rule). A schedule that
        admits nothing plans none, so an empty step has no copies to time."""
        if transfers is None or not transfers.reloads:
            return 0.0
        return self.step_time.reload_s(len(transfers.reloads) * self.block_size)

    def _end_step(self, t: float, events: list[ProgressEvent]) -> None:
        """The step's sampled tokens land: each request gets what was planned for it."""
        step, self._step = self._step, None
        num_sampled = 0
        for s, computed, index, finishes in zip(step.sched.scheduled, step.computed, step.output_index,
                                                step.finishes):
            request = s.request
            job = self.jobs[request.req_id]
            if index is None:
                events.append(ProgressEvent(request.req_id, messages.PREFILL, computed))
                continue
            num_sampled += 1
            request.resolve_placeholder(index, _TOKEN)
            if job.first_token_s is None:
                job.first_token_s = t
                events.append(ProgressEvent(request.req_id, messages.PREFILL, request.num_prompt_tokens))
            job.num_output_tokens = index + 1
            events.append(ProgressEvent(request.req_id, messages.GENERATED, job.num_output_tokens))
            if finishes:
                job.finish_s = t
                self.finished.append(self.jobs.pop(request.req_id))
                events.append(ProgressEvent(request.req_id, messages.FINISHED))
        if self.reporter is not None:
            num_prefill, num_decode, _ = step.shape
            self.reporter.on_step(self.backend_id, num_prefill, num_decode, num_decode or num_sampled,
                                  t - self._step_start_s)
            if self._changes:
                changes, self._changes = self._changes, {}
                self.reporter.on_cache_changes(self.backend_id, changes)

    # -- requests ------------------------------------------------------------------------------
    def _add(self, job: SimJob, events: list[ProgressEvent]) -> None:
        params = SamplingParams(max_tokens=job.num_output_tokens_target, ignore_eos=True)
        request = Request(job.req_id, self._prompt_ids(job), params, arrival_time=job.arrival_s)
        for engine_hash, route_hash in zip(request.block_hashes(self.block_size), job.block_hashes):
            self._engine_to_route_hash[engine_hash] = route_hash
        self.jobs[job.req_id] = job
        self._waiting.add(job.req_id)
        self.scheduler.add_request(request)

    def _prompt_ids(self, job: SimJob) -> list[int]:
        """Tokens whose engine hashes share exactly what the job's route-sim hashes share."""
        ids: list[int] = []
        for route_hash in job.block_hashes:
            rng = random.Random(route_hash)
            ids.extend(rng.randrange(3, 1 << 30) for _ in range(self.block_size))
        rng = random.Random(job.req_id)
        ids.extend(rng.randrange(3, 1 << 30) for _ in range(job.num_prompt_tokens - len(ids)))
        return ids

    def _changed(self, engine_hash: int, state: int) -> None:
        """A block's KV tier changed: route-sim hears the tier state (engine/kv_cache/manager.py's
        TIER_*), the latest per hash, at the step's end."""
        route_hash = self._engine_to_route_hash.get(engine_hash)
        if route_hash is not None:
            self._changes[route_hash] = state


def engine_backend_factory(max_num_batched_tokens: int | None = None, async_scheduling: bool | None = None):
    """`routing.simulator.simulate`'s `backend_factory` for backends on the engine's scheduler.

    A scenario without prefix caches (fixed hits per request, the design's experiment) has no
    cache for the engine to model, and its fixed hits are not prompts the engine's cache could
    produce: its backends are route-sim's own (routing/simulator.py's `make_backend`), so one
    factory serves every scenario. `max_num_batched_tokens` overrides every backend's step budget
    (default: the scenario's per backend, else the engine's default for its device kind), and
    `async_scheduling` whether they plan a step ahead (default: the engine's rule for the kind)."""

    def make(scenario: Scenario, sim_spec: SimBackendSpec, reporter: Reporter | None,
             device) -> EngineSimBackend | SimBackend:
        if not scenario.has_prefix_caches:
            return make_backend(scenario, sim_spec, reporter, device)
        backend_id, rates = sim_spec.spec.backend_id, sim_spec.actual_rates
        if sim_spec.num_host_kv_blocks and rates.reload_tok_s is None:
            raise ConfigError(f"backend {backend_id}: a host KV tier ({sim_spec.num_host_kv_blocks} blocks) needs "
                              "the rate its blocks are reloaded at: give reload_tok_s in its actual rates")
        step_time = sim_spec.step_time(with_host_tier=bool(sim_spec.num_host_kv_blocks))
        device_kind = _ENGINE_DEVICE.get(sim_spec.spec.device_kind, sim_spec.spec.device_kind)
        budget = max_num_batched_tokens or sim_spec.max_num_batched_tokens or default_max_num_batched_tokens(device_kind)
        num_kv_blocks = sim_spec.num_kv_blocks or _room_for_everything(scenario)
        return EngineSimBackend(backend_id, step_time, sim_spec.spec.max_active, num_kv_blocks + 1,
                                scenario.block_size, reporter, budget, sim_spec.num_host_kv_blocks,
                                DEFAULT_OFFLOAD_MIN_HITS if sim_spec.kv_host_offload_min_hits is None
                                else sim_spec.kv_host_offload_min_hits, device,
                                default_async_scheduling(device_kind) if async_scheduling is None else async_scheduling)

    return make


def _room_for_everything(scenario: Scenario) -> int:
    """Blocks for every request's prompt and output at once: a backend without a cache size (a
    replayed log) never evicts. Sized to the scenario, since the block pool is built up front."""
    block_size = scenario.block_size
    return sum(-(-(r.num_prompt_tokens + r.max_tokens) // block_size) for r in scenario.requests)
