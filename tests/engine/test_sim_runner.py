"""The sim device's runner: the step shape it times, when each step's ids are ready, its
pseudo-random ids, and an engine on it behaving like an engine (prefix cache, stops, refusals)."""

import time

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.sim_runner import SimModelRunner, TokenSpace, request_seed, step_shape

BS = 4


def make_scheduler(budget=64):
    return Scheduler(SchedulerConfig(max_active=4, max_num_batched_tokens=budget, block_size=BS, num_blocks=64))


def add(sched, req_id, prompt, max_tokens=4, seed=None):
    req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, seed=seed), (0,))
    sched.add_request(req)
    return req


def test_step_shape_counts_prefill_tokens_decoding_sequences_and_their_context():
    sched = make_scheduler()
    add(sched, "a", list(range(1, 11)))  # 10 tokens
    first = sched.schedule()
    assert step_shape(first) == (10, 0, 0)
    sched.update_from_output(first, {"a": 5})
    add(sched, "b", list(range(100, 106)))  # 6 tokens of its own, joins a's decode
    second = sched.schedule()
    # a decodes its 11th token over the 10 computed + the one it feeds; b prefills 6.
    assert step_shape(second) == (6, 1, 11)


def test_steps_run_one_after_another_on_the_emulated_device():
    runner = SimModelRunner(lambda p, d, c: 0.05, TokenSpace(1000, frozenset()))
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3])
    step = sched.schedule()
    before = time.perf_counter()
    first = runner.launch(step, None, {})
    second = runner.launch(step, None, {})  # launched while the first still runs: starts at its end
    assert first.ready_at >= before + 0.05
    assert second.ready_at == pytest.approx(first.ready_at + 0.05, abs=1e-9)
    assert len(first.tokens()) == 1 and time.perf_counter() >= first.ready_at


def test_ids_are_a_function_of_seed_and_position_and_skip_excluded_ids():
    space = TokenSpace(8, frozenset({0, 1, 2, 3, 4, 5, 6}))
    assert {space.token(request_seed(3, []), i) for i in range(50)} == {7}
    wide = TokenSpace(50_000, frozenset({2}))
    by_seed = [wide.token(request_seed(11, [1, 2]), i) for i in range(16)]
    assert by_seed == [wide.token(request_seed(11, [9]), i) for i in range(16)]  # the seed, not the prompt
    assert len(set(by_seed)) == 16
    by_prompt = [wide.token(request_seed(None, [1, 2]), i) for i in range(16)]
    assert by_prompt == [wide.token(request_seed(None, [1, 2]), i) for i in range(16)]
    assert by_prompt != [wide.token(request_seed(None, [1, 3]), i) for i in range(16)]


def sim_engine(step_s=0.0, **overrides):
    config = EngineConfig(model="tiny-llama-random", device="sim", max_active=4, num_kv_blocks=64, **overrides)
    return LLMEngine(config, step_time=lambda p, d, c: step_s)


def run(engine, requests):
    for req_id, prompt, params in requests:
        engine.add_request(req_id, prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.req_id, []).append(out)
    return outputs


def test_an_engine_on_the_sim_device_serves_through_its_real_cache_and_detokenizer():
    prompt = list(range(10, 74))  # 64 tokens: 4 full blocks of 16
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = run(sim_engine(), [("a", prompt, params)])
    outputs.update(run_engine := run(sim_engine(), [("x", prompt, params)]))
    ids_a = [t for out in outputs["a"] for t in out.new_token_ids]
    assert len(ids_a) == 8 and ids_a == [t for out in run_engine["x"] for t in out.new_token_ids]

    engine = sim_engine()
    first = run(engine, [("a", prompt, params)])["a"]
    again = run(engine, [("b", prompt, params)])["b"]
    assert first[-1].usage.cached_tokens == 0 and again[-1].usage.cached_tokens == 48  # 3 blocks (last token recomputed)
    assert [t for o in again for t in o.new_token_ids] == ids_a  # same prompt, same output
    text = "".join(o.new_text for o in first)
    assert first[-1].finished and first[-1].finish_reason == "length" and len(text) > 0


