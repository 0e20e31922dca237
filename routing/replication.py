"""Copying a hot prefix to a backend with room: when a cache miss is an investment.

The recompute term (routing/policies.py) charges a backend for recomputing a prefix another
backend already holds. Under cache pressure that is right: the copy evicts another prefix, and
its prefill is device time nobody needed. Where every prefix fits, it keeps a hot prefix on one
backend for good, and the score alone does the same: request by request, the backend holding a
tenant's prefix finishes the next request sooner than one that must prefill it first, so the
other backends never learn that tenant, and its requests crowd one backend while another idles
(docs/routing.md, "The replication term", shows it in route-sim). A copy on a second backend is an
investment: one prefill now, after which every later request of that prefix can go to whichever
holder is less loaded.

So for a backend that lacks part of the largest reusable prefix among the routable backends
(`missing_s`: the missing tokens over its prefill rate), the router replaces the recompute term
by the replication term when the backend is of the same device kind as a backend holding that
prefix (a CPU copy of a GPU's prefix is a long prefill for a backend that only takes overflow),
is not under cache pressure and has a free slot:

    replication_term_s = missing_s x (1 + n_b) / (future_factor x n_seen) - missing_s

- `missing_s x (1 + n_b)` is what the copy costs: the new request waits for it and so do the n_b
  requests already on the backend (active and queued; prefill goes first).
- `future_factor x n_seen` is how many requests that cost is spread over: the prefix was seen
  `n_seen` times before (keyed as prefix-affinity keys it) and is expected about
  `future_factor` times as often again. A prefix seen once is not worth a copy on a busy
  backend; a hot one is, as soon as its holder is busier than the copy would cost.
- `- missing_s` takes out the miss's own prefill, which the score counts and the copy's cost
  already includes: the rank is the score as if the backend held the prefix, plus the amortised
  copy.

A copy that slows its own request waits. TTFT p95 over a run of a few hundred requests is
about its 10th to 20th slowest request, and the cold start's misses fill most of those places.
A copy whose prefill outlasts the request's wait on the best holder (that holder's prefill ahead
of it; a holder without a free slot waits unboundedly) puts one more slow request in the tail,
with those queued behind it. The copies repay that in E2E and in the tail's spread only over
hundreds of later requests, and a router cannot tell a short run from the start of a long one
(the first 200 requests of a 600-request run are a 200-request run). So such a copy is made only when
`copy_interval` decisions (200) have passed since the last copy of any prefix; a copy that costs
its request no more than the holder would (the holder is still prefilling the prefix, or
others) is always allowed. The decisions behind this rule, and what it costs on long runs, are
in docs/routing.md, "Short runs: the copy interval".

Cache pressure. The router does not know a backend's cache size, but it sees a backend lose a
prefix: per prefix key it remembers what the last request with that key could reuse on each
backend (reported or in flight), and when the next one, sharing at least that span, finds less
there, the backend has evicted a prefix still in use. For the next `pressure_window` decisions
that backend keeps the recompute term: a copy there would evict another prefix. A backend with
no free slot (active + queued >= max_active) keeps it too: a copy there would hold up a queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicationConfig:
    """When `cost` counts a miss as an investment (see the module doc)."""

    future_factor: float = 2.0  # a prefix seen n times is expected about this x n times more
    pressure_window: int = 256  # decisions a backend stays under pressure after losing a prefix
    copy_interval: int = 200  # decisions after any copy before one that delays its own request (0: no limit)
    num_prefix_blocks: int = 8  # blocks hashed into the prefix key (as prefix-affinity's)
    max_prefixes: int = 4096  # prefix keys remembered, least recently seen dropped first

    def __post_init__(self) -> None:
        if self.future_factor <= 0:
            raise ValueError(f"future_factor must be > 0 (got {self.future_factor!r})")
        if self.pressure_window < 0:
            raise ValueError(f"pressure_window must be >= 0 (got {self.pressure_window!r})")
        if self.copy_interval < 0:
            raise ValueError(f"copy_interval must be >= 0 (got {self.copy_interval!r})")
        if self.num_prefix_blocks < 1:
            raise ValueError(f"num_prefix_blocks must be >= 1 (got {self.num_prefix_blocks!r})")
        if self.max_prefixes < 1:
            raise ValueError(f"max_prefixes must be >= 1 (got {self.max_prefixes!r})")


def num_shared_tokens(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """Tokens of the longest common run of leading blocks. Chained hashes agree at block i only
    if they agree at every block before it, so a binary search finds the run."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size


@dataclass
class _PrefixEntry:
    num_seen: int = 0
    block_hashes: Sequence[int] = ()  # the last request's, to tell how much the next one shares
    block_size: int = 0
    reusable: dict[str, int] = field(default_factory=dict)  # backend -> tokens that request could reuse (> 0)


class PrefixStats:
    """How often each prefix was seen, and which backends were lately seen losing one."""

    def __init__(self, config: ReplicationConfig) -> None:
        self.config = config
        self.entries: OrderedDict[int, _PrefixEntry] = OrderedDict()
        self.num_decisions = 0
        self.pressure_at: dict[str, int] = {}  # backend -> decision count when it lost a prefix
        self.last_copy_at: int | None = None  # decision count at the last copy

    def num_seen(self, key: int) -> int:
        entry = self.entries.get(key)
        return 0 if entry is None else entry.num_seen

    def under_pressure(self, backend_id: str) -> bool:
        at = self.pressure_at.get(backend_id)
        return at is not None and self.num_decisions - at < self.config.pressure_window

    def may_copy_slowly(self) -> bool:
        """Whether `copy_interval` decisions have passed since the last copy."""
        return self.last_copy_at is None or self.num_decisions - self.last_copy_at >= self.config.copy_interval

    def note_copy(self) -> None:
        """The decision just observed sent a request to a backend lacking part of its prefix."""
        self.last_copy_at = self.num_decisions

    def observe(self, key: int, block_hashes: Sequence[int], block_size: int,
                reusable: Mapping[str, int]) -> None:
        """Record a routed request with prefix `key` and what it could reuse on each backend."""
        self.num_decisions += 1
        entry = self.entries.pop(key, None) or _PrefixEntry()
        self.entries[key] = entry
        if len(self.entries) > self.config.max_prefixes:
            self.entries.popitem(last=False)
        shared = 0
        if entry.block_size == block_size:
            shared = num_shared_tokens(entry.block_hashes, block_hashes, block_size)
        if shared:
            # A backend lost part of the prefix if it can reuse less of it than before, where
            # the two requests share it; one that could reuse none before lost nothing, so only
            # the previous request's nonzero answers are kept and looked at.
            for backend_id, num_before in entry.reusable.items():
                num_tokens = reusable.get(backend_id)
                if num_tokens is not None and num_tokens < min(num_before, shared):
                    self.pressure_at[backend_id] = self.num_decisions
        entry.num_seen += 1
        entry.block_hashes, entry.block_size = block_hashes, block_size
        entry.reusable = {backend_id: n for backend_id, n in reusable.items() if n}
