"""Projected time to first token, and placing a request under a TTFT deadline.

A request's first token comes after (1) the prefill of everything that runs before it, (2) a
free slot, if all `max_active` are taken by requests ahead of it, and (3) its own uncached
prefill. What runs before it is the ledger's `work_ahead(priority)`: every active request (the
engine never preempts for priority) and every queued request of its class or a more urgent one
(the engine admits waiting requests in (priority, arrival) order, engine/scheduler.py). So

    projected_ttft = (prefill ahead + own uncached prefill) / prefill rate
                     + slot wait

The slot wait is zero while fewer than `max_active` requests are ahead of it. Otherwise
`k = ahead - max_active + 1` of them must finish first; the router does not know which ones
finish first, so it takes that share of the decode work ahead, `k / ahead x` its drain time
(the ledger's decode term over the same requests, new_token_ratio applied). Both terms use the
rates the score uses, so calibration corrects them alike.

A slot the ledger sees free while requests are queued is being filled. The engine admits
waiting requests into a free slot at the start of its next step, but the backend reports the
admission with that step's progress, after the step: during a long prefill step the ledger
still counts the request it admitted as queued, and a new request that arrives then finds the
slot taken. So the oldest queued requests of less urgent classes, in the engine's admission
order, take the free slots that the queued requests ahead of the new one leave (`Ledger.filling`),
and their prefill and decode are ahead of it too.

The engine's starvation bound also puts work ahead: a less urgent request that has waited
longer than the backend's `max_priority_wait_s` takes turns with the more urgent waiting
requests (engine/scheduler.py), so a new request waits behind up to one aged request per
request queued ahead of it at its class or a more urgent one, plus one. Under sustained
overload the whole batch backlog has aged, and that is seconds of work. So, where the backend
states its bound and the request its arrival time, the projection adds that many of the oldest
less urgent queued requests routed at or before `now + projection - bound`, and repeats with
the longer projection (a few passes: each can only add requests, so the result is a lower
bound of the fixed point, usually the point itself).

Under a deadline the router keeps the routable backends whose projection meets it and lets the
normal policy choose among them. If none does, it refuses: the work ahead drains at one second
per second, so the best backend meets the deadline after `best projection - deadline` seconds,
unless the request's own prefill alone is longer than the deadline on every backend, in which
case waiting cannot help and there is no retry time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.cost_model import decode_rate_for
from tandem.routing.decision import BackendScore
from tandem.routing.ledger import Ledger, WorkAhead
from tandem.routing.rates import RateProfile


AGING_PASSES = 3  # re-projections with the work aged ahead; each can only add requests


def projected_ttft_s(spec: BackendSpec, rates: RateProfile, ledger: Ledger, new_token_ratio: float,
                     priority: int, num_uncached_tokens: int, now_s: float | None = None) -> float:
    """Seconds until a new request of class `priority`, arriving at `now_s` (the clock of the
    ledger's `arrival_s`; None: aging ignored), gets its first token on this backend."""
    ahead = ledger.work_ahead(priority)
    num_queued_ahead = ahead.num_requests - ledger.num_active
    num_free = spec.max_active - ledger.num_active - num_queued_ahead
    num_queued_below = ledger.num_queued - num_queued_ahead
    filling = []
    if num_free > 0 and num_queued_below > 0:
        filling = ledger.filling(priority, min(num_free, num_queued_below))
    ahead = ahead + WorkAhead.of(filling)
    projected = _projection(spec, rates, new_token_ratio, ahead, num_uncached_tokens)
    if spec.max_priority_wait_s is None or now_s is None:
        return projected
    # Aged requests and more urgent ones take turns, an aged one first at worst: one per
    # request queued ahead at this class or a more urgent one, plus one.
    num_turns = num_queued_ahead + 1
    filled = frozenset(entry.req_id for entry in filling)
    for _ in range(AGING_PASSES):
        aged = ledger.aged_work(priority, now_s + projected - spec.max_priority_wait_s, num_turns,
                                skip=filled)
        widened = _projection(spec, rates, new_token_ratio, ahead + aged, num_uncached_tokens)
        if widened <= projected:
            break
        projected = widened
    return projected


def _projection(spec: BackendSpec, rates: RateProfile, new_token_ratio: float, ahead: WorkAhead,
                num_uncached_tokens: int) -> float:
    """Prefill of the work ahead and the request's own, plus the wait for a slot."""
    prefill_s = (ahead.num_prefill_tokens + num_uncached_tokens) / rates.prefill_tok_s
    num_to_finish = ahead.num_requests - spec.max_active + 1
    if num_to_finish <= 0:
        return prefill_s
    decode_rate = decode_rate_for(rates, spec.max_active, ahead.num_requests)
    drain_s = new_token_ratio * ahead.num_decode_tokens / decode_rate
    return prefill_s + drain_s * num_to_finish / ahead.num_requests


@dataclass
class DeadlineSplit:
    """Routable backends split by whether they meet a deadline, and the best of them all."""

    meeting: list[BackendScore]
    best: BackendScore  # lowest projection (first in preference order on a tie)
    retry_after_s: float | None  # None: even the request's own prefill misses the deadline


def split_by_deadline(scores: Sequence[BackendScore], ttft_deadline_s: float,
                      num_prompt_tokens: int) -> DeadlineSplit:
    """Which of `scores` (routable, in preference order, non-empty) meet `ttft_deadline_s` for
    a prompt of `num_prompt_tokens`."""
    meeting = [s for s in scores if s.projected_ttft_s <= ttft_deadline_s]
    best = min(scores, key=lambda s: s.projected_ttft_s)
    own_prefill_s = min((num_prompt_tokens - s.num_cached_tokens) / s.prefill_tok_s for s in scores)
    retry_after_s = None if own_prefill_s > ttft_deadline_s else max(0.0, best.projected_ttft_s - ttft_deadline_s)
    return DeadlineSplit(meeting, best, retry_after_s)
