"""Policies and tie-breaking: accelerator first, then the lower backend id."""

import pytest

from tandem.routing import BackendSpec, NoBackendError, POLICIES, RateProfile, RouteRequest, Router

SAME = RateProfile(100, 10)


def req(n: int) -> RouteRequest:
    return RouteRequest(f"r{n}", 10, 10)


def test_policy_names():
    assert set(POLICIES) == {"cost", "accelerator-only", "cpu-only", "round-robin", "random", "least-requests",
                             "prefix-affinity"}


def test_ties_go_to_the_accelerator_then_the_lower_id():
    backends = [BackendSpec("cpu0", "cpu", SAME), BackendSpec("cuda1", "cuda", SAME), BackendSpec("cuda0", "cuda", SAME)]
    router = Router(backends)
    rec = router.route(req(1))
    assert len({s.score_s for s in rec.per_backend.values()}) == 1
    assert rec.backend_id == "cuda0"
    assert Router([BackendSpec("cpu1", "cpu", SAME), BackendSpec("cpu0", "cpu", SAME)]).route(req(1)).backend_id == "cpu0"


def test_cost_balances_identical_backends():
    router = Router([BackendSpec("cpu0", "cpu", SAME), BackendSpec("cuda0", "cuda", SAME)])
    assert [router.route(req(n)).backend_id for n in range(4)] == ["cuda0", "cpu0", "cuda0", "cpu0"]


def test_accelerator_and_cpu_only():
    fast_cpu = BackendSpec("cpu0", "cpu", RateProfile(10_000, 10_000))
    slow_gpus = [BackendSpec("cuda0", "cuda", SAME), BackendSpec("mps0", "mps", SAME)]
    router = Router([fast_cpu, *slow_gpus], policy="accelerator-only")
    assert [router.route(req(n)).backend_id for n in range(3)] == ["cuda0", "mps0", "cuda0"]
    router = Router([fast_cpu, *slow_gpus], policy="cpu-only")
    assert router.route(req(1)).backend_id == "cpu0"
    with pytest.raises(NoBackendError, match="cpu-only"):
        Router(slow_gpus, policy="cpu-only").route(req(1))


def test_round_robin_cycles_in_preference_order_and_survives_removal():
    backends = [BackendSpec(b, k, SAME) for b, k in (("cpu0", "cpu"), ("cuda1", "cuda"), ("cuda0", "cuda"))]
    router = Router(backends, policy="round-robin")
    assert [router.route(req(n)).backend_id for n in range(4)] == ["cuda0", "cuda1", "cpu0", "cuda0"]
    router.remove_backend("cuda1")
    assert [router.route(req(n)).backend_id for n in range(4, 7)] == ["cpu0", "cuda0", "cpu0"]


def test_random_is_seeded_and_uniform_over_every_backend():
    from tandem.routing import BackendScore
    from tandem.routing.policies import RandomPolicy, make_policy

    # A busy accelerator, an idle one and a slow CPU: random looks at none of it.
    backends = (("cuda0", "cuda", 1.0, 4), ("cuda1", "cuda", 1.0, 0), ("cpu0", "cpu", 9.0, 0))
    scores = [BackendScore(b, kind, 0, 0, 0, 0.0, score, score, active, 0) for b, kind, score, active in backends]
    policy, again = make_policy("random"), RandomPolicy()  # seed 0 by default
    picks = [policy.choose(scores, req(n)) for n in range(9000)]
    assert picks == [again.choose(scores) for _ in range(9000)]
    for backend_id in ("cuda0", "cpu0", "cuda1"):
        assert 0.25 < picks.count(backend_id) / len(picks) < 0.40
    assert [RandomPolicy(seed=1).choose(scores) for _ in range(20)] != picks[:20]


def test_random_routes_through_the_router_and_errors_without_backends():
    from tandem.routing.policies import RandomPolicy

    backends = [BackendSpec("cpu0", "cpu", SAME), BackendSpec("cuda0", "cuda", RateProfile(1e6, 1e6))]
    runs = [Router(backends, policy="random") for _ in range(2)]
    first, second = ([router.route(req(n)).backend_id for n in range(40)] for router in runs)
    assert first == second and set(first) == {"cpu0", "cuda0"}  # the slow CPU too
    with pytest.raises(NoBackendError, match="random"):
        RandomPolicy().choose([])


def test_least_requests_counts_active_and_queued():
    router = Router([BackendSpec("cpu0", "cpu", SAME), BackendSpec("cuda0", "cuda", RateProfile(1e6, 1e6))],
                    policy="least-requests")
    assert [router.route(req(n)).backend_id for n in range(4)] == ["cuda0", "cpu0", "cuda0", "cpu0"]


def _scores(cpu_score: float, accel_score: float, cpu_active: int = 0, cpu_queued: int = 0):
    from tandem.routing import BackendScore

    def score(backend_id, kind, value, active, queued):
        return BackendScore(backend_id, kind, 0, 0, 0, 0.0, value, value, active, queued, max_active=4)

    return [score("cuda0", "cuda", accel_score, 4, 10), score("cpu0", "cpu", cpu_score, cpu_active, cpu_queued)]


def test_spill_guard_margin_and_free_slot():
    from tandem.routing import SpillGuard
    from tandem.routing.policies import CostPolicy

    plain = CostPolicy()
    assert plain.choose(_scores(3.0, 3.1)) == "cpu0"  # the design's rule: any lower score wins
    guarded = CostPolicy(SpillGuard(margin=0.05))
    assert guarded.choose(_scores(3.0, 3.1)) == "cuda0"  # 3.0 is not below 0.95 x 3.1 = 2.945
    assert guarded.choose(_scores(2.9, 3.1)) == "cpu0"
    assert guarded.choose(_scores(2.9, 3.1, cpu_active=4, cpu_queued=1)) == "cpu0"  # queueing allowed
    no_queue = CostPolicy(SpillGuard(margin=0.05, allow_queue=False))
    assert no_queue.choose(_scores(2.9, 3.1, cpu_active=3)) == "cpu0"
    assert no_queue.choose(_scores(2.9, 3.1, cpu_active=3, cpu_queued=1)) == "cuda0"  # no free slot
    assert no_queue.choose(_scores(3.2, 3.1)) == "cuda0"  # the accelerator is simply better
    with pytest.raises(ValueError, match="spill margin"):
        SpillGuard(margin=1.0)


def test_spill_guard_needs_an_accelerator_to_act():
    from tandem.routing import SpillGuard

    guard = SpillGuard(margin=0.5, allow_queue=False)
    router = Router([BackendSpec("cpu0", "cpu", SAME), BackendSpec("cpu1", "cpu", SAME)], spill_guard=guard)
    assert [router.route(req(n)).backend_id for n in range(4)] == ["cpu0", "cpu1", "cpu0", "cpu1"]
    gpu_router = Router([BackendSpec("cpu0", "cpu", SAME), BackendSpec("cuda0", "cuda", SAME)], spill_guard=guard,
                        queue_weight=0)  # the guard alone: the queue term would add 0.1 s per queued request
    # Each request is 1.1 s of work on either; the CPU needs a score below half the GPU's.
    assert [gpu_router.route(req(n)).backend_id for n in range(4)] == ["cuda0", "cuda0", "cpu0", "cuda0"]
