"""In-flight prefixes and the recompute term: a burst of one tenant's requests stays on one
backend while that pays, queued requests keep the discount they were routed with, marks expire
with their request. Replication (a copy as an investment, tests/routing/test_replication.py) and
the queue term (tests/routing/test_queue_term.py) are off here, so each piece is seen alone."""

import pytest

from tandem.routing import BackendSpec, ProgressEvent, RateProfile, RouteRequest, Router
from tandem.routing.inflight import InflightPrefixes, num_cached_prefix_tokens

RATES = RateProfile(10_000, 1_000)  # prefill 10k tok/s, decode 1k tok/s, no batch table
PREFIX = tuple(range(1, 65))  # 64 shared blocks of 16 tokens = 1,024 tokens
PROMPT = 1040  # the prefix plus one unique block


def tenant_request(n: int, cached: dict[str, int] | None = None) -> RouteRequest:
    return RouteRequest(f"r{n}", PROMPT, 64, cached or {}, block_hashes=PREFIX + (1000 + n,), block_size=16)


def two_gpus(**options) -> Router:
    options.setdefault("replication", None)
    options.setdefault("queue_weight", 0)
    return Router([BackendSpec("cuda0", "cuda", RATES), BackendSpec("cuda1", "cuda", RATES)], **options)


def test_lookup_follows_the_engine_rule():
    inflight = InflightPrefixes()
    inflight.add("a", (1, 2, 3))
    inflight.add("b", (1, 2, 4))
    assert inflight.num_cached_tokens((1, 2, 3, 9), 100, 16) == 48
    assert inflight.num_cached_tokens((1, 2, 3), 48, 16) == 32  # capped: the last token is computed
    assert inflight.num_cached_tokens((9, 1, 2), 100, 16) == 0  # only a leading run counts
    inflight.remove("a")
    assert inflight.num_cached_tokens((1, 2, 3), 100, 16) == 32  # 1 and 2 are still b's
    inflight.remove("b")
    assert len(inflight) == 0 and inflight.hash_to_count == {}
    assert num_cached_prefix_tokens((1,), 100, 0, lambda h: True) == 0


def test_burst_of_one_tenant_lands_on_one_backend_while_it_has_capacity():
    """No backend has reported the prefix yet. r1 goes to cuda0; from then on cuda0 has the prefix
    in flight, so r2..r4 cost 16 prefill tokens there but 1,040 (plus the recompute term, 2 x
    1,024 tokens) on cuda1: cuda0 rank = 0.104 + 0.0016 (n - 1) + 0.064 n against cuda1's
    0.104 + 0.064 + 0.2048, lower for n <= 4; the 5th request's decode wait tips it to cuda1."""
    router = two_gpus()
    chosen = [router.route(tenant_request(n)) for n in range(1, 7)]
    assert [d.backend_id for d in chosen] == ["cuda0"] * 4 + ["cuda1", "cuda1"]
    r2 = chosen[1].per_backend
    assert (r2["cuda0"].num_cached_tokens, r2["cuda0"].num_inflight_cached_tokens) == (1024, 1024)
    assert r2["cuda1"].recompute_term_s == pytest.approx(2 * 1024 / 10_000)
    assert r2["cuda0"].rank_s == pytest.approx((1040 + 16) / 10_000 + 128 / 1_000)
    # Queued requests keep the discount they were routed with.
    assert [e.num_prefill_tokens_est for e in router.ledger("cuda0").entries.values()] == [1040, 16, 16, 16]


def test_without_inflight_accounting_the_burst_sprays():
    router = two_gpus(inflight_prefixes=False)
    assert [router.route(tenant_request(n)).backend_id for n in range(1, 5)] == ["cuda0", "cuda1"] * 2
    assert [e.num_prefill_tokens_est for e in router.ledger("cuda0").entries.values()] == [1040, 1040]


def test_marks_expire_with_the_request():
    router = two_gpus()
    router.route(tenant_request(1))
    router.route(tenant_request(2))
    router.on_progress("cuda0", [ProgressEvent("r1", "finished")])
    assert router.score(tenant_request(3))[0].num_inflight_cached_tokens == 1024  # r2 still holds it
    router.on_progress("cuda0", [ProgressEvent("r2", "aborted")])
    assert router.score(tenant_request(3))[0].num_inflight_cached_tokens == 0
    router.route(tenant_request(4))
    assert router.forget("r4")
    assert router.score(tenant_request(5))[0].num_inflight_cached_tokens == 0
    router.route(tenant_request(6))
    router.remove_backend("cuda0")
    router.add_backend(BackendSpec("cuda0", "cuda", RATES))
    assert router.score(tenant_request(7))[0].num_inflight_cached_tokens == 0


def test_reported_prefix_and_inflight_prefix_take_the_larger():
    router = two_gpus()
    router.route(RouteRequest("short", 500, 8, block_hashes=PREFIX[:10], block_size=16))  # 160 tokens
    scores = {s.backend_id: s for s in router.score(tenant_request(1, {"cuda0": 64, "cuda1": 512}))}
    assert (scores["cuda0"].num_cached_tokens, scores["cuda0"].num_inflight_cached_tokens) == (160, 160)
    assert scores["cuda1"].num_cached_tokens == 512
    assert scores["cuda0"].recompute_term_s == pytest.approx(2 * (512 - 160) / 10_000)
    assert scores["cuda1"].recompute_term_s == 0


def test_recompute_weight_zero_is_the_plain_score_and_cordoned_holders_do_not_count():
    plain = two_gpus(recompute_weight=0)
    s = plain.score(tenant_request(1, {"cuda0": 1024}))
    assert [x.recompute_term_s for x in s] == [0, 0] and s[1].rank_s == s[1].score_s
    router = two_gpus()
    router.set_cordoned("cuda0", True)
    s = router.score(tenant_request(1, {"cuda0": 1024}))
    assert [x.recompute_term_s for x in s] == [0, 0]  # only routable backends set the bar
    with pytest.raises(ValueError, match="recompute_weight"):
        two_gpus(recompute_weight=-1)


def test_block_hashes_are_checked():
    with pytest.raises(ValueError, match="block_size"):
        RouteRequest("r", 100, 8, block_hashes=(1,))
    with pytest.raises(ValueError, match="exceed the prompt"):
        RouteRequest("r", 20, 8, block_hashes=(1, 2), block_size=16)
