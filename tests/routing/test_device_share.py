"""The router's `device_shares` (routing/device_share.py): backends of one device scored at their
rates divided among its busy engines, and calibration that keeps alone rates; off, or without
devices, nothing changes (the design's worked example included)."""

from pathlib import Path

import pytest

from tandem.routing import BackendSpec, RateProfile, RouteRequest, Router
from tandem.routing.device_share import device_shares
from tandem.routing.rates import CalibrationConfig
from tandem.routing.scenario import load_scenario
from tandem.routing.sim_report import summarize
from tandem.routing.simulator import simulate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "route-sim-examples"
RATES = RateProfile(prefill_tok_s=1000, decode_tok_s=100)


def test_a_share_counts_the_busy_engines_of_the_device_and_the_backend_itself():
    devices = {"a": "cuda:0", "b": "cuda:0", "c": "cuda:0", "d": "cuda:1", "e": None}
    pending = {"a": 2, "b": 0, "c": 1, "d": 0, "e": 5}
    assert device_shares(devices, pending) == {"a": 2, "b": 3, "c": 2, "d": 1, "e": 1}


def two_on_one_device(shares: bool, calibration: CalibrationConfig | None = None, policy: str = "cost") -> Router:
    specs = [BackendSpec(f"g{i}", "cuda", RATES, max_active=4, device="cuda:0") for i in range(2)]
    router = Router(specs, policy, calibration=calibration, device_shares=shares)
    router.route(RouteRequest("busy", num_prompt_tokens=50, max_tokens=5))  # to g0 (tie: lower id)
    return router


def test_waking_an_idle_engine_on_a_busy_device_costs_its_share():
    request = RouteRequest("new", num_prompt_tokens=100, max_tokens=10)
    plain = two_on_one_device(shares=False).route(request)
    # g1 alone: 100/1000 + 10/100 = 0.2 s; g0 with the pending request: 150/1000 + 15/100 = 0.3 s.
    assert plain.per_backend["g1"].score_s == pytest.approx(0.2) and plain.backend_id == "g1"
    shared = two_on_one_device(shares=True).route(request)
    # g1 would be the second busy engine of cuda:0: 0.2 s x 2; g0 is busy already: 0.3 s x 1.
    assert shared.per_backend["g1"].score_s == pytest.approx(0.4)
    assert shared.per_backend["g0"].score_s == pytest.approx(0.3) and shared.backend_id == "g0"


def test_calibration_keeps_the_alone_rate_of_a_step_slowed_by_its_neighbour():
    for shares, expected in ((False, 50.0), (True, 100.0)):
        router = two_on_one_device(shares, CalibrationConfig(alpha=1.0), policy="round-robin")
        assert router.route(RouteRequest("other", num_prompt_tokens=50, max_tokens=5)).backend_id == "g1"
        router.observe_step("g0", 0, 1, 1, elapsed_s=0.02)  # one token in twice the profile's 0.01 s
        assert router.rates("g0").decode_tok_s == pytest.approx(expected)


def test_without_devices_device_shares_change_nothing():
    plain = load_scenario(EXAMPLES / "spec-m2.yaml")
    shared = load_scenario(EXAMPLES / "spec-m2.yaml", overrides=["router.device_shares=true"])
    for policy in ("cost", "accelerator-only"):
        a, b = simulate(plain, policy), simulate(shared, policy)
        assert a.outcomes == b.outcomes
        assert [d.record.to_dict() for d in a.decisions] == [d.record.to_dict() for d in b.decisions]


def test_two_gpus_on_one_device_with_device_shares_pinned():
    """The tenants example's two backends on one device, 200 requests at 40/s: cost with device
    shares against without (measured when the option was added)."""
    ids = ["cuda0", "cuda1"]

    def cost(shares: str):
        scenario = load_scenario(EXAMPLES / "tenants-2gpu.yaml", num_requests=200, overrides=[
            "backends.0.device=cuda:0", "backends.1.device=cuda:0", f"router.device_shares={shares}"])
        s = summarize("cost", simulate(scenario, "cost").outcomes, ids)
        return round(s.cache_hit_rate, 6), round(s.ttft_p95_s, 6), s.num_requests_by_backend

    assert cost("false") == (0.821308, 1.295105, {"cuda0": 116, "cuda1": 84})
    assert cost("true") == (0.856923, 1.026216, {"cuda0": 109, "cuda1": 91})
