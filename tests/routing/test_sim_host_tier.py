"""route-sim and a host KV tier: the scenario field, the router-side mirror that keeps the two
tiers apart (device hit, then the host run after it, as the live router answers), and routing's
own backends refusing a tier they do not model."""

import argparse
import json

import pytest

from tandem.routing import ConfigError, sim_cli
from tandem.routing.router import Router
from tandem.routing.scenario import parse_scenario
from tandem.routing.simulator import _RouterReporter, route_request, simulate
from tandem.routing.tier_mirror import EVICTED, ON_DEVICE, ON_HOST, TierMirror

RATES = {"prefill_tok_s": 1000, "decode_tok_s": 100, "reload_tok_s": 20000}


def scenario_data(**backend):
    return {"backends": [{"backend_id": "g0", "device_kind": "cuda", "num_kv_blocks": 64, "rates": RATES, **backend},
                         {"backend_id": "g1", "device_kind": "cuda", "rates": RATES}],
            "block_size": 16,
            # 48 prefix tokens (3 shared blocks) + 16 of the request's own: 64 tokens, 4 full blocks
            "tenants": {"num_requests": 4, "rate_per_s": 1, "num_tenants": 1, "prefix_tokens": 48,
                        "suffix_tokens": 16, "max_tokens": 2}}


# -- the scenario ------------------------------------------------------------------------------
def test_a_backend_may_have_a_host_tier_and_its_rates_a_reload_rate():
    scenario = parse_scenario(scenario_data(num_host_kv_blocks=256))
    g0, g1 = scenario.backends
    assert (g0.num_host_kv_blocks, g1.num_host_kv_blocks) == (256, 0)
    assert g0.spec.rates.reload_tok_s == g0.actual_rates.reload_tok_s == 20000
    actual = {**RATES, "reload_tok_s": 5000}
    g0 = parse_scenario(scenario_data(num_host_kv_blocks=8, actual_rates=actual)).backends[0]
    assert (g0.spec.rates.reload_tok_s, g0.actual_rates.reload_tok_s) == (20000, 5000)


@pytest.mark.parametrize("backend, message", [
    ({"num_host_kv_blocks": -1}, "backends.0.num_host_kv_blocks: Input should be greater than or equal to 0"),
    ({"num_host_kv_blocks": 8, "rates": {"prefill_tok_s": 1000, "decode_tok_s": 100}},
     "backends.0.num_host_kv_blocks: .* give backends.0.rates.reload_tok_s"),
    ({"num_host_kv_blocks": 8, "actual_rates": {"prefill_tok_s": 1000, "decode_tok_s": 100}},
     "backends.0.num_host_kv_blocks: .* give backends.0.actual_rates.reload_tok_s"),
    ({"rates": {**RATES, "reload_tok_s": 0}}, "backends.0.rates.reload_tok_s: Input should be greater than 0"),
])
def test_host_tier_errors_name_their_field(backend, message):
    with pytest.raises(ConfigError, match=message):
        parse_scenario(scenario_data(**backend))


def test_a_host_tier_needs_a_tenants_section():
    data = scenario_data(num_host_kv_blocks=8)
    data["backends"][0].pop("num_kv_blocks")
    data.pop("tenants")
    data["generate"] = {"num_requests": 1, "interval_s": 0, "num_prompt_tokens": 5, "max_tokens": 1}
    with pytest.raises(ConfigError, match="num_host_kv_blocks needs a tenants: section"):
        parse_scenario(data)


# -- routing's own backends ----------------------------------------------------------------------
def test_routings_own_backends_refuse_a_host_tier_and_name_the_engine_model(capsys, tmp_path):
    scenario = parse_scenario(scenario_data(num_host_kv_blocks=8))
    with pytest.raises(ConfigError, match=r"backend g0: num_host_kv_blocks \(8\).*without --fast-backends"):
        simulate(scenario, "cost")
    path = tmp_path / "tier.json"
    path.write_text(json.dumps(scenario_data(num_host_kv_blocks=8)))
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    assert sim_cli.run(parser.parse_args([str(path), "--no-decisions"])) == 2
    assert "tandem route-sim without --fast-backends" in capsys.readouterr().err
    assert sim_cli.run(parser.parse_args([str(path), "--no-decisions", "--set", "backends.0.num_host_kv_blocks=0"])) == 0


# -- the router-side mirror ------------------------------------------------------------------------
def test_the_mirror_keeps_the_tiers_apart_and_reads_booleans_as_device_and_evicted():
    mirror = TierMirror()
    mirror.apply({1: ON_DEVICE, 2: ON_HOST, 3: True, 4: ON_HOST})
    assert (mirror.device, mirror.host) == ({1, 3}, {2, 4})
    mirror.apply({2: ON_DEVICE, 3: ON_HOST, 4: EVICTED, 1: False})
    assert (mirror.device, mirror.host) == ({2}, {3})


def reporter_and_request():
    scenario = parse_scenario(scenario_data(num_host_kv_blocks=64))
    router = Router(scenario.backend_specs, "cost")
    reporter = _RouterReporter(router, ["g0", "g1"])
    return scenario, router, reporter, scenario.requests[0]


def test_a_request_is_told_the_device_hit_and_the_host_run_after_it():
    scenario, _, reporter, request = reporter_and_request()
    h = request.block_hashes
    assert len(h) == 4 and request.num_prompt_tokens == 64
    reporter.on_cache_changes("g0", {h[0]: ON_DEVICE, h[1]: ON_HOST, h[2]: ON_HOST})
    reporter.on_cache_changes("g1", {h[0]: True, h[1]: True})  # a backend without a tier: booleans
    routed = route_request(request, scenario, reporter)
    assert routed.num_cached_tokens == {"g0": 16, "g1": 32}
    assert routed.num_host_cached_tokens == {"g0": 32}  # backends without a host run are left out
    # The run stops at the first block neither tier holds, and never covers the last token.
    reporter.on_cache_changes("g0", {h[0]: ON_HOST, h[2]: EVICTED})
    assert route_request(request, scenario, reporter).num_host_cached_tokens == {"g0": 32}
    reporter.on_cache_changes("g0", {h[2]: ON_HOST, h[3]: ON_HOST})
    routed = route_request(request, scenario, reporter)
    assert (routed.num_cached_tokens["g0"], routed.num_host_cached_tokens) == (0, {"g0": 48})  # 63 tokens: 3 blocks


def test_the_router_scores_the_host_run_at_its_reload_time():
    scenario, router, reporter, request = reporter_and_request()
    h = request.block_hashes
    reporter.on_cache_changes("g0", {h[0]: ON_HOST, h[1]: ON_HOST, h[2]: ON_HOST})
    record = router.route(route_request(request, scenario, reporter))
    g0, g1 = record.per_backend["g0"], record.per_backend["g1"]
    assert (g0.num_host_cached_tokens, g0.reload_term_s) == (48, pytest.approx(48 / 20000))
    assert (g1.num_host_cached_tokens, g1.reload_term_s) == (0, 0.0)
    assert record.backend_id == "g0"  # a reload is cheaper than g1's prefill
