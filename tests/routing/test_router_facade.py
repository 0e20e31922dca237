"""The Router facade: backends coming and going, forget, summaries, calibration, errors."""

import pytest

from tandem.routing import (BackendSpec, CalibrationConfig, NewTokenRatioConfig, NoBackendError,
                     ProgressEvent, RateProfile, RouteRequest, Router)


def spec(backend_id: str, kind: str, prefill: float = 100, decode: float = 10, max_active: int = 4) -> BackendSpec:
    return BackendSpec(backend_id, kind, RateProfile(prefill, decode), max_active)


def req(req_id: str, prompt: int = 100, max_tokens: int = 10, cached: dict | None = None) -> RouteRequest:
    return RouteRequest(req_id, prompt, max_tokens, cached or {})


def test_backend_ids_are_in_preference_order():
    router = Router([spec("cpu0", "cpu"), spec("cuda1", "cuda"), spec("cuda0", "cuda")])
    assert router.backend_ids() == ["cuda0", "cuda1", "cpu0"]


def test_remove_backend_returns_queued_and_active_ids():
    router = Router([spec("cuda0", "cuda")])
    for r in ("a", "b", "c"):
        router.route(req(r))
    router.on_progress("cuda0", [ProgressEvent("b", "admitted")])
    removed = router.remove_backend("cuda0")
    assert (removed.queued, removed.active) == (["a", "c"], ["b"])
    assert router.backend_ids() == [] and router.backend_of("a") is None
    assert router.on_progress("cuda0", [ProgressEvent("a", "finished")]) == 0  # late, ignored
    with pytest.raises(NoBackendError):
        router.route(req("d"))


def test_rerouting_after_removal_and_add_backend():
    router = Router([spec("cuda0", "cuda"), spec("cpu0", "cpu")])
    router.route(req("a"))
    queued = router.remove_backend("cuda0").queued
    assert [router.route(req(r)).backend_id for r in queued] == ["cpu0"]
    router.add_backend(spec("cuda0", "cuda"))
    assert router.route(req("b")).backend_id == "cuda0"
    with pytest.raises(ValueError, match="already registered"):
        router.add_backend(spec("cuda0", "cuda"))


def test_forget_and_duplicate_req_id():
    router = Router([spec("cuda0", "cuda")])
    router.route(req("a"))
    with pytest.raises(ValueError, match="already pending"):
        router.route(req("a"))
    assert router.forget("a") and not router.forget("a")
    assert router.pending_summary()["cuda0"].num_queued == 0
    router.route(req("a"))  # the id can be used again


def test_finished_request_leaves_router_and_unknown_events_are_ignored():
    router = Router([spec("cuda0", "cuda")])
    router.route(req("a"))
    n = router.on_progress("cuda0", [ProgressEvent("x", "generated", 3), ProgressEvent("a", "finished")])
    assert n == 1 and router.backend_of("a") is None


def test_pending_summary():
    router = Router([spec("cuda0", "cuda", prefill=100, decode=10), spec("cpu0", "cpu")], policy="accelerator-only")
    router.route(req("a", prompt=100, max_tokens=10, cached={"cuda0": 50}))
    router.route(req("b", prompt=30, max_tokens=20))
    router.on_progress("cuda0", [ProgressEvent("a", "generated", 4)])
    s = router.pending_summary()["cuda0"]
    assert (s.num_active, s.num_queued, s.num_prefill_tokens, s.num_decode_tokens) == (1, 1, 30, 26)
    assert s.pending_s == pytest.approx(30 / 100 + 26 / 10)
    assert router.pending_summary()["cpu0"].pending_s == 0.0


def test_missing_cache_report_means_no_reuse():
    router = Router([spec("cuda0", "cuda")])
    rec = router.route(req("a", prompt=100, cached={}))
    assert rec.per_backend["cuda0"].num_prefill_tokens == 100
    assert rec.per_backend["cuda0"].num_cached_tokens == 0


def test_calibration_off_by_default_and_ewma_when_on():
    plain = Router([spec("cuda0", "cuda", prefill=100, decode=10)])
    plain.observe_step("cuda0", 200, 0, 1, 1.0)
    assert plain.rates("cuda0").prefill_tok_s == 100
    router = Router([spec("cuda0", "cuda", prefill=100, decode=10)], calibration=CalibrationConfig(alpha=0.5))
    router.observe_step("cuda0", 200, 0, 1, 1.0)  # observed 200 tok/s
    assert router.rates("cuda0").prefill_tok_s == 150
    router.observe_step("cuda0", 0, 40, 4, 2.0)  # observed 20 tok/s aggregate
    assert router.rates("cuda0").decode_tok_s == 15
    rec = router.route(req("a", prompt=150, max_tokens=15))
    assert rec.per_backend["cuda0"].score_s == pytest.approx(1 + 1)


