"""The router-driven simulator on the spec's setting, and its agreement with the oracle's replay."""

import pytest

from routing.oracle import AssignmentEvaluator
from routing.scenario import parse_scenario
from routing.simulator import simulate

from routing_test_helpers import random_scenario, spec_scenario


def test_accelerator_only_makespan_is_the_gpu_work():
    result = simulate(parse_scenario(spec_scenario()), "accelerator-only")
    assert result.assignment == ["mps0"] * 8
    # The GPU never idles after the first arrival: 8 prefills of 20 tokens, 8 x 127 decode tokens
    # (the prefill step yields each first token).
    makespan = max(o.finish_s for o in result.outcomes)
    assert makespan == pytest.approx(8 * 20 / 2551 + 8 * 127 / 293, rel=1e-12)


def test_cost_sends_request_8_to_the_idle_cpu():
    result = simulate(parse_scenario(spec_scenario()), "cost")
    assert result.assignment == ["mps0"] * 7 + ["cpu0"]
    r8 = result.outcomes[7]
    assert r8.finish_s == pytest.approx(0.35 + 20 / 73 + 127 / 45, rel=1e-12)
    rec7 = result.decisions[6].record
    assert (rec7.per_backend["mps0"].num_active, rec7.per_backend["mps0"].num_queued) == (4, 2)
    assert rec7.per_backend["mps0"].num_prefill_tokens == 60  # queued requests kept their discount


def test_router_ledger_is_empty_after_the_run():
    result = simulate(parse_scenario(spec_scenario(12)), "cost")
    assert len(result.decisions) == 12
    assert all(o.finish_s > o.first_token_s > o.arrival_s for o in result.outcomes)


def test_new_token_ratio_and_calibration_run_in_the_simulator():
    plain = simulate(parse_scenario(spec_scenario(16)), "cost")
    discounted = simulate(parse_scenario(spec_scenario(16, new_token_ratio={})), "cost")
    # Discounting the GPU's queued budgets makes it look emptier: fewer requests spill to the CPU.
    assert discounted.assignment.count("cpu0") <= plain.assignment.count("cpu0")
    scenario = spec_scenario(16, calibration={"alpha": 0.5})
    scenario["backends"][0]["actual_rates"] = {"prefill_tok_s": 2551, "decode_tok_s": 150}
    calibrated = simulate(parse_scenario(scenario), "cost")
    last = calibrated.decisions[-1].record.per_backend["mps0"]
    assert 150 <= last.decode_tok_s < 200  # moved from the profile's 293 toward the real 150


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("policy", ["cost", "round-robin"])
def test_router_driven_run_and_fixed_assignment_replay_agree_exactly(seed, policy):
    scenario = parse_scenario(random_scenario(seed))
    result = simulate(scenario, policy)
    evaluator = AssignmentEvaluator(scenario)
    index_of = {b: i for i, b in enumerate(evaluator.backend_ids)}
    replayed = evaluator.outcomes(tuple(index_of[b] for b in result.assignment))
    assert replayed == result.outcomes  # bit-identical times
