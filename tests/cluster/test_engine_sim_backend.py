"""route-sim's backend on the engine's scheduler (cluster/engine_sim_backend.py), in virtual
time: exact step times, chunked prefill, prefix hits, evictions reported in route-sim's hashes,
a host KV tier (its reloads timed, its blocks reported by tier), and whole scenarios through
`simulate`."""

import dataclasses

import pytest

from tandem.cluster.engine_sim_backend import EngineSimBackend, engine_backend_factory
from tandem.engine.kv_cache.manager import TIER_DEVICE, TIER_HOST, TIER_NONE
from tandem.routing.errors import ConfigError
from tandem.routing.rates import RateProfile
from tandem.routing.scenario import parse_scenario
from tandem.routing.sim_report import summarize
from tandem.routing.sim_backend import SimJob
from tandem.routing.simulator import make_backend, simulate
from tandem.routing.step_time import StepTimeModel

BS = 16


class Recorder:
    def __init__(self):
        self.events, self.steps, self.changes = [], [], {}

    def on_events(self, backend_id, events):
        self.events.extend((e.req_id, e.kind, e.value) for e in events)

    def on_step(self, backend_id, num_prefill, num_decode, batch_size, elapsed_s):
        self.steps.append((num_prefill, num_decode, round(elapsed_s, 9)))

    def on_cache_changes(self, backend_id, changes):
        self.changes.update(changes)


def job(index, arrival_s, num_prompt, num_output, hashes=()):
    return SimJob(index, f"r{index}", arrival_s, num_prompt, num_prompt, num_output, tuple(hashes))


def backend(num_kv_blocks=64, budget=8192, reporter=None):
    model = StepTimeModel(RateProfile(1000.0, 100.0))  # a prefill token 1 ms, a decode step 10 ms a sequence
    return EngineSimBackend("b", model, max_active=4, num_kv_blocks=num_kv_blocks + 1, block_size=BS,
                            reporter=reporter, max_num_batched_tokens=budget)


def test_a_request_takes_its_prefill_then_one_step_per_token_exactly():
    b, rec = backend(), Recorder()
    b.reporter = rec
    b.enqueue(job(0, 0.0, 100, 3))
    b.run_to_completion()
    (done,) = b.finished
    assert done.first_token_s == pytest.approx(0.1) and done.finish_s == pytest.approx(0.12)
    assert rec.steps == [(100, 0, 0.1), (0, 1, 0.01), (0, 1, 0.01)]
    kinds = [k for _, k, _ in rec.events]
    assert kinds[0] == "admitted" and kinds[-1] == "finished"


def test_planning_a_step_ahead_costs_a_lone_request_nothing():
    sync, planned_ahead = backend(), backend()
    planned_ahead.async_scheduling = True
    for b in (sync, planned_ahead):
        b.reporter = Recorder()
        b.enqueue(job(0, 0.0, 100, 3))
        b.run_to_completion()
    assert planned_ahead.reporter.steps == sync.reporter.steps == [(100, 0, 0.1), (0, 1, 0.01), (0, 1, 0.01)]
    assert planned_ahead.finished[0].finish_s == pytest.approx(0.12)


def test_planning_a_step_ahead_makes_an_arrival_wait_for_the_step_already_planned():
    """r1 arrives while r0's prefill runs. A synchronous engine takes it into the next step; an
    engine that planned that step (r0's first decode) when the prefill started takes it into the
    one after, as a cuda engine does: its first token comes one decode step (10 ms) later."""
    first_token_s = {}
    for planned_ahead in (False, True):
        b = backend()
        b.async_scheduling = planned_ahead
        b.reporter = rec = Recorder()
        b.enqueue(job(0, 0.0, 100, 3))
        b.enqueue(job(1, 0.05, 100, 1))
        b.run_to_completion()
        r0, r1 = sorted(b.finished, key=lambda j: j.index)
        first_token_s[planned_ahead] = r1.first_token_s
        assert r0.first_token_s == pytest.approx(0.1) and [o for _, o in sorted(
            (j.index, j.num_output_tokens) for j in b.finished)] == [3, 1]
        assert rec.events.count(("r1", "finished", 0)) == 1
    assert first_token_s[True] == pytest.approx(first_token_s[False] + 0.01, abs=1e-4)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget():
    b, rec = backend(budget=64), Recorder()
    b.reporter = rec
    b.enqueue(job(0, 0.0, 100, 2))
    b.run_to_completion()
    assert rec.steps == [(64, 0, 0.064), (36, 0, 0.036), (0, 1, 0.01)]
    assert b.finished[0].first_token_s == pytest.approx(0.1)


