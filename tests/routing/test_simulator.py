"""The router-driven simulator on the design's setting, and its agreement with the oracle's replay."""

import pytest

from tandem.routing.oracle import AssignmentEvaluator
from tandem.routing.scenario import parse_scenario
from tandem.routing.simulator import simulate

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


def _h200_ma1(cpu_slowdown: float, believe_actual: bool, **router) -> dict:
    """The H200 sweep's GPU max_active 1 cell: profiled rates, and a CPU that really runs
    `cpu_slowdown` times slower next to the busy GPU (measured: about 2.4x)."""
    cpu = {1: 31.9, 2: 60.1, 3: 99.4, 4: 93.7}
    actual = {"prefill_tok_s": 817 / cpu_slowdown, "decode_tok_s": 31.9 / cpu_slowdown,
              "decode_tok_s_by_batch": {b: r / cpu_slowdown for b, r in cpu.items()}}
    profiled = {"prefill_tok_s": 817, "decode_tok_s": 31.9, "decode_tok_s_by_batch": cpu}
    return {
        "backends": [
            {"backend_id": "cuda0", "device_kind": "cuda", "max_active": 1,
             "rates": {"prefill_tok_s": 56224, "decode_tok_s": 848}},
            {"backend_id": "cpu0", "device_kind": "cpu", "max_active": 4,
             "rates": actual if believe_actual else profiled, "actual_rates": actual},
        ],
        "generate": {"num_requests": 48, "interval_s": 0.05, "num_prompt_tokens": 516,
                     "num_cached_tokens": 496, "max_tokens": 128},
        "router": router,
    }


def _makespan(result) -> float:
    return max(o.finish_s for o in result.outcomes)


def test_isolated_cpu_rates_make_hybrid_worse_and_calibrated_ones_do_not():
    """Why the cluster calibrates online and the bench warms both backends up together: with
    the isolated profile the router spills to a CPU that is really 2.4x slower and the batch
    ends later than on the GPU alone; with the rates it would have learnt, it keeps the GPU."""
    baseline = _makespan(simulate(parse_scenario(_h200_ma1(2.4, False)), "accelerator-only"))
    fooled = simulate(parse_scenario(_h200_ma1(2.4, False)), "cost")
    assert fooled.assignment.count("cpu0") > 0 and _makespan(fooled) > 1.3 * baseline
    guarded = {"spill_guard": {"margin": 0.05, "allow_queue": False}}
    informed = simulate(parse_scenario(_h200_ma1(2.4, True, **guarded)), "cost")
    assert informed.assignment.count("cpu0") == 0 and _makespan(informed) == pytest.approx(baseline)
    # And where the CPU really is as fast as profiled, the guarded router still spills and gains.
    fast = simulate(parse_scenario(_h200_ma1(1.0, True, **guarded)), "cost")
    assert fast.assignment.count("cpu0") > 0 and _makespan(fast) < 0.97 * baseline
