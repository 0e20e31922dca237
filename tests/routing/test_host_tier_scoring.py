"""The cost model's host tier: a prefix held in a backend's host-memory KV tier costs its reload,
between a device hit (nothing) and a miss (its prefill), and every term that counts the new
request's prefill counts the reload as the prefill tokens that take as long."""

import math

import pytest

from tandem.routing import BackendSpec, RateProfile, RouteRequest, Router
from tandem.routing.cost_model import prefill_equivalent

PREFILL, DECODE, RELOAD = 1000.0, 100.0, 50_000.0
TIERED = RateProfile(prefill_tok_s=PREFILL, decode_tok_s=DECODE, reload_tok_s=RELOAD)


def three_backends(rates: RateProfile = TIERED) -> Router:
    return Router([BackendSpec(b, "cuda", rates, max_active=8) for b in ("hit", "host", "miss")],
                  replication=None, queue_weight=0.0)


def request(req_id: str = "r", **host) -> RouteRequest:
    return RouteRequest(req_id, num_prompt_tokens=2048 + 64, max_tokens=10,
                        num_cached_tokens={"hit": 2048}, num_host_cached_tokens=host or {"host": 2048})


def test_a_host_hit_scores_between_a_device_hit_and_a_miss_by_its_measured_reload():
    scores = three_backends().score(request())
    hit, host, miss = scores
    assert hit.score_s < host.score_s < miss.score_s
    assert host.num_host_cached_tokens == 2048 and host.num_cached_tokens == 0
    assert host.reload_term_s == pytest.approx(2048 / RELOAD)
    assert host.prefill_term_s == pytest.approx(64 / PREFILL)  # only the suffix is computed
    assert host.score_s == pytest.approx(hit.score_s + 2048 / RELOAD)
    assert miss.score_s == pytest.approx(hit.score_s + 2048 / PREFILL)
    assert miss.reload_term_s == 0.0 and hit.reload_term_s == 0.0


def test_without_a_reload_rate_a_host_hit_is_a_miss():
    plain = RateProfile(prefill_tok_s=PREFILL, decode_tok_s=DECODE)
    hit, host, miss = three_backends(plain).score(request())
    assert host.num_host_cached_tokens == 0 and host.reload_term_s == 0.0
    assert host.score_s == pytest.approx(miss.score_s)


def test_the_host_run_starts_after_the_device_hit_and_ends_where_reported():
    router = three_backends()
    rec = router.route(RouteRequest("r", num_prompt_tokens=4096 + 1, max_tokens=1,
                                    num_cached_tokens={"host": 1024}, num_host_cached_tokens={"host": 2048}))
    host = rec.per_backend["host"]
    assert (host.num_cached_tokens, host.num_host_cached_tokens) == (1024, 2048)
    assert host.prefill_term_s == pytest.approx((4097 - 3072) / PREFILL)


def test_the_ledger_freezes_a_host_hit_as_the_prefill_that_takes_as_long():
    router = three_backends()
    router.set_cordoned("hit", True)
    router.set_cordoned("miss", True)
    router.route(request())
    entry = router.ledger("host").entries["r"]
    assert entry.num_prefill_tokens_est == 64 + math.ceil(2048 * PREFILL / RELOAD) == prefill_equivalent(64, 2048, TIERED)
    assert prefill_equivalent(64, 2048, RateProfile(prefill_tok_s=PREFILL, decode_tok_s=DECODE)) == 64 + 2048


def test_the_recompute_term_charges_a_host_holder_its_reload_not_a_prefill():
    router = Router([BackendSpec(b, "cuda", TIERED, max_active=8) for b in ("hit", "host", "miss")],
                    replication=None, queue_weight=0.0, recompute_weight=1.0)
    hit, host, miss = router.score(request())
    assert hit.recompute_term_s == 0.0
    assert host.recompute_term_s == pytest.approx(2048 / RELOAD)
    assert miss.recompute_term_s == pytest.approx(2048 / PREFILL)
    assert hit.rank_s < host.rank_s < miss.rank_s


def test_the_decision_record_shows_each_term():
    record = three_backends().route(request()).to_dict()
    host = record["per_backend"]["host"]
    assert host["num_host_cached_tokens"] == 2048
    assert host["reload_term_s"] == pytest.approx(2048 / RELOAD, abs=1e-6)


def test_negative_host_counts_are_refused():
    with pytest.raises(ValueError, match="num_host_cached_tokens"):
        RouteRequest("r", 10, 1, num_host_cached_tokens={"a": -1})