def test_a_shared_prefix_hits_and_an_evicted_one_is_reported_in_route_sim_hashes():
    b, rec = backend(num_kv_blocks=6), Recorder()
    b.reporter = rec
    prefix = [101, 102, 103]  # three full blocks shared by r0 and r1
    b.enqueue(job(0, 0.0, 64, 1, prefix + [900]))
    b.enqueue(job(1, 1.0, 64, 1, prefix + [901]))
    b.enqueue(job(2, 2.0, 96, 1, [201, 202, 203, 204, 205, 206]))  # needs every block: evicts the prefix
    b.run_to_completion()
    r0, r1, r2 = sorted(b.finished, key=lambda j: j.index)
    assert (r0.num_prefill_tokens, r1.num_prefill_tokens) == (64, 64 - 48)  # r1 reuses the 3 prefix blocks
    assert r2.num_prefill_tokens == 96
    assert all(rec.changes.get(h) == TIER_NONE for h in prefix)  # evicted, said in route-sim's hashes
    assert rec.changes.get(206) == TIER_DEVICE and not any(h > 10**6 for h in rec.changes)


def test_simulate_runs_a_tenants_scenario_on_the_engine_scheduler():
    scenario = parse_scenario({
        "backends": [{"backend_id": f"g{i}", "device_kind": "cuda", "max_active": 8, "num_kv_blocks": 256,
                      "rates": {"prefill_tok_s": 20000, "decode_tok_s": 500, "decode_tok_s_by_batch": {1: 500, 8: 3000}}}
                     for i in range(2)],
        "tenants": {"num_requests": 60, "rate_per_s": 40, "num_tenants": 6, "prefix_tokens": 256,
                    "suffix_tokens": 32, "max_tokens": 8, "seed": 3}}, source="test")
    cost = simulate(scenario, "cost", engine_backend_factory())
    spread = simulate(scenario, "round-robin", engine_backend_factory())
    assert all(o.finish_s > o.first_token_s >= o.arrival_s for o in cost.outcomes)
    assert [o.num_output_tokens for o in cost.outcomes] == [8] * 60
    hits = {name: sum(o.num_cached_tokens for o in r.outcomes) for name, r in (("cost", cost), ("rr", spread))}
    assert hits["cost"] > hits["rr"] > 0  # round-robin prefills each tenant's prefix on both backends


def tier_backend(num_kv_blocks, num_host_kv_blocks, reporter=None):
    # a prefill token 1 ms, a decode step 10 ms a sequence, a reloaded token 0.1 ms
    model = StepTimeModel(RateProfile(1000.0, 100.0, reload_tok_s=10000.0), host_reload_tok_s=10000.0)
    return EngineSimBackend("b", model, max_active=4, num_kv_blocks=num_kv_blocks + 1, block_size=BS,
                            reporter=reporter, num_host_kv_blocks=num_host_kv_blocks, offload_min_hits=0)


