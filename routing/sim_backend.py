"""One simulated backend: a continuous-batching scheduler advanced event by event.

The model, chosen to be simple, deterministic and close to nano-vllm's scheduler:
- Up to `max_active` requests run; the rest wait in a FIFO queue. Admission happens at step
  boundaries (a request arriving exactly at a boundary is admitted there), or at once when the
  backend is idle.
- Prefill first, no chunking: if any admitted request has not been prefilled, the next step
  prefills all of them together, taking `sum(uncached prompt tokens) / prefill_tok_s`
  seconds, while decode waits. Every step is timed by routing/step_time.py's model, the one
  the `sim` device's engines use. The prefill step produces each request's first token (TTFT).
- Otherwise the step decodes every running request by one token and takes
  `batch_size / decode_rate(batch_size)` seconds: `decode_tok_s` (or
  `decode_tok_s_by_batch[batch_size]`) is the aggregate rate the batch shares. Without a
  batch table, batching gives no throughput gain, the same assumption as the cost model.
- A request finishes at the boundary where it reaches its actual `num_output_tokens`.
- With a prefix cache (routing/sim_prefix_cache.py), a request's uncached prompt is decided
  when it is admitted, from what the cache holds then, and the blocks its prefill publishes
  (and any it evicts) are reported to the router at the end of that step, as a live backend's
  batched report does.

For speed the backend does not visit every decode step: while the batch stays the same it
plans a *run* of k identical steps and jumps to the run's end, where k is the number of steps
until the first request finishes or until a queued request could be admitted. Boundary times
are always `run_start + k * step_s`, computed by the same expression whether the simulator
stops inside a run (to let the router look at the backend) or not, so the router-driven
simulation and the oracle's fixed-assignment replay produce bit-identical times.

A backend that shares its device with others (routing/sim_device.py) hands each step's
profiled duration to the `SimDevice`, which sets when the step ends, and plans decode runs of
one step; the device, not the backend, decides the order in which members' boundaries are
processed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tandem.routing import messages
from tandem.routing.messages import ProgressEvent
from tandem.routing.rates import RateProfile
from tandem.routing.sim_device import SimDevice
from tandem.routing.sim_prefix_cache import SimPrefixCache
from tandem.routing.step_time import StepTimeModel


@dataclass
class SimJob:
    index: int  # position in the scenario's request list
    req_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_prefill_tokens: int  # uncached prompt tokens on this backend (set at admission with a cache)
    num_output_tokens_target: int
    block_hashes: tuple[int, ...] = ()
    num_output_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def num_tokens_left(self) -> int:
        return self.num_output_tokens_target - self.num_output_tokens


class Reporter(Protocol):
    """Where a backend sends its progress (the router, in the simulator)."""

    def on_events(self, backend_id: str, events: list[ProgressEvent]) -> None: ...

    def on_step(self, backend_id: str, num_prefill_tokens: int, num_decode_tokens: int,
                batch_size: int, elapsed_s: float) -> None: ...

    def on_cache_changes(self, backend_id: str, changes: dict[int, int]) -> None:
        """Block hashes by where they are now held: True/False (published/evicted) from a cache
        without a host tier, else the tier states 1 (device), 2 (host tier only), 0 (nowhere)."""


def first_step_at_or_after(run_start_s: float, step_s: float, t: float) -> int:
    """Smallest k >= 1 with `run_start_s + k * step_s >= t`, exact for that expression."""
    k = max(1, math.ceil((t - run_start_s) / step_s))
    while k > 1 and run_start_s + (k - 1) * step_s >= t:
        k -= 1
    while run_start_s + k * step_s < t:
        k += 1
    return k


class SimBackend:
    def __init__(self, backend_id: str, rates: RateProfile, max_active: int,
                 reporter: Reporter | None = None, cache: SimPrefixCache | None = None,
                 device: SimDevice | None = None, step_time: StepTimeModel | None = None) -> None:
        self.backend_id = backend_id
        self.rates = rates
        self.step_time = step_time or StepTimeModel(rates)  # the sim device's timing (routing/step_time.py)
        self.max_active = max_active
        self.reporter = reporter
        self.cache = cache
        self.device = device  # None: the device is this backend's alone
        if device is not None:
            device.add(self)
        self.queue: deque[SimJob] = deque()
        self.active: list[SimJob] = []
        self.finished: list[SimJob] = []
        self.now = -math.inf  # time of the last processed boundary
        self.step: str | None = None  # None (idle), "prefill" or "decode"
        self.step_end_s = math.inf
        self.run_start_s = 0.0
        self.run_step_s = 0.0
        self.run_num_steps = 0
        self.run_num_steps_to_finish = 0

    def next_boundary(self) -> float:
        if self.step is not None:
            return self.step_end_s
        if self.queue:
            return max(self.now, self.queue[0].arrival_s)
        return math.inf

    def enqueue(self, job: SimJob) -> None:
        """Add a job (its arrival may lie in the future: the oracle enqueues all up front)."""
        self.queue.append(job)
        if self.step == "decode" and len(self.active) < self.max_active and self.device is None:
            self._plan_run_end()

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
        """Token counts as of `t`, inside a decode run (between the boundaries we skip)."""
        if self.step != "decode" or self.device is not None:
            return []  # a shared device's runs are single steps: nothing done inside one
        num_steps_done = first_step_at_or_after(self.run_start_s, self.run_step_s, t) - 1
        return [
            ProgressEvent(job.req_id, messages.GENERATED, job.num_output_tokens + num_steps_done)
            for job in self.active
        ]

    # --- one boundary ---------------------------------------------------------------------

    def process_boundary(self) -> None:
        """The next boundary: end the step, admit, start the next (only `advance_to` and the
        device call this, in time order)."""
        t = self.next_boundary()
        events: list[ProgressEvent] = []
        if self.cache is not None and self.reporter is not None:
            changes = self.cache.drain_changes()  # made when the step that ends now began
            if changes:
                self.reporter.on_cache_changes(self.backend_id, changes)
        if self.step == "prefill":
            self._end_prefill(t, events)
        elif self.step == "decode":
            self._end_decode_run(t, events)
        self.now = t
        self._admit(t, events)
        self._start_step(t)
        if self.reporter is not None and events:
            self.reporter.on_events(self.backend_id, events)

    def _end_prefill(self, t: float, events: list[ProgressEvent]) -> None:
        prefilled = [job for job in self.active if job.num_output_tokens == 0]
        for job in prefilled:
            job.num_output_tokens = 1
            job.first_token_s = t
        if self.reporter is not None:
            for job in prefilled:
                events.append(ProgressEvent(job.req_id, messages.PREFILL, job.num_prompt_tokens))
                events.append(ProgressEvent(job.req_id, messages.GENERATED, 1))
            num_tokens = sum(job.num_prefill_tokens for job in prefilled)
            self.reporter.on_step(self.backend_id, num_tokens, 0, len(prefilled), t - self.now)
        self._retire_finished(t, events)

    def _end_decode_run(self, t: float, events: list[ProgressEvent]) -> None:
        for job in self.active:
            job.num_output_tokens += self.run_num_steps
        if self.reporter is not None:
            events.extend(ProgressEvent(j.req_id, messages.GENERATED, j.num_output_tokens) for j in self.active)
            batch_size = len(self.active)
            # Alone: the run's length by the expression its boundary was planned with; on a shared
            # device: the time the step took, its neighbours' share included (what a live engine sees).
            elapsed_s = self.run_num_steps * self.run_step_s if self.device is None else t - self.now
            self.reporter.on_step(self.backend_id, 0, batch_size * self.run_num_steps, batch_size, elapsed_s)
        self._retire_finished(t, events)

    def _retire_finished(self, t: float, events: list[ProgressEvent]) -> None:
        still_running = []
        for job in self.active:
            if job.num_tokens_left > 0:
                still_running.append(job)
                continue
            job.finish_s = t
            self.finished.append(job)
            if self.cache is not None:
                self.cache.release(job.block_hashes)
            if self.reporter is not None:
                events.append(ProgressEvent(job.req_id, messages.FINISHED))
        self.active = still_running

    def _admit(self, t: float, events: list[ProgressEvent]) -> None:
        while len(self.active) < self.max_active and self.queue and self.queue[0].arrival_s <= t:
            job = self.queue.popleft()
            if self.cache is not None:
                num_cached = self.cache.admit(job.block_hashes, job.num_prompt_tokens)
                job.num_prefill_tokens = job.num_prompt_tokens - num_cached
            self.active.append(job)
            if self.reporter is not None:
                events.append(ProgressEvent(job.req_id, messages.ADMITTED))

    def _start_step(self, t: float) -> None:
        num_prefill_tokens = sum(j.num_prefill_tokens for j in self.active if j.num_output_tokens == 0)
        if any(j.num_output_tokens == 0 for j in self.active):
            self.step = "prefill"
            step_s = self.step_time.step_s(num_prefill_tokens, 0)
            if self.device is None:
                self.step_end_s = t + step_s
            else:
                self.device.begin_step(self, step_s)
        elif self.active:
            self.step = "decode"
            self.run_start_s = t
            # A run's steps all take its first step's time: the context it adds is left out.
            num_context_tokens = sum(j.num_prompt_tokens + j.num_output_tokens for j in self.active)
            self.run_step_s = self.step_time.step_s(0, len(self.active), num_context_tokens)
            self.run_num_steps_to_finish = min(job.num_tokens_left for job in self.active)
            if self.device is None:
                self._plan_run_end()
            else:
                self.run_num_steps = 1
                self.device.begin_step(self, self.run_step_s)
        else:
            self.step = None
            self.step_end_s = math.inf

    def _plan_run_end(self) -> None:
        """End the run at the first finish, or at the first boundary where a queued job fits."""
        num_steps = self.run_num_steps_to_finish
        if len(self.active) < self.max_active and self.queue:
            arrival_s = self.queue[0].arrival_s
            num_steps = min(num_steps, first_step_at_or_after(self.run_start_s, self.run_step_s, arrival_s))
        self.run_num_steps = num_steps
        self.step_end_s = self.run_start_s + num_steps * self.run_step_s
