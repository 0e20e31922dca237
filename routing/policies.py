"""Routing policies behind one interface: given every backend's score, pick one backend.

All policies see the same `BackendScore`s (routing/cost_model.py), listed in preference order
(accelerators first, then lower backend_id). Every policy picks the *first* best candidate in
that order, which is how ties go to the accelerator and then to the lower id.

- `cost` (default): lowest score, the spec's router.
- `accelerator-only` / `cpu-only`: lowest score among non-CPU / CPU backends (with a single
  backend of that kind, simply that backend). The spec's "all requests forced to the GPU" arm.
- `round-robin`: the next backend after the previously chosen one, in preference order.
- `least-requests`: fewest active + queued requests, the count-based baseline of other routers.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from routing.decision import BackendScore
from routing.errors import NoBackendError


class Policy(Protocol):
    name: str

    def choose(self, scores: Sequence[BackendScore]) -> str:
        """Return the chosen backend_id; `scores` is non-empty and in preference order."""
        ...


def _lowest_score(scores: Sequence[BackendScore], policy: str) -> str:
    if not scores:
        raise NoBackendError(f"policy {policy!r} has no eligible backend for this request")
    return min(scores, key=lambda s: s.score_s).backend_id


class CostPolicy:
    name = "cost"

    def choose(self, scores: Sequence[BackendScore]) -> str:
        return _lowest_score(scores, self.name)


class AcceleratorOnlyPolicy:
    name = "accelerator-only"

    def choose(self, scores: Sequence[BackendScore]) -> str:
        return _lowest_score([s for s in scores if s.device_kind != "cpu"], self.name)


class CpuOnlyPolicy:
    name = "cpu-only"

    def choose(self, scores: Sequence[BackendScore]) -> str:
        return _lowest_score([s for s in scores if s.device_kind == "cpu"], self.name)


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        # Preference key of the last choice; the next choice is the first backend after it,
        # which stays well defined when backends are added or the last one was removed.
        self.last_key: tuple[bool, str] | None = None

    def choose(self, scores: Sequence[BackendScore]) -> str:
        if not scores:
            raise NoBackendError(f"policy {self.name!r} has no backend")
        keys = [(s.device_kind == "cpu", s.backend_id) for s in scores]
        later = [key for key in keys if self.last_key is not None and key > self.last_key]
        self.last_key = later[0] if later else keys[0]
        return self.last_key[1]


class LeastRequestsPolicy:
    name = "least-requests"

    def choose(self, scores: Sequence[BackendScore]) -> str:
        if not scores:
            raise NoBackendError(f"policy {self.name!r} has no backend")
        return min(scores, key=lambda s: s.num_active + s.num_queued).backend_id


POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (CostPolicy, AcceleratorOnlyPolicy, CpuOnlyPolicy, RoundRobinPolicy, LeastRequestsPolicy)
}


def make_policy(name: str) -> Policy:
    """A fresh policy instance (round-robin keeps state). Unknown names raise ValueError."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
