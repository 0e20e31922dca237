"""The oracle split: exhaustive for small N, local search otherwise, never worse than a policy."""

import pytest

from tandem.routing.oracle import find_oracle
from tandem.routing.scenario import parse_scenario
from tandem.routing.simulator import simulate

from routing_test_helpers import random_scenario, spec_scenario


def test_spec_8_requests_oracle_sends_the_first_request_to_the_cpu():
    scenario = parse_scenario(spec_scenario(8))
    oracle = find_oracle(scenario)
    assert oracle.method.startswith("exhaustive over 256")
    assert oracle.assignment == ["cpu0"] + ["mps0"] * 7
    # CPU: r1 alone from t=0. GPU: r2..r8 from t=0.05, never idle.
    assert oracle.makespan_s == pytest.approx(0.05 + 7 * 20 / 2551 + 7 * 127 / 293, rel=1e-12)
    assert oracle.makespan_s < max(o.finish_s for o in simulate(scenario, "cost").outcomes)


@pytest.mark.parametrize("num_requests", [6, 9])
def test_local_search_matches_exhaustive_on_the_spec_setting(num_requests):
    scenario = parse_scenario(spec_scenario(num_requests))
    exhaustive = find_oracle(scenario)
    local = find_oracle(scenario, exhaustive_max=0)
    assert local.method.startswith("local search")
    assert local.makespan_s == exhaustive.makespan_s


@pytest.mark.parametrize("seed", range(8))
def test_oracle_is_never_worse_than_the_policies(seed):
    scenario = parse_scenario(random_scenario(seed))
    results = [simulate(scenario, p) for p in ("cost", "accelerator-only", "least-requests")]
    for exhaustive_max in (2**16, 0):
        oracle = find_oracle(scenario, [r.assignment for r in results], exhaustive_max=exhaustive_max)
        for result in results:
            assert oracle.makespan_s <= max(o.finish_s for o in result.outcomes) - scenario.requests[0].arrival_s


def test_24_requests_uses_local_search_and_beats_accelerator_only():
    scenario = parse_scenario(spec_scenario(24))
    baseline = simulate(scenario, "accelerator-only")
    oracle = find_oracle(scenario, [baseline.assignment])
    assert oracle.method.startswith("local search")
    assert oracle.makespan_s < max(o.finish_s for o in baseline.outcomes)
    assert oracle.assignment.count("cpu0") == 3