def test_a_prefix_evicted_to_the_host_tier_is_reloaded_and_its_step_pays_the_reload():
    b, rec = tier_backend(num_kv_blocks=6, num_host_kv_blocks=16), Recorder()
    b.reporter = rec
    prefix = [101, 102, 103]
    b.enqueue(job(0, 0.0, 64, 1, prefix + [900]))
    b.enqueue(job(1, 1.0, 96, 1, [201, 202, 203, 204, 205, 206]))  # takes every block: the prefix goes to the host
    b.run_to_completion()
    assert all(rec.changes.get(h) == TIER_HOST for h in prefix)
    b.enqueue(job(2, 2.0, 64, 1, prefix + [901]))
    b.run_to_completion()
    r2 = next(j for j in b.finished if j.index == 2)
    assert r2.num_prefill_tokens == 64 - 48  # the prefix's three blocks came back from the host tier
    # 16 tokens computed (16 ms) and 48 reloaded (4.8 ms) in one step
    assert rec.steps[-1] == (16, 0, round(0.016 + 0.0048, 9))
    assert r2.first_token_s == pytest.approx(2.0 + 0.016 + 0.0048)
    assert all(rec.changes.get(h) == TIER_DEVICE for h in prefix)  # published on the device again


def test_without_a_host_tier_the_same_prefix_is_recomputed():
    b = tier_backend(num_kv_blocks=6, num_host_kv_blocks=0)
    prefix = [101, 102, 103]
    for index, (t, hashes) in enumerate(((0.0, prefix + [900]), (1.0, [201, 202, 203, 204, 205, 206]),
                                         (2.0, prefix + [901]))):
        b.enqueue(job(index, t, 16 * len(hashes), 1, hashes))
    b.run_to_completion()
    assert next(j for j in b.finished if j.index == 2).num_prefill_tokens == 64


def tier_scenario(num_host_kv_blocks):
    """Eight tenants' 512-token prefixes (32 blocks each): each GPU's cache of 80 blocks holds two
    of them at most, its host tier all eight."""
    rates = {"prefill_tok_s": 4000, "decode_tok_s": 400, "decode_tok_s_by_batch": {1: 400, 4: 1200},
             "reload_tok_s": 100000}
    return parse_scenario({
        "policy": "cost",
        "backends": [{"backend_id": f"g{i}", "device_kind": "cuda", "max_active": 4, "num_kv_blocks": 80,
                      "num_host_kv_blocks": num_host_kv_blocks, "rates": rates} for i in range(2)],
        "tenants": {"num_requests": 120, "rate_per_s": 8, "num_tenants": 8, "zipf_s": 0.5, "prefix_tokens": 512,
                    "suffix_tokens": 32, "max_tokens": 4, "seed": 1}}, source="test")


def test_a_host_tier_raises_the_hit_rate_and_lowers_ttft_and_the_router_scores_its_reloads():
    with_tier = simulate(tier_scenario(1024), "cost", engine_backend_factory())
    without = simulate(tier_scenario(0), "cost", engine_backend_factory())
    ids = ["g0", "g1"]
    s_with, s_without = summarize("cost", with_tier.outcomes, ids), summarize("cost", without.outcomes, ids)
    assert s_with.cache_hit_rate > s_without.cache_hit_rate
    assert s_with.ttft_p50_s < s_without.ttft_p50_s
    scores = [s for d in with_tier.decisions for s in d.record.per_backend.values()]
    host_scores = [s for s in scores if s.num_host_cached_tokens > 0]
    assert host_scores and all(s.reload_term_s > 0 for s in host_scores)
    assert not any(s.num_host_cached_tokens for d in without.decisions for s in d.record.per_backend.values())


def test_a_host_tier_without_a_reload_rate_is_a_config_error():
    scenario = tier_scenario(1024)
    spec = scenario.backends[0]
    no_rate = dataclasses.replace(spec, actual_rates=dataclasses.replace(spec.actual_rates, reload_tok_s=None))
    with pytest.raises(ConfigError, match="backend g0: a host KV tier .* reload_tok_s"):
        engine_backend_factory()(scenario, no_rate, None, None)


def test_the_simulators_mirror_answers_as_the_live_routers_mirror_does():
    import random

    from tandem.actors.cache_mirror import CacheMirror
    from tandem.routing.tier_mirror import TierMirror

    rng = random.Random(5)
    live, sim = CacheMirror(BS), TierMirror()
    prompts = [tuple(rng.randrange(12) for _ in range(rng.randrange(1, 7))) for _ in range(40)]
    for _ in range(300):
        changes = {rng.randrange(12): rng.choice((TIER_NONE, TIER_DEVICE, TIER_HOST, True, False)) for _ in range(3)}
        live.apply(changes)
        sim.apply(changes)
        for hashes in prompts:
            num_tokens = BS * len(hashes) + rng.choice((0, 5))
            device = live.num_cached_tokens(hashes, num_tokens)
            assert sim.num_cached_tokens(hashes, num_tokens, BS) == device
            assert (sim.num_host_cached_tokens(hashes, num_tokens, BS, device)
                    == live.num_host_cached_tokens(hashes, num_tokens, device))


