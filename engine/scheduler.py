"""Continuous batching: which requests run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and at most `max_active` running
requests. Decodes go first, so a long prompt never stalls requests already streaming; then
running requests continue their chunked prefill; then waiting requests are admitted with whatever
budget is left. When the pool runs out of blocks the newest running request is preempted by
recompute: its blocks are freed and it rejoins the front of the waiting queue (its full blocks
usually stay cached, so recompute is mostly a prefix hit).

Admission order. Preempted requests go first (they were running), then waiting requests in
(priority, arrival) order, vLLM's `priority` (SamplingParams.priority: lower is more urgent,
classes compared by value), so an urgent request goes ahead of waiting batch work. With one
class this is FCFS. Batch work is never starved: a request that has waited longer than
`max_priority_wait_s` takes turns with the more urgent waiting requests, one admission each
(aged requests by arrival; the turn carries over from one step to the next). So under a
stream of urgent work aged batch work gets at least every other admission, and under sustained
overload, when the whole batch backlog has aged, an urgent request waits behind as many aged
requests as urgent ones, never behind the whole backlog (giving aged work full urgency instead
would make the order FCFS exactly when priorities matter most). Priority never preempts a
running request: an urgent request waits for a free slot like any other, which keeps running requests' latency independent of later arrivals and
spares the recompute. The head of that order is not overtaken when its blocks do not fit. The
clock is injectable so the starvation bound is tested without sleeping.
No torch here: the scheduler is tested on exact block ids in milliseconds.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ACTIVE
from tandem.engine.kv_cache.host_tier import KVTransfers
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_active: int = DEFAULT_MAX_ACTIVE
    max_num_batched_tokens: int = 512
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 1024
    max_priority_wait_s: float = 5.0  # a request waiting longer is admitted as if most urgent


@dataclass
class ScheduledRequest:
    request: Request
    num_scheduled_tokens: int
    # After this step every known token is computed, so the step samples a new token. Worked
    # out once, when the request is scheduled: the engine and the runner ask several times.
    completes_prefill: bool = field(init=False)

    def __post_init__(self) -> None:
        request = self.request
        self.completes_prefill = request.num_computed_tokens + self.num_scheduled_tokens == request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Copies between the KV cache's device and host tiers, run before this step's forward
    # (engine/kv_cache/host_tier.py); None without a host tier or when there are none.
    kv_transfers: KVTransfers | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.num_scheduled_tokens == 1
                   and s.request.num_computed_tokens >= s.request.num_prompt_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock  # the clock of Request.arrival_time
        self.kv_cache_manager = kv_cache_manager or KVCacheManager(config.num_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        # waiting requests per priority class: one class is plain FCFS, told in O(1) (a long
        # queue past saturation would otherwise be scanned on every step)
        self._waiting_classes: Counter[int] = Counter()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._aged_turn = True  # whose turn is next when aged and more urgent requests take turns

    # -- admission -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self._queue(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes, prefills = [], []
        for request in self.running:
            num_left = request.num_tokens - request.num_computed_tokens
            if num_left == 1:
                decodes.append(request)
            elif num_left > 1:
                prefills.append(request)
        budget = self._schedule_running(decodes + prefills, budget, out)
        if not out.preempted_req_ids:
            self._schedule_waiting(budget, out)
        out.kv_transfers = self.kv_cache_manager.take_transfers()
        return out

    def _schedule_running(self, candidates: list[Request], budget: int, out: SchedulerOutput) -> int:
        for request in candidates:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        return budget

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order they are admitted (see the module doc)."""
        return self._admission_plan()[0]

    def _admission_plan(self) -> tuple[list[Request], dict[str, bool]]:
        """The admission order, and for the requests placed by taking turns whether each is
        the aged one (admitting one passes the turn to the other side)."""
        waiting = list(self.waiting)
        if len(self._waiting_classes) <= 1:
            return waiting, {}  # one class: FCFS, preempted requests already at the front
        now, bound = self.clock(), self.config.max_priority_wait_s
        preempted = [r for r in waiting if r.status is RequestStatus.PREEMPTED]
        queued = [r for r in waiting if r.status is not RequestStatus.PREEMPTED]
        aged = [r for r in queued if now - r.arrival_time > bound]
        fresh = sorted((r for r in queued if now - r.arrival_time <= bound), key=lambda r: r.priority)
        order, turns = _take_turns(aged, fresh, self._aged_turn)
        return preempted + order, turns

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        if not self.waiting:
            return
        order, turns = self._admission_plan()
        for request in order:
            if budget <= 0 or len(self.running) >= self.config.max_active:
                break
            computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, computed) is None:
                break  # nobody overtakes the head of the admission order
            self._unqueue(request)
            if request.req_id in turns:
                self._aged_turn = not turns[request.req_id]
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed.num_tokens
                request.num_host_cached_tokens = computed.num_host_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.num_computed_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(request, front=True)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        out.preempted_req_ids.append(request.req_id)

    # -- after the launch ------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[tuple[Request, int]]:
        """Advance every scheduled request as if its step had run, before its sampled tokens are
        known: computed tokens move on, each sampling request gets a placeholder token, and a
        request that reaches max_tokens finishes now (its blocks go back; the device writes
        into them before any later step reuses them, as steps run in launch order). Returns
        (request, output index) for each placeholder, in the order the step samples them."""
        pending = []
        for scheduled in out.scheduled:
            request = scheduled.request
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            if not scheduled.completes_prefill:
                continue  # a prefill chunk that did not reach the end of the prompt
            pending.append((request, request.append_placeholder()))
            if request.num_output_tokens >= request.max_tokens:
                self.finish_request(request.req_id, RequestStatus.FINISHED_LENGTH)
        return pending

    # -- after the forward -----------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a
        token-level stop. Returns the requests that got a new token this step."""
        progressed = []
        now = time.time()
        for scheduled in out.scheduled:
            request = scheduled.request
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            token_id = sampled_token_ids.get(request.req_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            progressed.append(request)
            stop_status = request.check_stop()
            if stop_status is not None:
                self.finish_request(request.req_id, stop_status)
        return progressed

    def _queue(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        self._waiting_classes[request.priority] += 1

    def _unqueue(self, request: Request) -> None:
        self.waiting.remove(request)
        classes = self._waiting_classes
        classes[request.priority] -= 1
        if not classes[request.priority]:
            del classes[request.priority]

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a waiting or running request and free its blocks."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self._unqueue(request)
        self.kv_cache_manager.free(request)
        request.status = status
        request.finished_time = time.time()
        return request


def _take_turns(aged: list[Request], fresh: list[Request],
                aged_turn: bool) -> tuple[list[Request], dict[str, bool]]:
    """Aged requests (in arrival order) and fresh ones (in (priority, arrival) order) take turns,
    starting with an aged one if `aged_turn`, where the fresh one is of a more urgent class than
    the aged one; an aged request of the fresh one's class or a more urgent one simply goes
    first. Then the rest of the aged, then the rest of the fresh. Also returns, for the requests
    placed by turns, whether each is aged."""
    order: list[Request] = []
    turns: dict[str, bool] = {}
    a = f = 0
    while a < len(aged) and f < len(fresh):
        if fresh[f].priority >= aged[a].priority:
            order.append(aged[a])
            a += 1
            continue
        request = aged[a] if aged_turn else fresh[f]
        a, f = (a + 1, f) if aged_turn else (a, f + 1)
        order.append(request)
        turns[request.req_id] = aged_turn
        aged_turn = not aged_turn
    return order + aged[a:] + fresh[f:], turns
