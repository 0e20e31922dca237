"""The Router facade: per-backend ledgers + cost model + a policy, in one synchronous object.

This is everything the Ray router actor needs and nothing that needs Ray: `route()` scores
every backend from its ledger's running sums, lets the policy choose, and records the request
in the chosen backend's ledger as queued with its uncached-prefill estimate frozen.
`on_progress()` applies a backend's batched, possibly late reports; reports for unknown
requests are ignored. Backends can come and go (`add_backend`, `remove_backend`).

A request that carries its prompt's block hashes is also recorded as in flight on the chosen
backend (routing/inflight.py): until it finishes, later requests with the same prefix are
scored as hitting it there, even before the backend has reported the blocks cached. Its prefix
is also counted (routing/replication.py): on a backend with room, a miss on a hot prefix is an
investment rather than a recompute.

A request may carry a priority class and a TTFT deadline (routing/deadline.py): every score
carries the request's projected time to first token on that backend, and a request with a
deadline goes, by the policy, only to a backend whose projection meets it; if none does,
`route` raises `DeadlineRefusedError` with the best projection and when to retry, and places
nothing. Without a deadline the decision is exactly what it was.

Decisions cost O(number of backends), independent of how many requests are pending
(bench/router_decision.py measures it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from tandem.routing import messages
from tandem.routing.backend_spec import BackendSpec
from tandem.routing.cost_model import (decode_rate_for, pending_seconds, prefill_equivalent, queue_term_s,
                                       score_backend)
from tandem.routing.deadline import projected_ttft_s, split_by_deadline
from tandem.routing.decision import BackendScore, DecisionRecord
from tandem.routing.device_share import device_shares
from tandem.routing.errors import DeadlineRefusedError, NoBackendError
from tandem.routing.inflight import InflightPrefixes, bits, leading_runs
from tandem.routing.ledger import ACTIVE, Ledger, LedgerEntry
from tandem.routing.messages import ProgressEvent, RouteRequest, RunningProgress
from tandem.routing.new_token_ratio import NewTokenRatio, NewTokenRatioConfig
from tandem.routing.policies import PrefixAffinityConfig, SpillGuard, make_policy, prefix_key
from tandem.routing.rates import CalibrationConfig, RateProfile, calibrate
from tandem.routing.replication import PrefixStats, ReplicationConfig


@dataclass
class RemovedRequests:
    """Unfinished requests of a removed backend, in routing order. Queued ones can be re-routed."""

    queued: list[str] = field(default_factory=list)
    active: list[str] = field(default_factory=list)


@dataclass
class PendingSummary:
    """One backend's pending work, for metrics."""

    backend_id: str
    device_kind: str
    num_active: int
    num_queued: int
    num_prefill_tokens: int
    num_decode_tokens: int  # unscaled remaining budgets
    pending_s: float  # estimated seconds to drain, new_token_ratio applied
    new_token_ratio: float


@dataclass
class _BackendState:
    spec: BackendSpec
    rates: RateProfile  # current rates: the design's profile, calibrated if calibration is on
    ledger: Ledger
    alone_prefill_tok_s: float  # prefill rate calibrated from steps that decoded nothing (Router.observe_step)
    ratio: NewTokenRatio
    inflight: InflightPrefixes = field(default_factory=InflightPrefixes)
    cordoned: bool = False  # scored (for the log) but given no new requests
    position: int = 0  # its bit in the router's inflight index
    base_key: tuple | None = None  # what `base` was computed from (see Router._base)
    base: tuple | None = None


