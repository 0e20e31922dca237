"""The Router's scoring (`_score`: request-independent terms kept per backend, in-flight hits from
one walk over an inverted index) gives exactly, to the bit, the scores of the reference path
(`reference_scoring`: `score_backend`, `projected_ttft_s` and each backend's own in-flight lookup),
so the same decisions, on random workloads that exercise every input: batch tables or not, host
tiers, device shares, new_token_ratio, calibration, priorities with a starvation bound, deadlines,
cordoned backends, in-flight prefixes, backends leaving and rejoining, and progress of all kinds."""

import random
from dataclasses import asdict

import pytest

from tandem.routing import (BackendSpec, CalibrationConfig, DeadlineRefusedError, NewTokenRatioConfig, NoBackendError,
                            ProgressEvent, RateProfile, RouteRequest, Router)

BLOCK = 16


def random_spec(rng: random.Random, backend_id: str) -> BackendSpec:
    kind = rng.choice(["cuda", "cuda", "cpu"])
    table = rng.choice([None, {1: 300.0, 8: 1500.0, 32: 4000.0}])
    rates = RateProfile(rng.choice([2551.0, 8000.0, 73.0]), rng.choice([293.0, 45.0]), table,
                        rng.choice([None, None, 20000.0]))
    return BackendSpec(backend_id, kind, rates, max_active=rng.choice([1, 2, 4, 8]),
                       device=rng.choice([None, "gpu0", "gpu1"]), max_priority_wait_s=rng.choice([None, 0.5, 2.0]))


def make_pair(rng: random.Random, policy: str) -> tuple[Router, Router]:
    kwargs = dict(policy=policy, device_shares=rng.random() < 0.5,
                  new_token_ratio=NewTokenRatioConfig() if rng.random() < 0.5 else None,
                  calibration=CalibrationConfig(0.3) if rng.random() < 0.5 else None)
    fast, reference = Router(**kwargs), Router(**kwargs)
    reference.reference_scoring = True
    return fast, reference


def same(fast: Router, reference: Router, method: str, *args):
    """Call `method` on both routers; they must answer alike (or raise alike)."""
    outcomes = []
    for router in (fast, reference):
        try:
            outcomes.append(("ok", getattr(router, method)(*args)))
        except (DeadlineRefusedError, NoBackendError) as exc:
            outcomes.append((type(exc).__name__, getattr(exc, "record", None)))
    (kind_f, answer_f), (kind_r, answer_r) = outcomes
    assert kind_f == kind_r
    return answer_f, answer_r


def assert_same_record(a, b) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert (a.backend_id, a.placed, a.retry_after_s) == (b.backend_id, b.placed, b.retry_after_s)
    assert list(a.per_backend) == list(b.per_backend)
    for backend_id, score in a.per_backend.items():
        assert asdict(score) == asdict(b.per_backend[backend_id]), backend_id  # exact floats


@pytest.mark.parametrize("seed", range(12))
def test_fast_scoring_equals_the_reference(seed):
    rng = random.Random(seed)
    fast, reference = make_pair(rng, rng.choice(["cost", "cost", "least-requests", "prefix-affinity"]))
    stems = [[rng.randrange(1000) for _ in range(BLOCK * rng.randrange(1, 12))] for _ in range(5)]
    backend_ids = [f"b{i}" for i in range(rng.randrange(2, 9))]
    for backend_id in backend_ids:
        spec = random_spec(rng, backend_id)
        fast.add_backend(spec)
        reference.add_backend(spec)
    pending: list[str] = []
    now = 100.0
    for n in range(300):
        now += rng.choice([0.0, 0.01, 0.2, 1.0])
        action = rng.random()
        live = fast.backend_ids()
        if action < 0.5 and live:
            prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            hashes = tuple(hash(tuple(prompt[: (i + 1) * BLOCK])) for i in range(len(prompt) // BLOCK))
            cached = {b: BLOCK * rng.randrange(0, len(hashes) + 1) for b in live if rng.random() < 0.4}
            host = {b: BLOCK * rng.randrange(0, 4) for b in live if rng.random() < 0.3}
            deadline = rng.choice([None, None, None, 0.05, 0.5, 5.0])
            request = RouteRequest(f"r{n}", len(prompt), rng.choice([1, 16, 128]), cached,
                                   hashes if rng.random() < 0.9 else (), BLOCK, rng.choice([0, 0, 1, 2]), deadline,
                                   arrival_s=now, num_host_cached_tokens=host)
            record_f, record_r = same(fast, reference, "route", request)
            assert_same_record(record_f, record_r)
            if fast.backend_of(request.req_id) is not None:
                pending.append(request.req_id)
        elif action < 0.85 and pending:
            req_id = rng.choice(pending)
            backend_id = fast.backend_of(req_id)
            assert backend_id == reference.backend_of(req_id)
            kind = rng.choice(["admitted", "prefill", "generated", "generated", "finished", "evicted", "aborted"])
            events = [ProgressEvent(req_id, kind, rng.randrange(0, 300))]
            applied_f, applied_r = same(fast, reference, "on_progress", backend_id, events)
            assert applied_f == applied_r == 1
            if kind in ("finished", "aborted"):
                pending.remove(req_id)
            if rng.random() < 0.3:
                step = (rng.randrange(0, 400), rng.randrange(0, 8), rng.randrange(1, 8), rng.choice([0.01, 0.2]))
                same(fast, reference, "observe_step", backend_id, *step)
        elif action < 0.9 and pending:
            req_id = pending.pop(rng.randrange(len(pending)))
            same(fast, reference, "forget", req_id)
        elif action < 0.94 and len(live) > 1:
            backend_id = rng.choice(live)
            same(fast, reference, "remove_backend", backend_id)
            pending = [r for r in pending if fast.backend_of(r) is not None]
        elif action < 0.97:
            missing = [b for b in backend_ids if b not in live]
            if missing:
                spec = random_spec(rng, rng.choice(missing))
                fast.add_backend(spec)
                reference.add_backend(spec)
        elif live:
            backend_id, cordoned = rng.choice(live), rng.random() < 0.5
            fast.set_cordoned(backend_id, cordoned)
            reference.set_cordoned(backend_id, cordoned)
            if rng.random() < 0.5:
                max_active = rng.choice([1, 3, 8])
                fast.set_max_active(backend_id, max_active)
                reference.set_max_active(backend_id, max_active)
        # Scoring without routing, too (the same request on both: no state changes).
        if live and rng.random() < 0.2:
            request = RouteRequest("probe", 64, 8, {}, (), 0, rng.choice([0, 2]), arrival_s=now)
            for a, b in zip(fast.score(request), reference.score(request)):
                assert asdict(a) == asdict(b)
