"""The oracle split: the best makespan over which backend each request goes to.

Given a fixed assignment, the backends are independent (each serves its own requests, on the
backend model the policies were simulated on), so an assignment is scored by replaying each
backend alone on its subset, memoised by that subset. Backends that share a device
(routing/sim_device.py) are not independent: they are replayed together, memoised by what each
of them was given. The objective is the makespan (last finish minus first arrival), ties broken
by the sum of end-to-end latencies.

Search:
- exhaustive over all `num_backends ** num_requests` assignments when that is at most
  `exhaustive_max` (default 2**16: every CPU/GPU subset for up to 16 requests, a few seconds);
- otherwise a local search, which finds a good split but does not prove it optimal (the
  oracle's gain is then a lower bound on the attainable gain). Seeds: every all-on-one-backend
  assignment, the policies' own assignments (so the oracle is never worse than any policy
  simulated), and for each ordered pair of backends (base, spill) and each count k, the
  assignments sending k requests to the spill backend at the first k, the last k, or k evenly
  spaced arrival positions (for identical requests only the count and the positions matter).
  From the best few seeds it hill-climbs, moving one request to another backend or swapping
  two requests between backends, taking the first improving move until none improves.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from tandem.routing.scenario import Scenario
from tandem.routing.sim_backend import SimBackend
from tandem.routing.simulator import BackendFactory, RequestOutcome, collect_outcomes, make_backends, make_job

Assignment = tuple[int, ...]  # backend index per request, scenario order
Share = tuple[tuple[int, int], ...]  # (request index, backend index) pairs of one replay unit


@dataclass
class OracleResult:
    makespan_s: float
    assignment: list[str]  # backend_id per request, scenario order
    outcomes: list[RequestOutcome]
    method: str
    num_evaluated: int  # distinct per-backend replays


class AssignmentEvaluator:
    def __init__(self, scenario: Scenario, backend_factory: BackendFactory | None = None) -> None:
        """`backend_factory`: the backend model replayed (routing/simulator.py's; None: its own)."""
        self.scenario = scenario
        self.backend_factory = backend_factory
        self.backend_ids = [b.spec.backend_id for b in scenario.backends]
        self.first_arrival_s = min(r.arrival_s for r in scenario.requests)
        self.units = replay_units(scenario)
        self._unit_of = {b: u for u, unit in enumerate(self.units) for b in unit}
        self._memo: dict[tuple[int, Share], tuple[float, float]] = {}

    @property
    def num_evaluated(self) -> int:
        return len(self._memo)

    def objective(self, assignment: Assignment) -> tuple[float, float]:
        """(makespan_s, sum of e2e seconds) of a fixed assignment."""
        last_finish_s, total_e2e_s = -float("inf"), 0.0
        for u, share in enumerate(self._shares(assignment)):
            if share:
                finish_s, e2e_s = self._unit_result(u, share)
                last_finish_s, total_e2e_s = max(last_finish_s, finish_s), total_e2e_s + e2e_s
        return last_finish_s - self.first_arrival_s, total_e2e_s

    def outcomes(self, assignment: Assignment) -> list[RequestOutcome]:
        backends = [b for u, share in enumerate(self._shares(assignment)) for b in self._replay(u, share)]
        return collect_outcomes(self.scenario, backends)

    def _shares(self, assignment: Assignment) -> list[Share]:
        shares: list[list[tuple[int, int]]] = [[] for _ in self.units]
        for i, b in enumerate(assignment):
            shares[self._unit_of[b]].append((i, b))
        return [tuple(share) for share in shares]

    def _unit_result(self, u: int, share: Share) -> tuple[float, float]:
        key = (u, share)
        if key not in self._memo:
            finished = [job for backend in self._replay(u, share) for job in backend.finished]
            self._memo[key] = (
                max(job.finish_s for job in finished),
                sum(job.finish_s - job.arrival_s for job in finished),
            )
        return self._memo[key]

    def _replay(self, u: int, share: Share) -> list[SimBackend]:
        sim_specs = [self.scenario.backends[b] for b in self.units[u]]
        backends = make_backends(self.scenario, sim_specs=sim_specs, backend_factory=self.backend_factory)
        for i, b in share:
            backend_id = self.backend_ids[b]
            backends[backend_id].enqueue(make_job(i, self.scenario.requests[i], backend_id))
        for backend in backends.values():
            backend.run_to_completion()
        return list(backends.values())


def replay_units(scenario: Scenario) -> list[tuple[int, ...]]:
    """Backend indices replayed together: each shared device's backends, every other alone."""
    index_of = {b.spec.backend_id: i for i, b in enumerate(scenario.backends)}
    shared = scenario.shared_devices
    units = [tuple(index_of[backend_id] for backend_id in ids) for ids in shared.values()]
    on_shared = {b for unit in units for b in unit}
    return sorted(units + [(b,) for b in range(len(scenario.backends)) if b not in on_shared])


def find_oracle(
    scenario: Scenario,
    seeds: Sequence[Sequence[str]] = (),
    exhaustive_max: int = 2**16,
    num_starts: int = 3,
    backend_factory: BackendFactory | None = None,
) -> OracleResult:
    """Best assignment found; `seeds` are backend_id lists (e.g. the policies' assignments);
    `backend_factory`: the backend model, the one the policies were simulated on."""
    evaluator = AssignmentEvaluator(scenario, backend_factory)
    num_backends, num_requests = len(evaluator.backend_ids), len(scenario.requests)
    index_of = {backend_id: b for b, backend_id in enumerate(evaluator.backend_ids)}
    seed_assignments = [tuple(index_of[x] for x in seed) for seed in seeds]
    if num_backends**num_requests <= exhaustive_max:
        candidates: Iterable[Assignment] = itertools.product(range(num_backends), repeat=num_requests)
        best = min(candidates, key=evaluator.objective)
        method = f"exhaustive over {num_backends ** num_requests} assignments"
    else:
        best = _local_search(evaluator, seed_assignments, num_backends, num_requests, num_starts)
        method = f"local search from the best {num_starts} of the seeds (not proven optimal)"
    return OracleResult(
        makespan_s=evaluator.objective(best)[0],
        assignment=[evaluator.backend_ids[b] for b in best],
        outcomes=evaluator.outcomes(best),
        method=method,
        num_evaluated=evaluator.num_evaluated,
    )


def _local_search(evaluator: AssignmentEvaluator, seeds: list[Assignment], num_backends: int,
                  num_requests: int, num_starts: int) -> Assignment:
    candidates = {*seeds, *_structured_seeds(num_backends, num_requests)}
    starts = sorted(candidates, key=lambda a: (evaluator.objective(a), a))[:num_starts]
    results = [_hill_climb(evaluator, start, num_backends) for start in starts]
    return min(results, key=lambda a: (evaluator.objective(a), a))


def _structured_seeds(num_backends: int, num_requests: int) -> Iterator[Assignment]:
    for base in range(num_backends):
        yield (base,) * num_requests
        for spill in range(num_backends):
            if spill == base:
                continue
            for k in range(1, num_requests):
                even = {round((j + 0.5) * num_requests / k - 0.5) for j in range(k)}
                for positions in (range(k), range(num_requests - k, num_requests), even):
                    chosen = set(positions)
                    yield tuple(spill if i in chosen else base for i in range(num_requests))


def _hill_climb(evaluator: AssignmentEvaluator, start: Assignment, num_backends: int) -> Assignment:
    current, current_obj = start, evaluator.objective(start)
    improved = True
    while improved:
        improved = False
        for neighbour in _neighbours(current, num_backends):
            obj = evaluator.objective(neighbour)
            if obj < current_obj:
                current, current_obj, improved = neighbour, obj, True
                break
    return current


def _neighbours(assignment: Assignment, num_backends: int) -> Iterator[Assignment]:
    """Single moves first (cheap, most useful), then swaps between different backends."""
    for i, b in enumerate(assignment):
        for other in range(num_backends):
            if other != b:
                yield assignment[:i] + (other,) + assignment[i + 1:]
    for i, j in itertools.combinations(range(len(assignment)), 2):
        if assignment[i] != assignment[j]:
            moved = list(assignment)
            moved[i], moved[j] = assignment[j], assignment[i]
            yield tuple(moved)
