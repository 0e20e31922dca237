"""The scenario's `serving:` latency: the serving path's own time before the router, which TTFT
and E2E count from the client's send and the backends never see."""

import pytest

from tandem.routing import ConfigError
from tandem.routing.scenario import parse_scenario
from tandem.routing.sim_report import summarize
from tandem.routing.simulator import simulate

RATES = {"prefill_tok_s": 1000, "decode_tok_s": 100}


def scenario(requests, serving=None):
    data = {"backends": [{"backend_id": "g0", "device_kind": "cuda", "max_active": 4, "rates": RATES}],
            "requests": requests}
    if serving is not None:
        data["serving"] = serving
    return parse_scenario(data, source="test")


def test_a_lone_requests_ttft_and_e2e_grow_by_its_serving_latency():
    request = [{"arrival_s": 0.0, "num_prompt_tokens": 500, "max_tokens": 4}]
    serving = {"fixed_s": 0.01, "per_prompt_token_s": 2e-5}
    (plain,) = simulate(scenario(request), "cost").outcomes
    (served,) = simulate(scenario(request, serving), "cost").outcomes
    assert served.ttft_s == pytest.approx(plain.ttft_s + 0.01 + 500 * 2e-5)
    assert served.e2e_s == pytest.approx(plain.e2e_s + 0.02)
    assert served.arrival_s == pytest.approx(0.02) and served.sent_s == 0.0  # the router saw it then


def test_requests_reach_the_router_in_the_order_their_latency_makes():
    requests = [{"arrival_s": 0.0, "num_prompt_tokens": 4000, "max_tokens": 1},
                {"arrival_s": 0.001, "num_prompt_tokens": 16, "max_tokens": 1}]
    built = scenario(requests, {"per_prompt_token_s": 1e-6})
    assert [r.num_prompt_tokens for r in built.requests] == [16, 4000]
    assert [r.sent_s for r in built.requests] == [0.001, 0.0]
    result = simulate(built, "cost")
    ttft = {o.num_prompt_tokens: o.ttft_s for o in result.outcomes}
    assert ttft[16] == pytest.approx(16e-6 + 16 / 1000)  # ahead of the long prompt at the backend
    assert summarize("cost", result.outcomes, ["g0"]).ttft_p50_s > 0


def test_a_negative_latency_is_refused_naming_its_field():
    with pytest.raises(ConfigError, match="serving.fixed_s"):
        scenario([{"arrival_s": 0.0, "num_prompt_tokens": 16, "max_tokens": 1}], {"fixed_s": -1})