def test_calibration_is_shared_by_identical_engines_on_one_device():
    """Engines on one device slow each other down: a step observed on one is the device's state,
    so its identical siblings get the same rates; other devices, other profiles and backends
    without a device keep their own."""
    def on(backend_id, device, prefill=100):
        return BackendSpec(backend_id, "cuda", RateProfile(prefill, 10), 4, device)

    router = Router([on("cuda0", "cuda:0"), on("cuda1", "cuda:0"), on("cuda2", "cuda:0", prefill=300),
                     on("cuda3", "cuda:1"), spec("cuda4", "cuda")], calibration=CalibrationConfig(alpha=0.5))
    router.observe_step("cuda0", 0, 20, 4, 4.0)  # 5 tok/s observed against 10 expected
    assert router.rates("cuda0").decode_tok_s == router.rates("cuda1").decode_tok_s == 7.5
    assert [router.rates(b).decode_tok_s for b in ("cuda2", "cuda3", "cuda4")] == [10, 10, 10]
    router.observe_step("cuda1", 200, 0, 1, 1.0)  # the sibling's prefill step: back to cuda0 as well
    assert router.rates("cuda0").prefill_tok_s == router.rates("cuda1").prefill_tok_s == 150
    assert router.rates("cuda0").decode_tok_s == 7.5


@pytest.mark.parametrize("device, expected", [("cuda:0", "cuda0"), (None, "cuda1")])
def test_a_busy_spell_on_a_shared_device_does_not_send_a_cached_prompt_elsewhere(device, expected):
    """The H200 grid's mis-ranking, in miniature: cuda0 ran alone through a contended spell and
    learnt slow rates while cuda1 sat idle. A request whose prompt cuda0 caches must go to cuda0
    when they share a device (the slowness was the device's); calibrated alone, cuda1 looks
    faster and wins although it must prefill the whole prompt."""
    def on(backend_id):
        return BackendSpec(backend_id, "cuda", RateProfile(10_000, 1_000), 4, device)

    router = Router([on("cuda0"), on("cuda1")], calibration=CalibrationConfig(alpha=0.5))
    for _ in range(6):  # decode at a tenth of the profile: the device was busy with its neighbours
        router.observe_step("cuda0", 0, 100, 1, 1.0)
    assert router.rates("cuda0").decode_tok_s < 150
    rec = router.route(req("a", prompt=2_000, max_tokens=128, cached={"cuda0": 2_000}))
    assert rec.backend_id == expected


def test_an_idle_backend_prefills_at_its_alone_rate_not_the_rate_it_learnt_under_load():
    """Mixed steps teach the loaded prefill rate, and it is used while the load lasts. Once the
    backend's ledger empties, its next prefill runs alone: its prefill rate goes back to the one
    calibrated from steps that prefilled alone (the profile's until such a step is seen)."""
    router = Router([spec("cuda0", "cuda", prefill=1_000, decode=100)], calibration=CalibrationConfig(alpha=0.5))
    router.route(req("a", prompt=100, max_tokens=50))
    router.observe_step("cuda0", 500, 0, 1, 0.25)  # alone: 2,000 tok/s
    assert router.rates("cuda0").prefill_tok_s == 1_500
    for _ in range(4):  # beside 8 decoding requests: 500 tok/s
        router.observe_step("cuda0", 492, 8, 9, 1.0)
    loaded = router.rates("cuda0").prefill_tok_s
    assert loaded < 700
    router.on_progress("cuda0", [ProgressEvent("a", "generated", 4)])
    assert router.rates("cuda0").prefill_tok_s == loaded  # still busy: the loaded rate holds
    router.on_progress("cuda0", [ProgressEvent("a", "finished")])
    assert router.rates("cuda0").prefill_tok_s == 1_500
    assert router.rates("cuda0").decode_tok_s == 100  # decode is calibrated per batch size: kept


