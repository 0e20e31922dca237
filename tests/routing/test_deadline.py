"""TTFT deadlines and priority classes in the router (routing/deadline.py), with exact numbers.

Backend g: prefill 1000 tok/s, decode 100 tok/s (no batch table), 2 slots. Requests r1..r3 each
have a 500-token prompt and a 100-token budget, nothing cached.
"""

import pickle

import pytest

from tandem.routing import (BackendSpec, DeadlineRefusedError, ProgressEvent, RateProfile, RouteRequest,
                            Router)


def g_spec(backend_id: str = "g", prefill: float = 1000, decode: float = 100, max_active: int = 2) -> BackendSpec:
    return BackendSpec(backend_id=backend_id, device_kind="cuda", rates=RateProfile(prefill, decode, None),
                       max_active=max_active)


def req(n: int, prompt: int = 500, budget: int = 100, **kw) -> RouteRequest:
    return RouteRequest(req_id=f"r{n}", num_prompt_tokens=prompt, max_tokens=budget, **kw)


def test_projection_counts_prefill_ahead_then_the_slot_wait():
    router = Router([g_spec()])
    assert router.route(req(1)).chosen.projected_ttft_s == pytest.approx(0.5)  # its own 500 tokens
    assert router.route(req(2)).chosen.projected_ttft_s == pytest.approx(1.0)  # r1's prefill + its own
    # Two requests ahead fill both slots: one of them must finish, so half of their 2 s of decode.
    assert router.route(req(3)).chosen.projected_ttft_s == pytest.approx(1.5 + 2.0 * 1 / 2)


def test_a_request_counts_only_the_queued_work_at_its_class_or_more_urgent():
    router = Router([g_spec()])
    router.route(req(1))
    router.route(req(2))
    router.route(req(3, priority=1))  # batch work, queued
    urgent = router.score(req(4, prompt=100, priority=0))[0]
    # r3 is not ahead: 2 requests, 1000 prefill tokens, 200 decode tokens ahead.
    assert urgent.projected_ttft_s == pytest.approx(1100 / 1000 + 200 / 100 * 1 / 2)
    batch = router.score(req(4, prompt=100, priority=1))[0]
    # r3 is: 3 requests ahead, 2 of which must finish.
    assert batch.projected_ttft_s == pytest.approx(1600 / 1000 + 300 / 100 * 2 / 3)
    # The score itself does not look at classes.
    assert urgent.score_s == batch.score_s == pytest.approx(1600 / 1000 + 400 / 100)


def test_active_requests_are_ahead_of_every_class():
    router = Router([g_spec()])
    router.route(req(1, priority=5))
    router.on_progress("g", [ProgressEvent("r1", "admitted"), ProgressEvent("r1", "prefill", 200)])
    s = router.score(req(2, prompt=100, priority=0))[0]
    assert s.projected_ttft_s == pytest.approx((300 + 100) / 1000)
    assert router.ledger("g").queued_by_priority == {}


def test_deadline_met_places_as_without_one():
    router = Router([g_spec()])
    router.route(req(1))
    router.route(req(2))
    rec = router.route(req(3, ttft_deadline_s=2.5))
    assert rec.placed and rec.backend_id == "g" and rec.ttft_deadline_s == 2.5
    assert "r3" in router.ledger("g")


def test_deadline_unmet_refuses_with_the_best_projection_and_retry_after():
    router = Router([g_spec()])
    router.route(req(1))
    router.route(req(2))
    with pytest.raises(DeadlineRefusedError) as info:
        router.route(req(3, ttft_deadline_s=2.0))
    err = info.value
    assert (err.backend_id, err.ttft_deadline_s) == ("g", 2.0)
    assert err.projected_ttft_s == pytest.approx(2.5)
    assert err.retry_after_s == pytest.approx(0.5)
    assert not err.record.placed and err.record.retry_after_s == pytest.approx(0.5)
    assert "r3" not in router.ledger("g") and router.backend_of("r3") is None
    assert "2000 ms cannot be met" in str(err) and "retry in 0.500 s" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.req_id, again.backend_id, again.retry_after_s) == ("r3", "g", err.retry_after_s)


def test_deadline_shorter_than_the_own_prefill_has_no_retry_time():
    router = Router([g_spec()])
    with pytest.raises(DeadlineRefusedError) as info:
        router.route(req(1, prompt=1000, ttft_deadline_s=0.5))
    assert info.value.retry_after_s is None and info.value.projected_ttft_s == pytest.approx(1.0)
    assert "even on an idle backend" in str(info.value)


