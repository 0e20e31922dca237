"""Backends that share a device (routing/sim_device.py): processor sharing of their steps,
checked on hand-computed timelines; separate or unnamed devices give the old results exactly."""

from pathlib import Path

import pytest

from tandem.routing import ConfigError, RateProfile
from tandem.routing.oracle import AssignmentEvaluator, find_oracle
from tandem.routing.scenario import load_scenario, parse_scenario
from tandem.routing.sim_backend import SimBackend, SimJob
from tandem.routing.sim_device import SimDevice
from tandem.routing.sim_report import summarize
from tandem.routing.simulator import simulate

TENANTS = Path(__file__).resolve().parents[2] / "docs" / "route-sim-examples" / "tenants-2gpu.yaml"
RATES = RateProfile(prefill_tok_s=100, decode_tok_s=10)  # 10 prompt tokens: 0.1 s; a decode step: 0.1 s


def job(index: int, arrival: float, prefill: int, outputs: int) -> SimJob:
    return SimJob(index, f"r{index}", arrival, num_prompt_tokens=prefill,
                  num_prefill_tokens=prefill, num_output_tokens_target=outputs)


def backends_on(device: SimDevice | None, n: int = 2) -> list[SimBackend]:
    return [SimBackend(f"b{i}", RATES, max_active=1, device=device) for i in range(n)]


def run(backends: list[SimBackend], jobs: list[SimJob]) -> list[tuple[float, float]]:
    for backend, j in zip(backends, jobs):
        backend.enqueue(j)
    for backend in backends:
        backend.run_to_completion()
    return [(j.first_token_s, j.finish_s) for j in jobs]


def test_two_busy_backends_on_one_device_take_twice_as_long_per_step():
    # Alone: prefill 0.1 s, then two decode steps of 0.1 s: first token at 0.1, done at 0.3.
    alone = run(backends_on(None), [job(0, 0.0, 10, 3), job(1, 0.0, 10, 3)])
    assert alone == [pytest.approx((0.1, 0.3))] * 2
    shared = run(backends_on(SimDevice("cuda:0")), [job(0, 0.0, 10, 3), job(1, 0.0, 10, 3)])
    assert shared == [pytest.approx((0.2, 0.6))] * 2


def test_a_step_is_retimed_when_a_neighbour_starts_and_stops():
    # b0's prefill is 0.3 s of work. Alone until 0.1 (0.2 left); b1's 0.1 s prefill then halves
    # both: b1 ends at 0.3 and b0, with 0.1 left, runs alone again and ends at 0.4.
    first, second = run(backends_on(SimDevice("cuda:0")), [job(0, 0.0, 30, 1), job(1, 0.1, 10, 1)])
    assert first == pytest.approx((0.4, 0.4))
    assert second == pytest.approx((0.3, 0.3))


def test_the_device_delivers_one_profile_of_work_in_all():
    # Three backends, each 0.2 s of prefill and 4 decode steps (0.6 s of work): 1.8 s in all,
    # all busy throughout, so every one finishes at 1.8.
    jobs = [job(i, 0.0, 20, 5) for i in range(3)]
    assert run(backends_on(SimDevice("cuda:0"), 3), jobs) == [pytest.approx((0.6, 1.8))] * 3


def tenants_on(devices: list[str | None], num_requests: int | None = None):
    overrides = [f"backends.{i}.device={d}" for i, d in enumerate(devices) if d is not None]
    return load_scenario(TENANTS, num_requests=num_requests, overrides=overrides)


def test_without_device_or_on_separate_devices_results_are_unchanged():
    """The example's cost run, pinned before devices existed (600 requests, 2 GPUs)."""
    results = [simulate(tenants_on(devices), "cost").outcomes
               for devices in ([None, None], ["cuda:0", "cuda:1"], ["cuda:0", None])]
    assert results[0] == results[1] == results[2]
    s = summarize("cost", results[0], ["cuda0", "cuda1"])
    assert (round(s.makespan_s, 6), round(s.ttft_p95_s, 6), round(s.cache_hit_rate, 6)) == \
        (14.749428, 0.110922, 0.919231)
    assert s.num_requests_by_backend == {"cuda0": 336, "cuda1": 264}


def test_sharing_one_device_slows_the_tenants_example():
    alone = summarize("cost", simulate(tenants_on([None, None], 200), "cost").outcomes, ["cuda0", "cuda1"])
    shared = summarize("cost", simulate(tenants_on(["cuda:0", "cuda:0"], 200), "cost").outcomes,
                       ["cuda0", "cuda1"])
    assert shared.ttft_p95_s > alone.ttft_p95_s and shared.e2e_p50_s > alone.e2e_p50_s


def test_router_driven_run_and_fixed_assignment_replay_agree_on_a_shared_device():
    scenario = tenants_on(["cuda:0", "cuda:0"], 200)
    result = simulate(scenario, "round-robin")
    evaluator = AssignmentEvaluator(scenario)
    assert evaluator.units == [(0, 1)]
    index_of = {b: i for i, b in enumerate(evaluator.backend_ids)}
    assert evaluator.outcomes(tuple(index_of[b] for b in result.assignment)) == result.outcomes


def generate_scenario(devices: list[str]) -> dict:
    return {"backends": [{"backend_id": f"g{i}", "device_kind": "cuda", "device": d,
                          "rates": {"prefill_tok_s": 100, "decode_tok_s": 10}} for i, d in enumerate(devices)],
            "generate": {"num_requests": 2, "interval_s": 0, "num_prompt_tokens": 10, "max_tokens": 3}}


def test_oracle_replays_a_shared_device_as_one():
    # Two requests of 0.1 s prefill and two decode steps. Both on one backend: a 0.2 s prefill
    # and two decode steps of a batch of 2 (0.2 s each) end at 0.6 s; one on each backend of a
    # shared device ends at 0.6 s too (every step at half speed); on two devices, at 0.3 s.
    shared = find_oracle(parse_scenario(generate_scenario(["cuda:0", "cuda:0"])))
    separate = find_oracle(parse_scenario(generate_scenario(["cuda:0", "cuda:1"])))
    assert shared.makespan_s == pytest.approx(0.6)
    assert separate.makespan_s == pytest.approx(0.3)


def test_one_device_of_two_kinds_is_an_error():
    data = generate_scenario(["x", "x"])
    data["backends"][1]["device_kind"] = "cpu"
    with pytest.raises(ConfigError, match="device 'x' have different device_kind"):
        parse_scenario(data)
