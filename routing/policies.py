"""Routing policies behind one interface: given every backend's score, pick one backend.

All policies see the same `BackendScore`s (routing/cost_model.py), listed in preference order
(accelerators first, then lower backend_id). Every policy picks the *first* best candidate in
that order, which is how ties go to the accelerator and then to the lower id.

- `cost` (default): lowest rank (the score plus the recompute term, below, or where a copy of
  the prefix is an investment the replication term, routing/replication.py, plus the queue
  term, routing/cost_model.py), the design's router, optionally behind a spill guard (below).
- `accelerator-only` / `cpu-only`: lowest rank among non-CPU / CPU backends (with a single
  backend of that kind, simply that backend). The design's "all requests forced to the GPU" arm.
- `round-robin`: the next backend after the previously chosen one, in preference order.
- `random`: a uniformly random routable backend, CPU included (seeded, default 0, so
  route-sim runs repeat); llm-d's baseline, a floor no load- or cache-aware policy should lose to.
- `least-requests`: fewest active + queued requests, the count-based baseline of other routers.
- `prefix-affinity`: a home backend per prompt prefix by rendezvous hashing, spilling to the
  least-loaded backend when the home is over a bound (below). The scheme of SGLang's
  cache-aware router, Ray Serve LLM's prefix-aware router and consistent hashing with bounded
  loads; a strong baseline for multi-tenant traffic with shared prefixes.

Policies get the request too (`choose(scores, request)`); only `prefix-affinity` reads it.

The recompute term. The score is the new request's completion time on a backend; it does not
see that recomputing a prefix another backend already holds is work the system did not need:
device time that the requests running there stall for (prefill goes first) and that every
later request on that backend queues behind. Greedy on the score alone, `cost` would give up a
hit whenever the holder's queue is a little longer, and under saturating multi-tenant load those
avoidable prefills are what saturate the backends. The router therefore adds, for each backend,
`recompute_weight x (largest reusable prefix among the routable backends - this backend's) /
its prefill rate` (`BackendScore.recompute_term_s`, computed by the Router, which knows which
backends are routable). The weight is 2 by default, chosen on the route-sim tenants grid; 0
restores the design's plain score (what each term is worth: docs/routing.md, "Multi-tenant
prefixes"). Where every backend reports the same prefix, as in the design's worked example, the
term is zero.

`prefix-affinity` in detail. The prefix key is the chained hash of the prompt's first
`num_prefix_blocks` full blocks (fewer when the prompt is shorter): chained, so it stands for
the whole leading span, and short, so every request of a tenant whose shared prefix covers
those blocks gets the same key whatever its suffix. The home is the backend with the highest
rendezvous weight `blake2b(key, backend_id)` (hashlib, so it is the same in every process):
adding or removing a backend moves only the keys whose home it was. Load is the number of
active + queued requests, as in the routers it imitates; rates are ignored, which is exactly
what makes it a count-based baseline. The bound is that of consistent hashing with bounded
loads: the home takes the request if its load after taking it stays within
`ceil(load_factor x (total load + 1) / number of candidates)`; otherwise the request spills to
the least-loaded candidate. Candidates are the accelerators when there are any (a CPU home
would be a slow home for a share of all tenants), otherwise every backend. A prompt with no
full block has no key and goes to the least-loaded candidate.

The spill guard is what makes `cost` "never worse than accelerator-only" in practice, not
only on paper. The score ranks work with rates measured in isolation; a CPU next to a busy
accelerator shares the host's cores with the accelerator's step loop and the HTTP path and runs
slower than its profile (docs/routing.md, "The spill guard", has the measurements), so a CPU
that wins by a few percent on paper loses.
With an accelerator present, a CPU backend therefore wins only if (1) its rank beats the best
accelerator's by `margin` (a fraction of the accelerator's rank) and (2), unless
`allow_queue`, it has a free slot: a request queued behind a slow backend's running ones
waits for whole slow decodes, which is where p95 TTFT blows up. Without an accelerator (CPU
backends only) the guard does nothing, and with `SpillGuard()` it is the design's plain rule.
"""

from __future__ import annotations

import hashlib
import math
import operator
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from tandem.routing.decision import BackendScore
from tandem.routing.errors import NoBackendError
from tandem.routing.messages import RouteRequest


class Policy(Protocol):
    name: str

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        """Return the chosen backend_id; `scores` is in preference order."""
        ...


_rank = operator.attrgetter("rank_s")


def _lowest_score(scores: Sequence[BackendScore], policy: str) -> str:
    if not scores:
        raise NoBackendError(f"policy {policy!r} has no eligible backend for this request")
    return min(scores, key=_rank).backend_id


def _least_loaded(scores: Sequence[BackendScore]) -> BackendScore:
    return min(scores, key=lambda s: s.num_active + s.num_queued)


