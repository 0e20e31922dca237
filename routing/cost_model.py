"""The router's score: estimated seconds of work on a backend if the new request joins it.

    score(b) = prefill_tokens(b) / prefill_rate(b) + decode_tokens(b) / decode_rate(b)

where `prefill_tokens` sums the remaining uncached prompt tokens of b's active and queued
requests plus the new request's prompt minus the prefix b reports, and `decode_tokens` sums
their unused `max_tokens` budgets (scaled by the optional new_token_ratio, see
routing/new_token_ratio.py) plus the new request's full `max_tokens`. Lower wins.

The rates are the backend's profile, so the score ranks backends by pending work; it does not
predict batched completion time. With a batch-aware profile the decode rate is the aggregate
rate at the batch size the backend would run with the new request on it,
`min(max_active, num_active + num_queued + 1)`; without one it is `decode_tok_s`, exactly the
design's formula. Inputs are the ledger's running sums, so this is O(1) per backend.

With a batch-aware profile the decode term is also at least the new request's own decode:
`max_tokens` steps of that batch, `max_tokens x batch / rate(batch)`. Summed budgets over the
aggregate rate are the time to drain the batch if it stayed that size, but it shrinks as its
requests finish and the new request, with the largest budget, runs last at a low batch rate;
on a GPU whose aggregate rate grows almost linearly with the batch, the plain sum makes a busy
backend look faster than an idle one and piles requests onto it (docs/routing.md, "Batch-aware
decode bound"). Without a table the plain formula is kept, so the design's worked example is
unchanged.

The queue term. The score is the new request's own completion time; it does not see what the
new request costs the requests queued on a backend (routed there, not yet admitted by its
engine). The engine admits waiting requests at a step boundary and prefills everything it
admitted in one step, so each of them waits for the new request's prefill before its first
token: a hit of 64 tokens is 1.7 ms on an H200, about what separates the arms' TTFT p95 at light
load. The router adds `queue_weight x the new request's uncached prefill / prefill rate x
num_queued` to the rank (`BackendScore.queue_term_s`, not to the score), so of two backends
with about the same score the one that delays nobody wins: two requests arriving within one
decode step go to different backends instead of sharing a prefill step. On a backend with no
free slot the queued requests are admitted before the new one and the term is a stand-in for
the queue the new request itself waits behind. The weight is 1 (the seconds of delay summed
over the queued requests); 0 restores the rank without it. In the design's worked example it
does not change a decision (request 7: GPU 3.043 s against the CPU's 3.118). The term and its
weight were chosen on route-sim's tenants grid, where the term makes `cost` at least as good as
every other arm in more cell-seeds; the counts, and the variants tried, are in docs/routing.md,
"The queue term".

The host tier. A backend with a host-memory KV tier (its rates carry `reload_tok_s`) may hold
part of a prompt's prefix in host memory, evicted from the device but not lost: the run of blocks
right after its device hit. Those tokens cost their copy back to the device, `num_host_cached /
reload_tok_s` (`BackendScore.reload_term_s`), not zero as a device hit does and not a prefill as
a miss does. Wherever a term counts the new request's prefill (the ledger's frozen estimate, the
queue term, the TTFT projection), a host hit counts as the prefill tokens that take as long
(`prefill_equivalent`). Without `reload_tok_s` a host hit is priced as a miss.

Shared devices. With the router's `device_shares` on, a backend that shares its device with
others is scored at its rates divided by its share, the number of engines that would be busy
there with the new request (routing/device_share.py); every term built on the rates (prefill,
decode, queue, recompute) sees the divided rates. Off, or without devices, the share is 1.
"""

from __future__ import annotations

import math

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.decision import BackendScore
from tandem.routing.ledger import Ledger
from tandem.routing.rates import RateProfile


def decode_rate_for(rates: RateProfile, max_active: int, num_requests: int) -> float:
    """Aggregate decode rate for a backend holding `num_requests` (new one included)."""
    if not rates.is_batch_aware:
        return rates.decode_tok_s
    return rates.decode_rate(max(1, min(max_active, num_requests)))


