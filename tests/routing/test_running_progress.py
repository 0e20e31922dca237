"""A running request's report as one `RunningProgress` does what its three events ("admitted",
"prefill", "generated") do one after the other: the same ledger (sums, per-class sums, entries),
the same new_token_ratio, the same count of applied reports; on random reports, repeated,
stale or unknown ones included."""

import random
from dataclasses import asdict

import pytest

from tandem.routing import (BackendSpec, NewTokenRatioConfig, ProgressEvent, RateProfile, RouteRequest, Router,
                            RunningProgress)


def ledger_state(router: Router, backend_id: str):
    ledger = router.ledger(backend_id)
    return (ledger.num_prefill_tokens, ledger.num_decode_tokens, ledger.num_active, ledger.num_queued,
            {p: asdict(w) for p, w in ledger.queued_by_priority.items()},
            {r: asdict(e) for r, e in ledger.entries.items()}, router._state(backend_id).ratio.ratio)


@pytest.mark.parametrize("seed", range(8))
def test_running_progress_equals_its_three_events(seed):
    rng = random.Random(seed)
    routers = [Router(policy="round-robin", new_token_ratio=NewTokenRatioConfig()) for _ in range(2)]
    for router in routers:
        for backend_id in ("a", "b"):
            router.add_backend(BackendSpec(backend_id, "cuda", RateProfile(1000.0, 100.0), max_active=4))
    req_ids: list[str] = []
    for n in range(400):
        if rng.random() < 0.2 or not req_ids:
            request = RouteRequest(f"r{n}", rng.randrange(1, 600), rng.randrange(1, 64),
                                   {"a": rng.randrange(0, 300)}, priority=rng.choice([0, 1]))
            for router in routers:
                router.route(request)
            req_ids.append(request.req_id)
            continue
        backend_id = rng.choice(["a", "b"])
        batch_one, batch_three = [], []
        for _ in range(rng.randrange(1, 5)):
            req_id = rng.choice(req_ids + ["unknown"])
            if rng.random() < 0.8:
                computed, output = rng.randrange(0, 700), rng.randrange(0, 70)
                batch_one.append(RunningProgress(req_id, computed, output))
                batch_three += [ProgressEvent(req_id, "admitted"), ProgressEvent(req_id, "prefill", computed),
                                ProgressEvent(req_id, "generated", output)]
            else:
                event = ProgressEvent(req_id, rng.choice(["finished", "evicted", "aborted"]), rng.randrange(0, 300))
                batch_one.append(event)
                batch_three.append(event)
        assert routers[0].on_progress(backend_id, batch_one) == routers[1].on_progress(backend_id, batch_three)
        for backend_id in ("a", "b"):
            assert ledger_state(routers[0], backend_id) == ledger_state(routers[1], backend_id)