def test_the_deadline_excludes_the_cheapest_backend_and_the_policy_chooses_among_the_rest():
    # slow: slow prefill, fast decode; fast: the reverse. A 100-token prompt with 1000 tokens of
    # budget scores 1 + 1 = 2 s on slow and 0.1 + 10 s on fast: cost picks slow.
    slow = g_spec("slow", prefill=100, decode=1000, max_active=4)
    fast = g_spec("fast", prefill=1000, decode=100, max_active=4)
    assert Router([slow, fast]).route(req(1, prompt=100, budget=1000)).backend_id == "slow"
    rec = Router([slow, fast]).route(req(1, prompt=100, budget=1000, ttft_deadline_s=0.5))
    assert rec.backend_id == "fast" and rec.chosen.projected_ttft_s == pytest.approx(0.1)
    assert rec.per_backend["slow"].projected_ttft_s == pytest.approx(1.0)


def test_cordoned_backends_are_neither_candidates_nor_the_best():
    router = Router([g_spec("a"), g_spec("b")])
    router.set_cordoned("b", True)
    router.route(req(1))
    with pytest.raises(DeadlineRefusedError) as info:
        router.route(req(2, ttft_deadline_s=0.8))
    assert info.value.backend_id == "a" and info.value.retry_after_s == pytest.approx(0.2)


def test_deadline_must_be_positive():
    with pytest.raises(ValueError, match="ttft_deadline_s must be > 0"):
        req(1, ttft_deadline_s=0.0)


def test_decision_record_logs_the_class_deadline_and_projection():
    data = Router([g_spec()]).route(req(1, priority=1, ttft_deadline_s=0.75)).to_dict()
    assert (data["priority"], data["ttft_deadline_s"], data["placed"], data["retry_after_s"]) == (1, 0.75, True, None)
    assert data["per_backend"]["g"]["projected_ttft_s"] == 0.5


def active(router: Router, name: str, prompt: int = 500, budget: int = 101) -> None:
    """Route `name` and report it admitted, prefilled and one token in: 100 tokens of budget left."""
    router.route(RouteRequest(name, prompt, budget, arrival_s=0.0))
    router.on_progress("g", [ProgressEvent(name, "admitted"), ProgressEvent(name, "prefill", prompt),
                             ProgressEvent(name, "generated", 1)])


def test_a_slot_seen_free_with_less_urgent_work_queued_is_being_filled():
    """The engine fills a free slot from its queue at its next step and reports it after that
    step, so a new urgent request finds the slot taken: the oldest less urgent queued requests,
    most urgent class first, take the free slots the queued requests ahead of it leave."""
    router = Router([g_spec()])
    active(router, "a1")
    router.route(req(1, prompt=700, priority=2))
    router.route(req(2, prompt=300, priority=1))
    # One slot free, two batch requests queued: r2 (class 1 before class 2) takes it, its 300
    # tokens prefill first, and then both slots are taken: one of the two must finish first.
    assert router.score(req(3, prompt=100))[0].projected_ttft_s == pytest.approx((300 + 100) / 1000 + 2.0 * 1 / 2)
    # An urgent request queued ahead takes the free slot instead; no batch work comes before.
    router.route(req(0, prompt=100))
    assert router.score(req(3, prompt=100))[0].projected_ttft_s == pytest.approx((100 + 100) / 1000 + 2.0 * 1 / 2)


def test_free_slots_with_nothing_queued_are_free():
    router = Router([g_spec()])
    active(router, "a1")
    assert router.score(req(3, prompt=100))[0].projected_ttft_s == pytest.approx(0.1)


def aging_router(bound: float | None = 5.0) -> Router:
    """Backend g with a 5 s starvation bound, both slots taken by requests decoding (100 tokens of
    budget left each), and two batch requests queued behind them, routed at t=0 and t=0.5."""
    spec = g_spec()
    spec.max_priority_wait_s = bound
    router = Router([spec])
    active(router, "a1")
    active(router, "a2")
    router.route(req(1, priority=1, arrival_s=0.0))
    router.route(req(2, priority=1, arrival_s=0.5))
    return router


def test_an_aged_batch_request_takes_its_turn_ahead_of_an_urgent_one():
    router = aging_router()
    # At t=1 neither batch request ages within the urgent one's 1.1 s: its own prefill and the
    # first of the two decoding requests to finish (half of their 2 s).
    assert router.score(req(3, prompt=100, arrival_s=1.0))[0].projected_ttft_s == pytest.approx(0.1 + 1.0)
    # At t=6 both have aged; they take turns with urgent work, so one of them goes first: its
    # prefill, and two of the three ahead must finish (2/3 of their 3 s of decode).
    assert router.score(req(3, prompt=100, arrival_s=6.0))[0].projected_ttft_s == pytest.approx(0.6 + 2.0)


