"""The cost model's batch-aware decode rate (the plain formula is covered by the worked example)."""

import pytest

from tandem.routing import BackendSpec, RateProfile, RouteRequest, Router


def test_batch_aware_profile_uses_the_rate_at_the_resulting_batch_size():
    rates = RateProfile(prefill_tok_s=1000, decode_tok_s=100, decode_tok_s_by_batch={1: 100, 4: 400})
    router = Router([BackendSpec("cuda0", "cuda", rates, max_active=4)])
    scores = []
    for n in range(6):
        rec = router.route(RouteRequest(f"r{n}", num_prompt_tokens=0, max_tokens=100))
        scores.append(rec.per_backend["cuda0"])
    assert [s.decode_tok_s for s in scores] == [100, 200, 300, 400, 400, 400]
    assert scores[3].decode_term_s == pytest.approx(400 / 400)
    assert scores[5].decode_term_s == pytest.approx(600 / 400)
    assert router.pending_summary()["cuda0"].pending_s == pytest.approx(600 / 400)


def test_batch_aware_decode_term_is_at_least_the_new_requests_own_steps():
    """Three requests with 10 tokens left each: their summed budgets plus the new 100 drain in
    130 / 400 s at batch 4, but the new request needs 100 steps of 4 / 400 s: 1.0 s, the same as
    on an idle backend (100 / 100). The plain sum would make the busy backend look 3x faster."""
    rates = RateProfile(prefill_tok_s=1000, decode_tok_s=100, decode_tok_s_by_batch={1: 100, 4: 400})
    router = Router([BackendSpec("cuda0", "cuda", rates, max_active=4), BackendSpec("cuda1", "cuda", rates)])
    router.set_cordoned("cuda1", True)
    for n in range(3):
        router.route(RouteRequest(f"r{n}", num_prompt_tokens=0, max_tokens=10))
    router.set_cordoned("cuda1", False)
    rec = router.route(RouteRequest("new", num_prompt_tokens=0, max_tokens=100))
    assert rec.per_backend["cuda0"].num_decode_tokens == 130
    assert rec.per_backend["cuda0"].decode_term_s == pytest.approx(100 * 4 / 400)
    assert rec.per_backend["cuda1"].decode_term_s == pytest.approx(100 / 100)
    assert rec.backend_id == "cuda0"  # a tie goes to the lower id