class Router:
    def __init__(
        self,
        backends: Sequence[BackendSpec] = (),
        policy: str = "cost",
        new_token_ratio: NewTokenRatioConfig | None = None,
        calibration: CalibrationConfig | None = None,
        spill_guard: SpillGuard | None = None,
        prefix_affinity: PrefixAffinityConfig | None = None,
        recompute_weight: float = 2.0,
        inflight_prefixes: bool = True,
        replication: ReplicationConfig | None = ReplicationConfig(),
        queue_weight: float = 1.0,
        device_shares: bool = False,
    ) -> None:
        if recompute_weight < 0:
            raise ValueError(f"recompute_weight must be >= 0 (got {recompute_weight!r})")
        if queue_weight < 0:
            raise ValueError(f"queue_weight must be >= 0 (got {queue_weight!r})")
        self._recompute_weight = recompute_weight
        self._queue_weight = queue_weight  # routing/cost_model.py: the queue term
        self._device_shares = device_shares  # routing/device_share.py
        self._prefix_stats = None if replication is None else PrefixStats(replication)
        self._inflight_prefixes = inflight_prefixes  # False: only what backends reported counts
        self._spill_guard = spill_guard
        self._prefix_affinity = prefix_affinity
        self._policy = make_policy(policy, spill_guard, prefix_affinity)
        self._new_token_ratio_config = new_token_ratio
        self._calibration = calibration
        self._backends: dict[str, _BackendState] = {}  # kept in preference order
        # Every backend's in-flight blocks inverted: block hash -> bitmask of the backends
        # (`_BackendState.position`) holding them, so a request's in-flight hits on all backends
        # come from one walk over its blocks (`_inflight_hits`).
        self._inflight_index: dict[int, int] = {}
        self._free_positions: list[int] = []
        self._next_position = 0
        self._num_cordoned = 0  # backends cordoned now
        self.reference_scoring = False  # True: score each backend through score_backend (the spec)
        self._req_to_backend: dict[str, str] = {}
        for spec in backends:
            self.add_backend(spec)

    @property
    def policy(self) -> str:
        return self._policy.name

    # --- backends -------------------------------------------------------------------------

    def add_backend(self, spec: BackendSpec) -> None:
        if spec.backend_id in self._backends:
            raise ValueError(f"backend {spec.backend_id!r} is already registered")
        position = self._free_positions.pop() if self._free_positions else self._next_position
        self._next_position = max(self._next_position, position + 1)
        state = _BackendState(spec, spec.rates, Ledger(), spec.rates.prefill_tok_s,
                              NewTokenRatio(self._new_token_ratio_config),
                              InflightPrefixes(self._inflight_index, 1 << position), position=position)
        states = [*self._backends.values(), state]
        states.sort(key=lambda s: s.spec.preference_key())
        self._backends = {s.spec.backend_id: s for s in states}

    def remove_backend(self, backend_id: str) -> RemovedRequests:
        """Drop a backend and its ledger; returns its unfinished requests' ids."""
        state = self._backends.pop(backend_id, None)
        removed = RemovedRequests()
        if state is None:
            return removed
        for entry in state.ledger.entries.values():
            (removed.active if entry.status == ACTIVE else removed.queued).append(entry.req_id)
            self._req_to_backend.pop(entry.req_id, None)
        state.inflight.leave_index()
        self._free_positions.append(state.position)
        self._num_cordoned = sum(state.cordoned for state in self._backends.values())
        return removed

    def set_policy(self, policy: str) -> None:
        """Route later requests with `policy` (same options); pending work is kept."""
        self._policy = make_policy(policy, self._spill_guard, self._prefix_affinity)

    def set_cordoned(self, backend_id: str, cordoned: bool) -> None:
        """A cordoned backend keeps its pending work, ledger and calibrated rates but gets no
        new requests (like `kubectl cordon`); a benchmark's accelerator-only arm on a machine
        without an accelerator cordons the other backends."""
        self._state(backend_id).cordoned = cordoned
        self._num_cordoned = sum(state.cordoned for state in self._backends.values())

    def set_max_active(self, backend_id: str, max_active: int) -> None:
        """The backend now runs at most `max_active` requests at once (its ledger is kept)."""
        state = self._state(backend_id)
        state.spec = replace(state.spec, max_active=max_active)

    def backend_ids(self) -> list[str]:
        """Registered backends in preference order (accelerators first, then by id)."""
        return list(self._backends)

    def ledger(self, backend_id: str) -> Ledger:
        """`backend_id`'s ledger, for inspection (mutate it only through the Router)."""
        return self._state(backend_id).ledger

    def rates(self, backend_id: str) -> RateProfile:
        """The rates the cost model currently uses for `backend_id` (calibrated, if on)."""
        return self._state(backend_id).rates

    # --- decisions ------------------------------------------------------------------------

    def score(self, request: RouteRequest) -> list[BackendScore]:
        """Every backend's score for `request`, in preference order, without routing it (nor
        counting its prefix). The recompute and replication terms are relative to the routable
        (not cordoned) backends."""
        return self._score(request, self._prefix_key(request))

    def _shares(self) -> dict[str, int]:
        if not self._device_shares:
            return {}
        return device_shares({b: s.spec.device for b, s in self._backends.items()},
                             {b: len(s.ledger) for b, s in self._backends.items()})

    def _score(self, request: RouteRequest, key: int | None) -> list[BackendScore]:
        """Every backend's score, as `_score_reference` computes it (the same values, to the bit),
        without a call per backend: the request-independent part of each backend's terms is kept
        until its ledger, rates, ratio or share changes (`_base`), and the in-flight hits of all
        backends come from one walk over the request's blocks."""
        if self.reference_scoring:
            return self._score_reference(request, key)
        scores = []
        shares = self._shares()
        num_prompt = request.num_prompt_tokens
        max_tokens = request.max_tokens
        priority = request.priority
        cached_answers = request.num_cached_tokens
        host_answers = request.num_host_cached_tokens
        inflight_hits = self._inflight_hits(request)
        queue_weight = self._queue_weight
        for backend_id, state in self._backends.items():
            share = shares.get(backend_id, 1) if shares else 1
            ledger = state.ledger
            base_key = (ledger.version, state.rates, state.ratio.ratio, share, state.spec)
            base = state.base
            if state.base_key != base_key:
                base = state.base = self._base(state, share)
                state.base_key = base_key
            (num_prefill_pending, existing_decode, decode_rate, prefill_tok_s, reload_rate, batch_size,
             num_active, num_queued, max_active, ratio, device_kind, max_queued_priority, ttft_tail) = base
            num_cached = cached_answers.get(backend_id, 0)
            num_host_end = num_cached + host_answers.get(backend_id, 0) if host_answers else num_cached
            num_inflight = inflight_hits.get(state.position, 0) if inflight_hits else 0
            if num_inflight > num_cached:
                num_cached = num_inflight
            # score_backend
            num_host = num_host_end - num_cached
            if num_host < 0:
                num_host = 0
            if num_cached > num_prompt:
                num_cached = num_prompt
            if num_host > num_prompt - num_cached:
                num_host = num_prompt - num_cached
            if reload_rate is None:
                num_host = 0
            num_uncached = num_prompt - num_cached - num_host
            num_prefill_tokens = num_prefill_pending + num_uncached
            num_decode_tokens = existing_decode + max_tokens
            prefill_term_s = num_prefill_tokens / prefill_tok_s
            reload_term_s = num_host / reload_rate if num_host else 0.0
            decode_term_s = num_decode_tokens / decode_rate
            if batch_size:
                decode_term_s = max(decode_term_s, max_tokens * batch_size / decode_rate)
            # the new request's prefill as the queue term and the TTFT projection count it
            if num_host:
                num_uncached = prefill_equivalent(num_uncached, num_host, state.rates)
            if max_queued_priority is None or max_queued_priority <= priority:
                # nothing queued here is less urgent: no slot filling or aging (routing/deadline.py)
                projected = (num_prefill_pending + num_uncached) / state.rates.prefill_tok_s
                if ttft_tail is not None:
                    projected = projected + ttft_tail
            else:
                projected = projected_ttft_s(state.spec, state.rates, ledger, ratio, priority, num_uncached,
                                             request.arrival_s)
            scores.append(BackendScore(
                backend_id, device_kind, num_cached, num_prefill_tokens, num_decode_tokens, prefill_term_s,
                decode_term_s, prefill_term_s + reload_term_s + decode_term_s, num_active, num_queued, max_active,
                ratio, prefill_tok_s, decode_rate, num_inflight, 0.0, 0.0,
                queue_weight * num_queued * num_uncached / prefill_tok_s, projected, num_host, reload_term_s))
        self._add_prefix_terms(scores, 0 if key is None else self._prefix_stats.num_seen(key))
        return scores

    @staticmethod
    def _base(state: _BackendState, share: int) -> tuple:
        """The part of a backend's terms that does not depend on the request, computed as
        `score_backend` and `projected_ttft_s` compute it."""
        spec, rates, ledger, ratio = state.spec, state.rates, state.ledger, state.ratio.ratio
        num_requests = len(ledger)
        existing_decode = ledger.num_decode_tokens
        if ratio != 1.0:
            existing_decode = ratio * existing_decode
        decode_rate = decode_rate_for(rates, spec.max_active, num_requests + 1) / share
        reload_rate = None if rates.reload_tok_s is None else rates.reload_tok_s / share
        batch_size = max(1, min(spec.max_active, num_requests + 1)) if rates.is_batch_aware else 0
        # routing/deadline.py's slot wait with nothing less urgent queued: what runs ahead is all of it
        ttft_tail = None
        num_to_finish = num_requests - spec.max_active + 1
        if num_to_finish > 0:
            drain_s = ratio * ledger.num_decode_tokens / decode_rate_for(rates, spec.max_active, num_requests)
            ttft_tail = drain_s * num_to_finish / num_requests
        return (ledger.num_prefill_tokens, existing_decode, decode_rate, rates.prefill_tok_s / share, reload_rate,
                batch_size, ledger.num_active, ledger.num_queued, spec.max_active, ratio, spec.device_kind,
                max(ledger.queued_by_priority, default=None), ttft_tail)

    def _inflight_hits(self, request: RouteRequest) -> dict[int, int] | None:
        """Each backend's in-flight hit (`InflightPrefixes.num_cached_tokens`) by its position,
        nonzero ones only; None when there are none."""
        if not request.block_hashes or not self._inflight_index:
            return None
        block_size = request.block_size
        max_blocks = (request.num_prompt_tokens - 1) // block_size
        everyone = (1 << self._next_position) - 1
        hits = {}
        for holders, num_blocks in leading_runs(self._inflight_index, request.block_hashes, 0, max_blocks, everyone):
            for position in bits(holders):
                hits[position] = num_blocks * block_size
        return hits

    def _score_reference(self, request: RouteRequest, key: int | None) -> list[BackendScore]:
        """`_score` one backend at a time through `score_backend`, `projected_ttft_s` and the
        in-flight prefixes' own lookup: the spec `_score` keeps to (tests hold them equal)."""
        scores = []
        shares = self._shares()
        for backend_id, state in self._backends.items():
            num_cached = request.num_cached_tokens.get(backend_id, 0)
            num_host_end = num_cached + request.num_host_cached_tokens.get(backend_id, 0)  # the host run's end
            num_inflight = 0
            if request.block_hashes and state.inflight.hash_to_count:
                num_inflight = state.inflight.num_cached_tokens(
                    request.block_hashes, request.num_prompt_tokens, request.block_size)
                num_cached = max(num_cached, num_inflight)
            s = score_backend(
                state.spec, state.rates, state.ledger, state.ratio.ratio,
                request.num_prompt_tokens, num_cached, request.max_tokens, num_inflight,
                shares.get(backend_id, 1), max(0, num_host_end - num_cached),
            )
            num_uncached = self._new_prefill_tokens(request, s, state.rates)
            s.queue_term_s = queue_term_s(num_uncached, s.prefill_tok_s, s.num_queued, self._queue_weight)
            s.projected_ttft_s = projected_ttft_s(state.spec, state.rates, state.ledger, state.ratio.ratio,
                                                  request.priority, num_uncached, request.arrival_s)
            scores.append(s)
        self._add_prefix_terms_reference(scores, 0 if key is None else self._prefix_stats.num_seen(key))
        return scores

    @staticmethod
    def _new_prefill_tokens(request: RouteRequest, s: BackendScore, rates: RateProfile) -> int:
        """The new request's prefill on the backend `s` scores, its host-tier hit counted as the
        prefill tokens that take as long as reloading it (routing/cost_model.py)."""
        num_uncached = request.num_prompt_tokens - s.num_cached_tokens - s.num_host_cached_tokens
        return prefill_equivalent(num_uncached, s.num_host_cached_tokens, rates)

    def _prefix_key(self, request: RouteRequest) -> int | None:
        """The request's prefix key as replication counts it (None without replication)."""
        if self._prefix_stats is None:
            return None
        return prefix_key(request, self._prefix_stats.config.num_prefix_blocks)

    def _add_prefix_terms_reference(self, scores: list[BackendScore], num_seen: int) -> None:
        """`_add_prefix_terms` through `_missing_s` and `_invests`, the spec it keeps to."""
        routable = [s for s in scores if not self._backends[s.backend_id].cordoned]
        top = max((s.num_cached_tokens for s in routable), default=0)
        holders = [s for s in routable if s.num_cached_tokens == top]
        holder_kinds = {s.device_kind for s in holders}
        holder_wait_s = min((s.prefill_term_s for s in holders if _has_free_slot(s)), default=math.inf)
        for s in scores:
            if s.num_cached_tokens >= top:
                continue
            missing_s = self._missing_s(s, top)
            if s.device_kind in holder_kinds and self._invests(s, num_seen, holder_wait_s):
                config = self._prefix_stats.config
                num_waiting = 1 + s.num_active + s.num_queued
                s.replication_term_s = missing_s * (num_waiting / (config.future_factor * num_seen) - 1)
            else:
                s.recompute_term_s = self._recompute_weight * missing_s

    def _add_prefix_terms(self, scores: list[BackendScore], num_seen: int) -> None:
        """Charge each backend that lacks part of a prefix a routable backend holds: the
        recompute term (routing/policies.py says why), or, where a copy is an investment, the
        replication term (routing/replication.py). `_missing_s` and `_invests`, inlined."""
        routable = self._routable(scores)
        top = max((s.num_cached_tokens for s in routable), default=0)
        holders = [s for s in routable if s.num_cached_tokens == top]
        holder_kinds = {s.device_kind for s in holders}
        holder_wait_s = min((s.prefill_term_s for s in holders if _has_free_slot(s)), default=math.inf)
        recompute_weight = self._recompute_weight
        stats = self._prefix_stats
        if num_seen > 0:  # only then can a copy be an investment (and there are stats)
            may_copy_slowly = stats.may_copy_slowly()
            replication_divisor = stats.config.future_factor * num_seen
        for s in scores:
            num_cached = s.num_cached_tokens
            if num_cached >= top:
                continue
            num_missing = top - num_cached
            num_host = s.num_host_cached_tokens
            if num_host > num_missing:
                num_host = num_missing
            reload_s = num_host * s.reload_term_s / s.num_host_cached_tokens if num_host else 0.0
            missing_s = (num_missing - num_host) / s.prefill_tok_s + reload_s
            if (num_seen > 0 and s.device_kind in holder_kinds and s.num_active + s.num_queued < s.max_active
                    and not stats.under_pressure(s.backend_id)
                    and (s.prefill_term_s <= holder_wait_s or may_copy_slowly)):
                num_waiting = 1 + s.num_active + s.num_queued
                s.replication_term_s = missing_s * (num_waiting / replication_divisor - 1)
            else:
                s.recompute_term_s = recompute_weight * missing_s

    def _routable(self, scores: list[BackendScore]) -> list[BackendScore]:
        """`scores` of the backends not cordoned (the list itself when none is)."""
        if not self._num_cordoned:
            return scores
        return [s for s in scores if not self._backends[s.backend_id].cordoned]

    def _missing_s(self, s: BackendScore, top: int) -> float:
        """Seconds for the backend `s` scores to make up the `top - its hit` tokens of the prefix
        that a routable backend holds: what its host tier holds of them is reloaded, the rest
        computed."""
        num_missing = top - s.num_cached_tokens
        num_host = min(s.num_host_cached_tokens, num_missing)
        reload_s = num_host * s.reload_term_s / s.num_host_cached_tokens if num_host else 0.0
        return (num_missing - num_host) / s.prefill_tok_s + reload_s

    def _invests(self, s: BackendScore, num_seen: int, holder_wait_s: float) -> bool:
        """Whether copying the prefix to this backend counts as an investment. A copy whose
        prefill outlasts the request's wait on the best holder (`holder_wait_s`: that holder's
        prefill ahead of it, its own included; infinite if no holder has a free slot) puts one
        more slow request in the TTFT tail, so it waits `copy_interval` decisions after the last
        copy (routing/replication.py says why)."""
        stats = self._prefix_stats
        return (num_seen > 0 and _has_free_slot(s) and not stats.under_pressure(s.backend_id)
                and (s.prefill_term_s <= holder_wait_s or stats.may_copy_slowly()))

    def route(self, request: RouteRequest) -> DecisionRecord:
        """Choose a backend for `request` and record it there as queued. Raises
        `DeadlineRefusedError` (placing nothing) when its TTFT deadline cannot be met."""
        if request.req_id in self._req_to_backend:
            raise ValueError(
                f"request {request.req_id!r} is already pending on {self._req_to_backend[request.req_id]!r}"
            )
        key = self._prefix_key(request)
        score_list = self._score(request, key)
        scores = {s.backend_id: s for s in score_list}
        routable = self._routable(score_list)
        if request.ttft_deadline_s is None:
            backend_id = self._policy.choose(routable, request)
        else:
            backend_id = self._choose_by_deadline(request, routable, scores)
        if key is not None:
            self._prefix_stats.observe(key, request.block_hashes, request.block_size,
                                       {b: s.num_cached_tokens for b, s in scores.items()})
            if scores[backend_id].num_cached_tokens < max(s.num_cached_tokens for s in routable):
                self._prefix_stats.note_copy()
        state = self._backends[backend_id]
        entry = LedgerEntry(
            req_id=request.req_id,
            num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
            num_prefill_tokens_est=self._new_prefill_tokens(request, scores[backend_id], state.rates),
            priority=request.priority,
            arrival_s=request.arrival_s,
        )
        state.ledger.add_queued(entry)
        if self._inflight_prefixes:
            state.inflight.add(request.req_id, request.block_hashes)
        self._req_to_backend[request.req_id] = backend_id
        return DecisionRecord(request.req_id, self.policy, backend_id, scores, request.priority,
                              request.ttft_deadline_s)

    def _choose_by_deadline(self, request: RouteRequest, routable: list[BackendScore],
                            scores: dict[str, BackendScore]) -> str:
        """The policy's choice among the routable backends that meet the request's deadline;
        raises DeadlineRefusedError if there is none (routing/deadline.py)."""
        if not routable:
            raise NoBackendError(f"policy {self.policy!r} has no routable backend")
        split = split_by_deadline(routable, request.ttft_deadline_s, request.num_prompt_tokens)
        if split.meeting:
            try:
                return self._policy.choose(split.meeting, request)
            except NoBackendError:
                if len(split.meeting) == len(routable):
                    raise  # the policy takes none of the backends, deadline or not
        record = DecisionRecord(request.req_id, self.policy, split.best.backend_id, scores, request.priority,
                                request.ttft_deadline_s, placed=False, retry_after_s=split.retry_after_s)
        raise DeadlineRefusedError(request.req_id, split.best.backend_id, request.ttft_deadline_s,
                                 split.best.projected_ttft_s, split.retry_after_s, record)

    # --- progress ---------------------------------------------------------------------------

    def on_progress(self, backend_id: str, events: Iterable[ProgressEvent | RunningProgress]) -> int:
        """Apply a batch of reports from `backend_id`; returns how many matched a request (a
        `RunningProgress` counts as the three events it stands for).

        Reports from an unknown (e.g. already removed) backend, or about requests this
        backend's ledger does not hold, are ignored: they are late, not wrong.
        """
        state = self._backends.get(backend_id)
        if state is None:
            return 0
        num_applied = 0
        num_decode_steps = 0  # the largest token gain of any request in this batch
        ledger = state.ledger
        entries = ledger.entries
        for event in events:
            entry = entries.get(event.req_id)
            if entry is None:
                continue
            if type(event) is RunningProgress:  # admitted + prefill + generated, at once
                gain = event.num_output_tokens - entry.num_output_tokens
                if gain > num_decode_steps:
                    num_decode_steps = gain
                ledger.apply_running(entry, event.num_computed_prompt_tokens, event.num_output_tokens)
                num_applied += 3
                continue
            if event.kind == messages.GENERATED:
                num_decode_steps = max(num_decode_steps, event.value - entry.num_output_tokens)
            state.ledger.apply(event)
            num_applied += 1
            if event.kind in (messages.FINISHED, messages.ABORTED):
                self._req_to_backend.pop(event.req_id, None)
                state.inflight.remove(event.req_id)
        state.ratio.on_decode_steps(num_decode_steps)
        self._settle_if_idle(state)
        return num_applied

    def observe_step(
        self,
        backend_id: str,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        batch_size: int,
        elapsed_s: float,
    ) -> None:
        """Blend one observed engine step into `backend_id`'s rates (no-op unless calibrating),
        and into those of its siblings: identical engines on the same device (same `device`,
        same profile). A step is slow because the device is busy with every engine on it, not
        because of the engine that reported it; calibrating each engine alone would leave an
        engine idle a while with the rates of the contention it last saw, and the router would
        rank identical engines by when they last ran instead of by their cache and load."""
        state = self._backends.get(backend_id)
        if state is None or self._calibration is None:
            return
        # With device_shares, a step slowed by its neighbours on the device says 1/share of its alone rate.
        elapsed_s /= self._shares().get(backend_id, 1)
        rates = calibrate(state.rates, self._calibration, num_prefill_tokens, num_decode_tokens, batch_size, elapsed_s)
        alone = state.alone_prefill_tok_s
        if num_prefill_tokens > 0 and num_decode_tokens == 0:
            alpha = self._calibration.alpha
            alone = (1 - alpha) * alone + alpha * num_prefill_tokens / elapsed_s
        for sibling in self._siblings(state):
            sibling.rates = rates
            sibling.alone_prefill_tok_s = alone

    def _siblings(self, state: _BackendState) -> list[_BackendState]:
        """`state` and the backends that share its device and profile (just `state` if it has none)."""
        device = state.spec.device
        if device is None:
            return [state]
        return [s for s in self._backends.values()
                if s is state or (s.spec.device == device and s.spec.rates == state.spec.rates)]

    def forget(self, req_id: str) -> bool:
        """Drop `req_id` wherever it is pending; returns whether it was found."""
        backend_id = self._req_to_backend.pop(req_id, None)
        if backend_id is None:
            return False
        state = self._backends[backend_id]
        state.ledger.remove(req_id)
        state.inflight.remove(req_id)
        self._settle_if_idle(state)
        return True

    def backend_of(self, req_id: str) -> str | None:
        return self._req_to_backend.get(req_id)

    def pending_summary(self) -> dict[str, PendingSummary]:
        return {
            backend_id: PendingSummary(
                backend_id=backend_id,
                device_kind=state.spec.device_kind,
                num_active=state.ledger.num_active,
                num_queued=state.ledger.num_queued,
                num_prefill_tokens=state.ledger.num_prefill_tokens,
                num_decode_tokens=state.ledger.num_decode_tokens,
                pending_s=pending_seconds(state.spec, state.rates, state.ledger, state.ratio.ratio),
                new_token_ratio=state.ratio.ratio,
            )
            for backend_id, state in self._backends.items()
        }

    def _state(self, backend_id: str) -> _BackendState:
        try:
            return self._backends[backend_id]
        except KeyError:
            raise KeyError(f"unknown backend {backend_id!r}; registered: {list(self._backends)}") from None

    def _settle_if_idle(self, state: _BackendState) -> None:
        """A backend whose ledger empties starts afresh: its new_token_ratio resets, and once its
        device has nothing left on any engine, its prefill rate goes back to the rate calibrated
        from steps that prefilled alone.

        Under load a backend prefills in mixed steps, beside the requests decoding, and
        calibration counts those as prefill at the slower rate they run at (`calibrate`): right
        while the load lasts. An idle backend's next prefill runs alone, so keeping the loaded
        rate scores idle engines as slower than busy ones, and an idle engine takes no steps that
        would correct it."""
        if len(state.ledger) != 0:
            return
        state.ratio.reset()
        if self._calibration is None:
            return
        siblings = self._siblings(state)
        if any(len(s.ledger) for s in siblings) or state.rates.prefill_tok_s == state.alone_prefill_tok_s:
            return
        rates = replace(state.rates, prefill_tok_s=state.alone_prefill_tok_s)
        for sibling in siblings:
            sibling.rates = rates


def _has_free_slot(s: BackendScore) -> bool:
    return s.num_active + s.num_queued < s.max_active