def test_an_urgent_request_waits_for_one_aged_turn_per_urgent_request_ahead():
    router = aging_router()
    router.route(req(0, prompt=100, arrival_s=5.9))  # urgent, queued
    # r0, then both aged requests (one turn each for r0 and r3): 5 ahead with 1100 prefill
    # tokens, both slots taken, so 4 of 5 must finish: 4/5 of their 5 s of decode.
    assert router.score(req(3, prompt=100, arrival_s=6.0))[0].projected_ttft_s == pytest.approx(1.2 + 4.0)


def test_aging_is_projected_until_no_more_work_joins():
    router = aging_router()
    router.route(req(0, prompt=100, arrival_s=2.6))  # urgent, queued: two aged turns
    # At t=3: the 2.2 s without aging (r0's prefill and its own, 2/3 of 3 s) put r1 (routed at
    # 0) past the bound; the 3.7 s with it (one pass would stop there) put r2 (routed at 0.5) past too.
    assert router.score(req(3, prompt=100, arrival_s=3.0))[0].projected_ttft_s == pytest.approx(1.2 + 4.0)
    # At t=2.7 not even r1 ages within the 2.2 s.
    assert router.score(req(3, prompt=100, arrival_s=2.7))[0].projected_ttft_s == pytest.approx(0.2 + 2.0)


def test_aging_is_ignored_without_a_bound_or_an_arrival_time():
    assert aging_router(bound=None).score(req(3, prompt=100, arrival_s=6.0))[0].projected_ttft_s \
        == pytest.approx(1.1)
    assert aging_router().score(req(3, prompt=100))[0].projected_ttft_s == pytest.approx(1.1)


def test_a_batch_request_filling_a_free_slot_is_not_also_an_aged_turn():
    """With one slot free, the oldest batch request fills it; only the next one can take an aged
    turn, so the same request is not counted twice."""
    spec = g_spec()
    spec.max_priority_wait_s = 5.0
    router = Router([spec])
    active(router, "a1")
    router.route(req(1, priority=1, arrival_s=0.0))
    router.route(req(2, prompt=300, priority=1, arrival_s=0.5))
    # At t=6 both have aged. r1 fills the free slot; r2 takes one aged turn (r3's own): 3 ahead
    # with 800 prefill tokens and 300 of decode, both slots taken, so 2 of 3 must finish.
    assert router.score(req(3, prompt=100, arrival_s=6.0))[0].projected_ttft_s == pytest.approx(0.9 + 2.0)


def test_with_two_less_urgent_classes_the_filler_is_not_also_an_aged_turn():
    """The free slot goes to the more urgent of the less urgent classes even when an older
    request of a lower class is queued: the aged turn is then that older request, not the
    filler a second time."""
    spec = g_spec()
    spec.max_priority_wait_s = 5.0
    router = Router([spec])
    active(router, "a1")
    router.route(req(1, prompt=700, priority=2, arrival_s=0.0))
    router.route(req(2, prompt=300, priority=1, arrival_s=0.5))
    # At t=6 both have aged. r2 (class 1) fills the free slot; r1 takes the aged turn: 3 ahead
    # with 1000 prefill tokens and 300 of decode, both slots taken, so 2 of 3 must finish.
    assert router.score(req(3, prompt=100, arrival_s=6.0))[0].projected_ttft_s == pytest.approx(1.1 + 2.0)


def test_aged_work_is_already_ahead_of_its_own_class():
    # A batch request counts both queued batch requests whatever their age, and no more: 4 ahead,
    # 3 of which must finish (3/4 of their 4 s of decode).
    batch = aging_router().score(req(3, prompt=100, priority=1, arrival_s=6.0))[0]
    assert batch.projected_ttft_s == pytest.approx(1.1 + 3.0)


def test_a_refusal_behind_an_aged_turn_waits_for_it():
    router = aging_router()
    with pytest.raises(DeadlineRefusedError) as info:
        router.route(req(3, prompt=100, arrival_s=6.0, ttft_deadline_s=0.5))
    assert info.value.retry_after_s == pytest.approx(2.6 - 0.5)


def test_starvation_bound_must_not_be_negative():
    with pytest.raises(ValueError, match="max_priority_wait_s"):
        BackendSpec("g", "cuda", RateProfile(1000, 100, None), max_priority_wait_s=-1.0)
