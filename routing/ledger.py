"""The per-backend ledger: routed, unfinished requests and running sums of their pending work.

One `Ledger` per backend. Each `LedgerEntry` remembers what the cost model needs:
- the uncached prefill tokens estimated when the request was routed (prompt minus the prefix
  that backend reported). The estimate is frozen while the request is queued, since the
  prefix it counted on stays cached there; dropping the discount would charge every queued
  request its whole prompt. Only an "evicted" report
  replaces it, with the prompt minus the prefix still reusable (the report's value; 0, the
  default, means the full prompt), because then the prefix really is gone.
- once the backend reports prefill progress, the remaining prefill is
  `num_prompt_tokens - num_computed_prompt_tokens` (vLLM's `num_computed_tokens` counts
  prefix-cache hits as computed, so the first report after admission also corrects a stale
  estimate); once a token has been generated, the prompt is done.
- the remaining decode budget, `max_tokens - num_output_tokens`.

The ledger keeps the sums of both over all its entries, updated on every change, so scoring
a backend is O(1) however long its queue is. It also keeps the sums of its queued entries per
priority class (`priority`, vLLM's: lower is more urgent), so the work ahead of a new request
at its class, `work_ahead(priority)`, costs O(number of classes): every active request is
ahead of it (the engine never preempts for priority), and so is every queued one of its class
or a more urgent one. Reports carry absolute counts and the ledger
keeps the maximum seen, so late, duplicated or reordered reports are harmless.

A backend's scheduler bounds how long less urgent work waits: a queued request older than its
`max_priority_wait_s` takes turns with the more urgent ones. Each entry keeps when it was
routed (`arrival_s`, the router's clock), so `aged_work` can say which less urgent queued
requests will have aged past that bound by a given time, and so run before a new request.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.routing import messages

QUEUED = "queued"
ACTIVE = "active"


@dataclass
class LedgerEntry:
    req_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_prefill_tokens_est: int  # frozen at routing time; replaced only by an eviction report
    status: str = QUEUED
    priority: int = 0  # vLLM's: lower is more urgent; classes are compared by value
    num_computed_prompt_tokens: int | None = None  # None until the backend reports prefill
    num_output_tokens: int = 0
    arrival_s: float | None = None  # when it was routed (the router's clock); None: never ages

    def num_prefill_tokens_left(self) -> int:
        if self.num_output_tokens > 0:
            return 0
        if self.num_computed_prompt_tokens is None:
            return self.num_prefill_tokens_est
        return max(0, self.num_prompt_tokens - self.num_computed_prompt_tokens)

    def num_decode_tokens_left(self) -> int:
        return max(0, self.max_tokens - self.num_output_tokens)


@dataclass
class WorkAhead:
    """Pending work that runs before a new request: requests, uncached prompt tokens left and
    unused decode budgets (unscaled)."""

    num_requests: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def add(self, entry: LedgerEntry, sign: int) -> None:
        self.num_requests += sign
        self.num_prefill_tokens += sign * entry.num_prefill_tokens_left()
        self.num_decode_tokens += sign * entry.num_decode_tokens_left()

    @classmethod
    def of(cls, entries: list[LedgerEntry]) -> WorkAhead:
        work = cls()
        for entry in entries:
            work.add(entry, +1)
        return work

    def __add__(self, other: WorkAhead) -> WorkAhead:
        return WorkAhead(self.num_requests + other.num_requests, self.num_prefill_tokens + other.num_prefill_tokens,
                         self.num_decode_tokens + other.num_decode_tokens)


class Ledger:
    """Unfinished requests on one backend, in routing order, with running sums."""

    def __init__(self) -> None:
        self.entries: dict[str, LedgerEntry] = {}
        self.num_prefill_tokens = 0  # sum of num_prefill_tokens_left()
        self.num_decode_tokens = 0  # sum of num_decode_tokens_left()
        self.num_active = 0
        self.queued_by_priority: dict[int, WorkAhead] = {}  # queued entries' sums per class
        self.version = 0  # counts changes to the sums, so a reader can tell they are unchanged

    @property
    def num_queued(self) -> int:
        return len(self.entries) - self.num_active

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.entries

    def work_ahead(self, priority: int) -> WorkAhead:
        """The work a new request of class `priority` would wait behind: everything but the
        queued requests of less urgent classes (a larger value)."""
        ahead = WorkAhead(len(self.entries), self.num_prefill_tokens, self.num_decode_tokens)
        for queued_priority, queued in self.queued_by_priority.items():
            if queued_priority > priority:
                ahead.num_requests -= queued.num_requests
                ahead.num_prefill_tokens -= queued.num_prefill_tokens
                ahead.num_decode_tokens -= queued.num_decode_tokens
        return ahead

    def aged_work(self, priority: int, cutoff_s: float, limit: int, skip: frozenset[str] = frozenset()) -> WorkAhead:
        """The oldest `limit` queued requests of less urgent classes than `priority` routed at
        or before `cutoff_s`, leaving out those in `skip` (already counted as taking free slots,
        `filling`): those a starvation bound will have let take turns with a new request by the
        time `cutoff_s` plus the bound has passed. O(queued requests), and nothing at all
        without less urgent ones."""
        aged = WorkAhead()
        if not any(p > priority for p in self.queued_by_priority):
            return aged
        for entry in self.entries.values():  # routing order: oldest first
            if aged.num_requests >= limit:
                break
            if (entry.status == QUEUED and entry.priority > priority and entry.req_id not in skip
                    and entry.arrival_s is not None and entry.arrival_s <= cutoff_s):
                aged.add(entry, +1)
        return aged

    def filling(self, priority: int, limit: int) -> list[LedgerEntry]:
        """The first `limit` queued requests of less urgent classes than `priority` in the
        engine's admission order (class, then routing order): those that take slots the ledger
        sees free before a new request gets there. Each class's walk stops at the `limit`-th
        request (at most the backend's free slots), so it seldom goes past the oldest entries."""
        filling: list[LedgerEntry] = []
        for queued_priority in sorted(p for p in self.queued_by_priority if p > priority):
            for entry in self.entries.values():  # routing order: oldest first
                if len(filling) >= limit:
                    return filling
                if entry.status == QUEUED and entry.priority == queued_priority:
                    filling.append(entry)
        return filling

    def add_queued(self, entry: LedgerEntry) -> None:
        if entry.req_id in self.entries:
            raise ValueError(f"request {entry.req_id!r} is already in this backend's ledger")
        entry.status = QUEUED
        self.entries[entry.req_id] = entry
        self._add(entry, +1)

    def remove(self, req_id: str) -> LedgerEntry | None:
        entry = self.entries.pop(req_id, None)
        if entry is not None:
            self._add(entry, -1)
        return entry

    def apply(self, event: messages.ProgressEvent) -> bool:
        """Apply one report. Returns False (and changes nothing) for an unknown req_id."""
        entry = self.entries.get(event.req_id)
        if entry is None:
            return False
        if event.kind in (messages.FINISHED, messages.ABORTED):
            self.remove(event.req_id)
            return True
        self._add(entry, -1)
        _update_entry(entry, event)
        self._add(entry, +1)
        return True

    def apply_running(self, entry: LedgerEntry, num_computed_prompt_tokens: int, num_output_tokens: int) -> None:
        """Apply an "admitted", a "prefill" and a "generated" report to `entry` (one of this
        ledger's), as `apply` would one after the other; nothing at all when they change nothing
        (the sums, and `version`, stay as they are)."""
        computed = max(entry.num_computed_prompt_tokens or 0, min(num_computed_prompt_tokens, entry.num_prompt_tokens))
        output = max(entry.num_output_tokens, num_output_tokens)
        if entry.status == ACTIVE:
            if computed == entry.num_computed_prompt_tokens and output == entry.num_output_tokens:
                return
            # active before and after: the sums move by the change in what it has left
            prefill_left, decode_left = entry.num_prefill_tokens_left(), entry.num_decode_tokens_left()
            entry.num_computed_prompt_tokens = computed
            entry.num_output_tokens = output
            self.num_prefill_tokens += entry.num_prefill_tokens_left() - prefill_left
            self.num_decode_tokens += entry.num_decode_tokens_left() - decode_left
            self.version += 1
            return
        self._add(entry, -1)
        entry.status = ACTIVE
        entry.num_computed_prompt_tokens = computed
        entry.num_output_tokens = output
        self._add(entry, +1)

    def _add(self, entry: LedgerEntry, sign: int) -> None:
        self.version += 1
        self.num_prefill_tokens += sign * entry.num_prefill_tokens_left()
        self.num_decode_tokens += sign * entry.num_decode_tokens_left()
        self.num_active += sign * (entry.status == ACTIVE)
        if entry.status == QUEUED:
            queued = self.queued_by_priority.setdefault(entry.priority, WorkAhead())
            queued.add(entry, sign)
            if queued.num_requests == 0:
                del self.queued_by_priority[entry.priority]


def _update_entry(entry: LedgerEntry, event: messages.ProgressEvent) -> None:
    """Mutate one entry for a non-terminal report (the ledger re-adds it to the sums)."""
    kind = event.kind
    if kind == messages.EVICTED:
        if entry.status == QUEUED:
            entry.num_prefill_tokens_est = entry.num_prompt_tokens - min(event.value, entry.num_prompt_tokens)
        return
    # Any progress means the scheduler took the request, even if "admitted" arrives later.
    entry.status = ACTIVE
    if kind == messages.PREFILL:
        previous = entry.num_computed_prompt_tokens or 0
        entry.num_computed_prompt_tokens = max(previous, min(event.value, entry.num_prompt_tokens))
    elif kind == messages.GENERATED:
        entry.num_output_tokens = max(entry.num_output_tokens, event.value)