def test_a_stop_string_ends_a_sim_request_as_it_would_a_real_one():
    engine = sim_engine()
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = "".join(o.new_text for o in run(engine, [("a", prompt, params)])["a"])
    stop = full[3:5]
    cut = run(engine, [("b", prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))])["b"]
    assert cut[-1].finish_reason == "stop" and "".join(o.new_text for o in cut) == full[:full.index(stop)]


def test_a_sim_device_refuses_what_it_cannot_emulate_and_needs_its_timing():
    engine = sim_engine()
    with pytest.raises(InvalidRequestError, match="logprobs"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    with pytest.raises(ValueError, match="step_time"):
        LLMEngine(EngineConfig(model="tiny-llama-random", device="sim"))
    with pytest.raises(ValueError, match="step_time"):
        LLMEngine(EngineConfig(model="tiny-llama-random", device="cpu"), step_time=lambda p, d, c: 0.0)


def test_the_context_cost_measured_on_a_sim_engine_is_the_one_it_runs_with():
    """The profiler's context cost, measured where prompts are prefilled a chunk per step (so a
    measured run's first requests would decode beside the others' prefill), comes back as the
    sim's own coefficient: its decode steps are all at the full batch. The coefficient makes a
    step 10 ms longer, far above the host's own time per step."""
    from tandem.engine.profiler import measure_context_cost

    cost = 5e-6  # seconds per context token per step
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", device="sim", max_active=8, num_kv_blocks=2048,
                                    max_num_batched_tokens=512),
                       step_time=lambda p, d, c: 0.001 * d + cost * c)
    measured = measure_context_cost(engine, context_len=512, decode_tokens=8, repeats=1)
    assert measured == pytest.approx(cost, rel=0.15)


def test_the_context_cost_by_batch_measured_on_a_sim_engine_is_the_one_it_runs_with():
    """A device whose decode pays more per context token at a small batch (its attention spread
    over few sequences) measures as such at each batch, up to the largest the cache holds twice;
    the sim extras keep the table and, as the one figure, its largest batch's cost."""
    from tandem.engine.profiler import measure_context_cost_by_batch, measure_sim_extras

    per_token = {1: 2e-5, 4: 1e-5, 8: 5e-6}
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", device="sim", max_active=8, num_kv_blocks=2048,
                                    max_num_batched_tokens=8192),
                       step_time=lambda p, d, c: 0.001 * d + c * per_token.get(d, 0.0))
    measured = measure_context_cost_by_batch(engine, context_len=512, decode_tokens=8, repeats=1)
    assert sorted(measured) == [1, 4, 8]
    for batch, cost in per_token.items():
        assert measured[batch] == pytest.approx(cost, rel=0.15), batch
    extras = measure_sim_extras(engine, context_len=512, decode_tokens=8, repeats=1)
    assert extras["decode_s_per_context_token"] == extras["decode_s_per_context_token_by_batch"][8]
    assert {"prefill_tok_s_by_tokens", "max_active", "num_kv_tokens"} <= set(extras)


def test_the_prefill_table_measured_on_a_sim_engine_is_the_one_it_runs_with():
    """A step of several prompts is timed by its size: a sim prefilling 4x faster per token in
    steps over 512 tokens measures as such."""
    from tandem.engine.profiler import measure_prefill_table

    engine = LLMEngine(EngineConfig(model="tiny-llama-random", device="sim", max_active=16, num_kv_blocks=4096,
                                    max_num_batched_tokens=8192),
                       step_time=lambda p, d, c: p / (10000 if p <= 512 else 40000))
    table = measure_prefill_table(engine, repeats=1)
    assert sorted(table) == [64, 512, 2048, 8192]
    assert table[512] == pytest.approx(10000, rel=0.15) and table[2048] == pytest.approx(40000, rel=0.15)


def test_the_stats_split_a_steps_time_into_host_work_and_waiting_for_the_device():
    """Each step's wait for its sampled ids is counted apart (`device_wait_time_s`), within the
    steps' time, and each step once (`num_steps`)."""
    engine = sim_engine(step_s=0.02)
    run(engine, [("a", list(range(10, 42)), SamplingParams(max_tokens=6, ignore_eos=True))])
    stats = engine.get_stats()
    busy_s = stats.prefill_time_s + stats.decode_time_s
    assert stats.num_steps == 6  # the prefill's step samples the first token, then one step per token
    assert 0 < stats.device_wait_time_s <= busy_s