def test_the_sim16_miss_goes_to_the_idle_engine_not_the_busy_one():
    """The sim*16 grid's light-load tail, in miniature: cuda1 learnt a loaded prefill rate in a
    busy spell, then went idle; cuda0 is running a request. A prompt neither caches must go to
    the idle engine, as it would with the profile's rates."""
    router = Router([spec("cuda0", "cuda", prefill=1_000, decode=100, max_active=8),
                     spec("cuda1", "cuda", prefill=1_000, decode=100, max_active=8)],
                    calibration=CalibrationConfig(alpha=0.5))
    router.route(req("spell", prompt=100, max_tokens=50))
    spell = router.backend_of("spell")
    for _ in range(4):  # prefills beside 8 decoding requests at a third of the profile
        router.observe_step(spell, 992, 8, 9, 3.0)
    router.on_progress(spell, [ProgressEvent("spell", "finished")])
    busy = "cuda1" if spell == "cuda0" else "cuda0"
    router.route(req("running", prompt=10, max_tokens=2, cached={busy: 10}))
    assert router.backend_of("running") == busy
    rec = router.route(req("miss", prompt=2_000, max_tokens=10))
    assert rec.backend_id == spell


def test_an_idle_engine_keeps_the_loaded_rate_while_its_device_is_busy():
    """Engines on one device share the device's calibration; one engine going idle while its
    sibling still runs does not make the device idle."""
    def on(backend_id):
        return BackendSpec(backend_id, "cuda", RateProfile(1_000, 100), 4, "cuda:0")

    router = Router([on("cuda0"), on("cuda1")], calibration=CalibrationConfig(alpha=0.5))
    router.route(req("a", cached={"cuda0": 100}))
    router.route(req("b", cached={"cuda1": 100}))
    assert (router.backend_of("a"), router.backend_of("b")) == ("cuda0", "cuda1")
    router.observe_step("cuda0", 492, 8, 9, 1.0)
    loaded = router.rates("cuda0").prefill_tok_s
    router.on_progress("cuda0", [ProgressEvent("a", "finished")])
    assert router.rates("cuda0").prefill_tok_s == router.rates("cuda1").prefill_tok_s == loaded
    router.forget("b")
    assert router.rates("cuda0").prefill_tok_s == router.rates("cuda1").prefill_tok_s == 1_000


def test_new_token_ratio_scales_existing_budgets_only():
    config = NewTokenRatioConfig(init_ratio=0.5, min_ratio=0.25, decay_steps=10)
    router = Router([spec("cuda0", "cuda", prefill=100, decode=10)], new_token_ratio=config)
    router.route(req("a", prompt=0, max_tokens=100))
    rec = router.route(req("b", prompt=0, max_tokens=100))
    assert rec.per_backend["cuda0"].num_decode_tokens == 0.5 * 100 + 100
    # 4 decode steps (largest token gain in the report): ratio 0.5 - 4 * 0.025 = 0.4
    router.on_progress("cuda0", [ProgressEvent("a", "generated", 4), ProgressEvent("b", "generated", 2)])
    assert router.pending_summary()["cuda0"].new_token_ratio == pytest.approx(0.4)
    router.on_progress("cuda0", [ProgressEvent("a", "finished"), ProgressEvent("b", "aborted")])
    assert router.pending_summary()["cuda0"].new_token_ratio == 0.5  # idle: reset


def test_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="policy: unknown policy 'fastest'"):
        Router([spec("cuda0", "cuda")], policy="fastest")


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="max_tokens"):
        RouteRequest("a", 10, -1)
    with pytest.raises(ValueError, match="unknown ProgressEvent kind"):
        ProgressEvent("a", "done")
    with pytest.raises(ValueError, match="max_active"):
        BackendSpec("cuda0", "cuda", RateProfile(1, 1), max_active=0)


def test_set_policy_cordon_and_max_active_keep_pending_work():
    router = Router([spec("cuda0", "cuda", prefill=100, decode=10), spec("cpu0", "cpu", prefill=100, decode=10)])
    router.route(req("a", prompt=100, max_tokens=10))
    router.set_cordoned("cuda0", True)
    assert router.route(req("b", prompt=100, max_tokens=10)).backend_id == "cpu0"
    router.set_cordoned("cpu0", True)
    with pytest.raises(NoBackendError):
        router.route(req("c", prompt=100, max_tokens=10))
    router.set_cordoned("cuda0", False)
    router.set_cordoned("cpu0", False)
    router.set_policy("accelerator-only")
    assert [router.route(req(f"d{i}", prompt=100, max_tokens=10)).backend_id for i in range(2)] == ["cuda0"] * 2
    assert router.policy == "accelerator-only"
    assert len(router.ledger("cuda0")) == 3 and len(router.ledger("cpu0")) == 1  # nothing was lost
    router.set_max_active("cuda0", 1)
    assert router.score(req("e", prompt=100, max_tokens=10))[0].max_active == 1