def test_engines_sharing_a_device_take_turns_on_its_time():
    """Two engines on one device, each with one request: alone each takes 0.1 s of prefill; on
    one device the two prefills run together at half speed and both end at 0.2 s, and the
    device's member boundaries come in time order."""
    from tandem.routing.sim_device import SimDevice

    device, rec = SimDevice("cuda:0"), Recorder()
    model = StepTimeModel(RateProfile(1000.0, 100.0))
    a, b = (EngineSimBackend(name, model, max_active=4, num_kv_blocks=65, block_size=BS, reporter=rec, device=device)
            for name in ("a", "b"))
    a.enqueue(job(0, 0.0, 100, 2))
    b.enqueue(job(1, 0.0, 100, 2))
    a.run_to_completion()  # through the device: b runs too
    assert a.finished[0].first_token_s == pytest.approx(0.2) and b.finished[0].first_token_s == pytest.approx(0.2)
    assert a.finished[0].finish_s == pytest.approx(0.22)  # then one decode step each, together: 2 x 10 ms
    alone = backend()
    alone.enqueue(job(0, 0.0, 100, 2))
    alone.run_to_completion()
    assert alone.finished[0].first_token_s == pytest.approx(0.1)


def test_a_shared_device_scenario_runs_on_the_engine_model_as_on_route_sims_own():
    def scenario(device):
        return parse_scenario({
            "backends": [{"backend_id": f"g{i}", "device_kind": "cuda", "max_active": 8, "device": device,
                          "rates": {"prefill_tok_s": 20000, "decode_tok_s": 500,
                                    "decode_tok_s_by_batch": {1: 500, 8: 3000}}} for i in range(2)],
            "tenants": {"num_requests": 60, "rate_per_s": 40, "num_tenants": 8, "prefix_tokens": 256,
                        "suffix_tokens": 64, "max_tokens": 16, "seed": 5}}, source="test")

    def run(scenario, factory=None):
        return summarize("cost", simulate(scenario, "cost", factory).outcomes, ["g0", "g1"])

    shared = run(scenario("cuda:0"), engine_backend_factory(async_scheduling=False))
    apart = run(scenario(None), engine_backend_factory(async_scheduling=False))
    own = run(scenario("cuda:0"))
    assert sum(shared.num_requests_by_backend.values()) == 60 and min(shared.num_requests_by_backend.values()) > 0
    assert shared.ttft_p50_s > 2 * apart.ttft_p50_s  # one device's time, shared, against two devices'
    # route-sim's own scheduler (prefill first, no chunks, synchronous) and the engine's agree within 2x
    assert own.ttft_p50_s / 2 < shared.ttft_p50_s < own.ttft_p50_s * 2
    # planning a step ahead, as a cuda engine does, costs an arrival about one step more
    assert run(scenario("cuda:0"), engine_backend_factory()).ttft_p50_s > shared.ttft_p50_s


# -- `tandem route-sim`: the engine model by default ---------------------------------------------
def run_route_sim(capsys, *argv):
    import argparse

    from tandem.cluster import route_sim_cli

    parser = argparse.ArgumentParser()
    route_sim_cli.add_arguments(parser)
    code = route_sim_cli.run(parser.parse_args([str(a) for a in argv]))
    return code, capsys.readouterr()


def summaries(out):
    import json

    return {d["name"]: d for d in map(json.loads, (l for l in out.splitlines() if l.startswith("{")))
            if d["type"] in ("summary", "oracle")}