def score_backend(
    spec: BackendSpec,
    rates: RateProfile,
    ledger: Ledger,
    new_token_ratio: float,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    max_tokens: int,
    num_inflight_cached_tokens: int = 0,
    device_share: int = 1,
    num_host_cached_tokens: int = 0,
) -> BackendScore:
    """Score one backend for a new request with `num_cached_tokens` of its prompt reusable there
    (the larger of what the backend reported and what requests in flight to it will cache) and
    the next `num_host_cached_tokens` in its host tier, at 1/`device_share` of its rates
    (routing/device_share.py)."""
    num_cached_tokens = min(max(0, num_cached_tokens), num_prompt_tokens)
    num_host_cached_tokens = min(max(0, num_host_cached_tokens), num_prompt_tokens - num_cached_tokens)
    if rates.reload_tok_s is None:
        num_host_cached_tokens = 0  # no tier to reload from: the tokens are a miss
    num_uncached = num_prompt_tokens - num_cached_tokens - num_host_cached_tokens
    num_prefill_tokens = ledger.num_prefill_tokens + num_uncached
    num_existing_decode_tokens = ledger.num_decode_tokens
    if new_token_ratio != 1.0:
        num_existing_decode_tokens = new_token_ratio * num_existing_decode_tokens
    num_decode_tokens = num_existing_decode_tokens + max_tokens
    decode_rate = decode_rate_for(rates, spec.max_active, len(ledger) + 1) / device_share
    prefill_tok_s = rates.prefill_tok_s / device_share
    prefill_term_s = num_prefill_tokens / prefill_tok_s
    reload_term_s = 0.0
    if num_host_cached_tokens:
        reload_term_s = num_host_cached_tokens / (rates.reload_tok_s / device_share)
    decode_term_s = num_decode_tokens / decode_rate
    if rates.is_batch_aware:
        batch_size = max(1, min(spec.max_active, len(ledger) + 1))
        decode_term_s = max(decode_term_s, max_tokens * batch_size / decode_rate)
    return BackendScore(
        backend_id=spec.backend_id,
        device_kind=spec.device_kind,
        num_cached_tokens=num_cached_tokens,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=num_decode_tokens,
        prefill_term_s=prefill_term_s,
        decode_term_s=decode_term_s,
        score_s=prefill_term_s + reload_term_s + decode_term_s,
        num_active=ledger.num_active,
        num_queued=ledger.num_queued,
        max_active=spec.max_active,
        new_token_ratio=new_token_ratio,
        prefill_tok_s=prefill_tok_s,
        decode_tok_s=decode_rate,
        num_inflight_cached_tokens=num_inflight_cached_tokens,
        num_host_cached_tokens=num_host_cached_tokens,
        reload_term_s=reload_term_s,
    )


def prefill_equivalent(num_uncached: int, num_host_cached: int, rates: RateProfile) -> int:
    """The prefill tokens that take as long as computing `num_uncached` tokens and reloading
    `num_host_cached` from the host tier (a host hit costs `prefill / reload` of a miss)."""
    if not num_host_cached or rates.reload_tok_s is None:
        return num_uncached + num_host_cached
    return num_uncached + math.ceil(num_host_cached * rates.prefill_tok_s / rates.reload_tok_s)


def queue_term_s(num_uncached_tokens: int, prefill_tok_s: float, num_queued: int, weight: float) -> float:
    """The queue term (see the module doc): `weight x` the new request's prefill on this backend,
    once for every request queued there."""
    return weight * num_queued * num_uncached_tokens / prefill_tok_s


def pending_seconds(spec: BackendSpec, rates: RateProfile, ledger: Ledger, new_token_ratio: float) -> float:
    """The score without a new request: estimated seconds to drain what is already there."""
    if len(ledger) == 0:
        return 0.0
    decode_rate = decode_rate_for(rates, spec.max_active, len(ledger))
    return (
        ledger.num_prefill_tokens / rates.prefill_tok_s
        + new_token_ratio * ledger.num_decode_tokens / decode_rate
    )