@dataclass(frozen=True)
class SpillGuard:
    """When a CPU backend may take a request while an accelerator could (see module doc)."""

    margin: float = 0.0  # the CPU's rank must be below (1 - margin) x the best accelerator's
    allow_queue: bool = True  # False: only a CPU with a free slot (active + queued < max_active)

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"spill margin must be in [0, 1) (got {self.margin!r})")

    def permits(self, cpu: BackendScore, accelerator: BackendScore) -> bool:
        if not self.allow_queue and cpu.num_active + cpu.num_queued >= cpu.max_active:
            return False
        return cpu.rank_s < (1 - self.margin) * accelerator.rank_s


class CostPolicy:
    name = "cost"

    def __init__(self, guard: SpillGuard | None = None) -> None:
        self.guard = guard or SpillGuard()

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        if not scores:
            return _lowest_score(scores, self.name)  # raises
        best = min(scores, key=_rank)
        if best.device_kind != "cpu":
            return best.backend_id
        accelerators = [s for s in scores if s.device_kind != "cpu"]
        if not accelerators:
            return best.backend_id
        best_accelerator = min(accelerators, key=lambda s: s.rank_s)
        return best.backend_id if self.guard.permits(best, best_accelerator) else best_accelerator.backend_id


class AcceleratorOnlyPolicy:
    name = "accelerator-only"

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        return _lowest_score([s for s in scores if s.device_kind != "cpu"], self.name)


class CpuOnlyPolicy:
    name = "cpu-only"

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        return _lowest_score([s for s in scores if s.device_kind == "cpu"], self.name)


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        # Preference key of the last choice; the next choice is the first backend after it,
        # which stays well defined when backends are added or the last one was removed.
        self.last_key: tuple[bool, str] | None = None

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        if not scores:
            raise NoBackendError(f"policy {self.name!r} has no backend")
        keys = [(s.device_kind == "cpu", s.backend_id) for s in scores]
        later = [key for key in keys if self.last_key is not None and key > self.last_key]
        self.last_key = later[0] if later else keys[0]
        return self.last_key[1]


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        # Every routable backend alike, whatever its device kind (llm-d's random picker).
        if not scores:
            raise NoBackendError(f"policy {self.name!r} has no backend")
        return self.rng.choice(scores).backend_id


class LeastRequestsPolicy:
    name = "least-requests"

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        if not scores:
            raise NoBackendError(f"policy {self.name!r} has no backend")
        return _least_loaded(scores).backend_id


@dataclass(frozen=True)
class PrefixAffinityConfig:
    """`prefix-affinity`'s knobs (see the module doc)."""

    num_prefix_blocks: int = 8  # blocks hashed into the prefix key (128 tokens at block size 16)
    load_factor: float = 1.25  # the home may hold up to this times the mean load (rounded up)

    def __post_init__(self) -> None:
        if self.num_prefix_blocks < 1:
            raise ValueError(f"num_prefix_blocks must be >= 1 (got {self.num_prefix_blocks!r})")
        if self.load_factor < 1:
            raise ValueError(f"load_factor must be >= 1 (got {self.load_factor!r})")


def prefix_key(request: RouteRequest | None, num_prefix_blocks: int) -> int | None:
    """The chained hash of the prompt's first `num_prefix_blocks` full blocks (or of all of
    them when it has fewer); None without any full block."""
    if request is None or not request.block_hashes:
        return None
    return request.block_hashes[min(num_prefix_blocks, len(request.block_hashes)) - 1]


def rendezvous_weight(key: int, backend_id: str) -> int:
    """Highest-random-weight hashing: the same in every process (no PYTHONHASHSEED)."""
    digest = hashlib.blake2b(f"{key}/{backend_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinityPolicy:
    name = "prefix-affinity"

    def __init__(self, config: PrefixAffinityConfig | None = None) -> None:
        self.config = config or PrefixAffinityConfig()

    def choose(self, scores: Sequence[BackendScore], request: RouteRequest | None = None) -> str:
        candidates = [s for s in scores if s.device_kind != "cpu"] or list(scores)
        if not candidates:
            raise NoBackendError(f"policy {self.name!r} has no backend")
        key = prefix_key(request, self.config.num_prefix_blocks)
        if key is None:
            return _least_loaded(candidates).backend_id
        home = max(candidates, key=lambda s: rendezvous_weight(key, s.backend_id))
        total_load = sum(s.num_active + s.num_queued for s in candidates)
        bound = math.ceil(self.config.load_factor * (total_load + 1) / len(candidates))
        if home.num_active + home.num_queued + 1 <= bound:
            return home.backend_id
        return _least_loaded(candidates).backend_id


POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (CostPolicy, AcceleratorOnlyPolicy, CpuOnlyPolicy, RoundRobinPolicy, RandomPolicy,
                LeastRequestsPolicy, PrefixAffinityPolicy)
}


def make_policy(name: str, guard: SpillGuard | None = None,
                prefix_affinity: PrefixAffinityConfig | None = None) -> Policy:
    """A fresh policy instance (round-robin and random keep state). Unknown names raise ValueError.
    `guard` applies to `cost` only and `prefix_affinity` to `prefix-affinity` only."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == CostPolicy.name:
        return CostPolicy(guard)
    if name == PrefixAffinityPolicy.name:
        return PrefixAffinityPolicy(prefix_affinity)
    return POLICIES[name]()