def test_route_sim_runs_a_cache_scenario_on_the_engine_model_unless_asked_for_its_fast_backends(capsys, tmp_path):
    import yaml

    path = tmp_path / "tier.yaml"
    raw = {"policy": "cost", "block_size": 16,
           "backends": [{"backend_id": f"g{i}", "device_kind": "cuda", "max_active": 4, "num_kv_blocks": 80,
                         "num_host_kv_blocks": 1024,
                         "rates": {"prefill_tok_s": 4000, "decode_tok_s": 400, "reload_tok_s": 100000}}
                        for i in range(2)],
           "tenants": {"num_requests": 40, "rate_per_s": 8, "num_tenants": 8, "prefix_tokens": 512,
                       "suffix_tokens": 32, "max_tokens": 4, "seed": 1}}
    path.write_text(yaml.safe_dump(raw))
    code, captured = run_route_sim(capsys, path, "--no-decisions")
    assert code == 0, captured.err  # only the engine model has a host tier to run
    assert summaries(captured.out)["cost"]["cache_hit_rate"] > 0
    code, captured = run_route_sim(capsys, path, "--no-decisions", "--fast-backends")
    assert code == 2 and "route-sim's own backends do not model a host KV tier" in captured.err


def test_a_fixed_hit_scenario_runs_on_route_sims_own_backends_either_way(capsys):
    from pathlib import Path

    # the design's experiment: fixed hits, no cache to model
    example = Path(__file__).resolve().parents[2] / "docs" / "route-sim-examples" / "spec-m2.yaml"
    default = run_route_sim(capsys, example, "--no-decisions")
    fast = run_route_sim(capsys, example, "--no-decisions", "--fast-backends")
    assert default[0] == fast[0] == 0
    assert summaries(default[1].out) == summaries(fast[1].out)
    assert "oracle" in summaries(default[1].out)


def step_budgets(scenario, **kwargs):
    make = engine_backend_factory(**kwargs)
    return {s.spec.backend_id: make(scenario, s, None, None).scheduler.config.max_num_batched_tokens
            for s in scenario.backends}


def test_each_backend_steps_with_its_scenarios_budget_else_its_device_kinds_engine_default():
    rates = {"prefill_tok_s": 4000, "decode_tok_s": 400}
    scenario = parse_scenario({
        "backends": [{"backend_id": "c", "device_kind": "cpu", "rates": rates},
                     {"backend_id": "g", "device_kind": "cuda", "rates": rates},
                     {"backend_id": "s", "device_kind": "sim", "rates": rates},
                     {"backend_id": "m", "device_kind": "mps", "rates": rates},
                     {"backend_id": "x", "device_kind": "cuda", "rates": rates, "max_num_batched_tokens": 1024}],
        "tenants": {"num_requests": 1, "rate_per_s": 1, "num_tenants": 1, "prefix_tokens": 16,
                    "suffix_tokens": 16, "max_tokens": 1}}, source="test")
    assert step_budgets(scenario) == {"c": 512, "g": 8192, "s": 8192, "m": 2048, "x": 1024}
    assert set(step_budgets(scenario, max_num_batched_tokens=256).values()) == {256}
    # and plans a step ahead where the engine on that kind does (engine/config.py's rule)
    make = engine_backend_factory()
    assert {s.spec.backend_id: make(scenario, s, None, None).async_scheduling for s in scenario.backends} == {
        "c": False, "g": True, "s": True, "m": False, "x": True}


