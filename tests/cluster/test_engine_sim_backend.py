"""route-sim's backend on the engine's scheduler (cluster/engine_sim_backend.py), in virtual
time: exact step times, chunked prefill, prefix hits, evictions reported in route-sim's hashes,
and a whole scenario through `simulate`."""

import pytest

from tandem.cluster.engine_sim_backend import EngineSimBackend, engine_backend_factory
from tandem.routing.rates import RateProfile
from tandem.routing.scenario import parse_scenario
from tandem.routing.sim_backend import SimJob
from tandem.routing.simulator import simulate
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
    assert all(rec.changes.get(h) is False for h in prefix)  # evicted, said in route-sim's hashes
    assert rec.changes.get(206) is True and not any(h > 10**6 for h in rec.changes)


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