def test_a_scenarios_step_time_block_times_the_steps_of_both_backend_models():
    """A backend's `step_time` (a sim profile's context cost by batch, its prefill table) times
    its steps on the engine model and on route-sim's own; without it, the rates alone do."""
    rates = {"prefill_tok_s": 4000, "decode_tok_s": 400}
    extras = {"decode_s_per_context_token_by_batch": {1: 1e-4, 8: 1e-5}, "prefill_tok_s_by_tokens": {64: 1000}}
    scenario = parse_scenario({
        "backends": [{"backend_id": "t", "device_kind": "cuda", "rates": rates, "step_time": extras},
                     {"backend_id": "r", "device_kind": "cuda", "rates": rates}],
        "tenants": {"num_requests": 1, "rate_per_s": 1, "num_tenants": 1, "prefix_tokens": 16,
                    "suffix_tokens": 16, "max_tokens": 1}}, source="test")
    timed, plain = scenario.backends
    for make in (engine_backend_factory(), make_backend):
        model = make(scenario, timed, None, None).step_time
        assert model.step_s(0, 1, 1000) == pytest.approx(1 / 400 + 1000 * 1e-4)
        assert model.step_s(64, 0) == pytest.approx(64 / 1000)
        assert make(scenario, plain, None, None).step_time.step_s(0, 1, 1000) == pytest.approx(1 / 400)
    with pytest.raises(ConfigError, match="step_time.decode_s_per_context_token_by_batch"):
        parse_scenario({"backends": [{"backend_id": "t", "device_kind": "cuda", "rates": rates,
                                      "step_time": {"decode_s_per_context_token_by_batch": {1: -1.0}}}],
                        "requests": [{"arrival_s": 0, "num_prompt_tokens": 4, "max_tokens": 1}]}, source="test")


def test_the_oracle_replays_on_the_model_the_policies_ran_on():
    from tandem.routing.oracle import find_oracle

    made = []

    def counting(scenario, sim_spec, reporter, device):
        backend = engine_backend_factory()(scenario, sim_spec, reporter, device)
        made.append(type(backend).__name__)
        return backend

    scenario = parse_scenario({
        "backends": [{"backend_id": f"g{i}", "device_kind": "cuda", "num_kv_blocks": 8,
                      "rates": {"prefill_tok_s": 4000, "decode_tok_s": 400}} for i in range(2)],
        "tenants": {"num_requests": 6, "rate_per_s": 20, "num_tenants": 2, "prefix_tokens": 32,
                    "suffix_tokens": 16, "max_tokens": 2, "seed": 3}}, source="test")
    oracle = find_oracle(scenario, backend_factory=counting)
    assert made and set(made) == {"EngineSimBackend"}
    assert oracle.method == "exhaustive over 64 assignments"
    first_arrival_s = min(r.arrival_s for r in scenario.requests)
    for policy in ("cost", "round-robin"):  # no policy beats the oracle on the oracle's own model
        outcomes = simulate(scenario, policy, engine_backend_factory()).outcomes
        assert oracle.makespan_s <= max(o.finish_s for o in outcomes) - first_arrival_s + 1e-9


def test_a_measured_host_floor_lengthens_the_steps_the_device_would_finish_sooner():
    """`host_s_per_step_by_batch` (the engine's host work per step behind the server): a step of
    the engine model lasts the longer of its device time and that floor, so decode steps shorter
    than the floor slow a request down and a prefill longer than it does not. A scenario's
    `step_time` block carries it to the engine model."""
    model = StepTimeModel(RateProfile(1000.0, 100.0), host_s_per_step_by_batch={1: 0.025})
    b, rec = EngineSimBackend("b", model, max_active=4, num_kv_blocks=65, block_size=BS), Recorder()
    b.reporter = rec
    b.enqueue(job(0, 0.0, 100, 3))
    b.run_to_completion()
    (done,) = b.finished
    assert done.first_token_s == pytest.approx(0.1) and done.finish_s == pytest.approx(0.15)
    assert [elapsed for _, _, elapsed in rec.steps] == [0.1, 0.025, 0.025]
    scenario = parse_scenario({
        "backends": [{"backend_id": "f", "device_kind": "cuda", "rates": {"prefill_tok_s": 1000, "decode_tok_s": 100},
                      "step_time": {"host_s_per_step_by_batch": {1: 0.025}}}],
        "tenants": {"num_requests": 1, "rate_per_s": 1, "num_tenants": 1, "prefix_tokens": 16,
                    "suffix_tokens": 16, "max_tokens": 1}}, source="test")
    engine_model = engine_backend_factory()(scenario, scenario.backends[0], None, None)
    assert isinstance(engine_model, EngineSimBackend) and engine_model.step_time.floor_s(4) == 0.025
