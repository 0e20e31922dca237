"""One request's fault ends that request, not the step: a fault injected at each per-request
point of the step (engine/llm_engine.py's `fault_injector`) ends one of eight greedy requests
with an "error" output while the other seven produce exactly the tokens of an undisturbed run,
the KV cache gets every block back and the engine serves the next batch as if nothing had
happened. A fault no request explains (the batched step) still raises out of `step()`.

CPU, the tiny random preset in float32 (greedy tokens do not depend on the batch), with and
without asynchronous scheduling; on cuda, when there is one, the fast path (Triton attention,
CUDA graphs, asynchronous scheduling). The byte tokenizer makes token b byte b.
"""

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import FINISH_REASON_ERROR, LLMEngine
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutputParams

NUM_REQUESTS = 8
MAX_TOKENS = 12
TARGET = "r3"
FAIL_FROM_CALL = 3  # the target's third call at the point, and every one after: mid-generation
PROMPTS = [[(7 * i + j) % 90 + 32 for j in range(3 + i)] for i in range(NUM_REQUESTS)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# 30 letters: the grammar cannot complete within MAX_TOKENS, so the request ends by length.
LETTERS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                         structured_output=StructuredOutputParams(regex="[a-z]{30}"))
POINTS = ["sampling_row", "logits", "output", "grammar_bitmask", "grammar_accept"]
# (device, async_scheduling); None: the device's default (asynchronous on cuda).
CONFIGS = [pytest.param(("cpu", False), id="cpu-sync"), pytest.param(("cpu", True), id="cpu-async"),
           pytest.param(("cuda", None), id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs CUDA")])]


class InjectedFault(RuntimeError):
    pass


class Injector:
    """Raises at `point` for `req_id` (None: any request) from its `from_call`-th call there on."""

    def __init__(self, point, req_id, from_call=FAIL_FROM_CALL):
        self.point, self.req_id, self.from_call = point, req_id, from_call
        self.calls = 0
        self.seen_points = set()

    def __call__(self, point, req_id):
        self.seen_points.add(point)
        if point == self.point and (self.req_id is None or req_id == self.req_id):
            self.calls += 1
            if self.calls >= self.from_call:
                raise InjectedFault(f"injected at {point} for {req_id}")


@pytest.fixture(scope="module")
def engines():
    built = {}

    def get(config=("cpu", False)):
        if config not in built:
            device, async_scheduling = config
            built[config] = LLMEngine(EngineConfig(
                model="tiny-llama-random", device=device, dtype="float32", max_model_len=128,
                max_active=NUM_REQUESTS, async_scheduling=async_scheduling))
        return built[config]
    return get


def requests(with_grammar):
    """The eight requests; with a grammar, the target's is constrained to letters."""
    return {f"r{i}": (prompt, LETTERS if with_grammar and f"r{i}" == TARGET else GREEDY)
            for i, prompt in enumerate(PROMPTS)}


def run(engine, reqs):
    """Every request to the end: per request its token ids and its outputs, in order."""
    got = {req_id: {"ids": [], "outputs": []} for req_id in reqs}
    for req_id, (prompt, params) in reqs.items():
        engine.add_request(req_id, prompt, params)
    for _ in range(10 * MAX_TOKENS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got[out.req_id]["ids"] += out.new_token_ids
            got[out.req_id]["outputs"].append(out)
    assert not engine.has_unfinished_requests()
    return got


def assert_clean(engine, free_at_start):
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == free_at_start == pool.num_usable_blocks
    assert not engine.output_processor.tracked and not engine.scheduler.requests
    assert not engine.output_processor.failed_outputs
    assert not engine.model_runner.sampler.failures


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("point", POINTS)
def test_a_fault_ends_one_request_and_the_others_are_untouched(engines, point, config):
    engine = engines(config)
    with_grammar = point.startswith("grammar")
    reqs = requests(with_grammar)
    free_at_start = engine.kv_cache_manager.block_pool.get_num_free_blocks()
    undisturbed = run(engine, reqs)
    for req_id, got in undisturbed.items():
        assert len(got["ids"]) == MAX_TOKENS and got["outputs"][-1].finish_reason == "length", req_id

    injector = Injector(point, TARGET)
    engine.fault_injector = injector
    try:
        faulted = run(engine, reqs)
    finally:
        engine.fault_injector = None
    assert injector.calls >= FAIL_FROM_CALL, f"the fault at {point} never fired"

    for req_id, got in faulted.items():
        if req_id != TARGET:
            assert got["ids"] == undisturbed[req_id]["ids"], req_id  # the same ids, byte for byte
            last = got["outputs"][-1]
            assert last.finished and last.finish_reason == "length", req_id
            assert [o.finished for o in got["outputs"]].count(True) == 1, req_id
    target = faulted[TARGET]
    last = target["outputs"][-1]
    assert last.finished and last.finish_reason == FINISH_REASON_ERROR
    assert not last.new_token_ids and last.new_text == ""
    assert [o.finished for o in target["outputs"]].count(True) == 1  # nothing after its error
    assert all(o.finish_reason is None for o in target["outputs"][:-1])
    # What it sent before the fault is what it would have sent; its usage counts just that.
    assert len(target["ids"]) < MAX_TOKENS
    assert target["ids"] == undisturbed[TARGET]["ids"][:len(target["ids"])]
    assert last.usage.completion_tokens == len(target["ids"])
    assert_clean(engine, free_at_start)
    progress = {p.req_id: p for p in engine.drain_progress()}  # the router hears it finished
    assert progress[TARGET].status == "finished"
    assert progress[TARGET].num_output_tokens == len(target["ids"])

    # And it goes on serving: the same batch again, undisturbed.
    again = run(engine, reqs)
    assert {r: g["ids"] for r, g in again.items()} == {r: g["ids"] for r, g in undisturbed.items()}
    assert_clean(engine, free_at_start)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_fault_in_the_batched_step_raises_out_of_step(engines, config):
    engine = engines(config)
    reqs = requests(False)
    free_at_start = engine.kv_cache_manager.block_pool.get_num_free_blocks()
    undisturbed = run(engine, reqs)

    engine.fault_injector = Injector("step", None)
    try:
        for req_id, (prompt, params) in reqs.items():
            engine.add_request(req_id, prompt, params)
        with pytest.raises(InjectedFault, match="injected at step"):
            for _ in range(10 * MAX_TOKENS):
                engine.step()
    finally:
        engine.fault_injector = None
    # As before: the engine core reports the failed step and its front aborts every request.
    for req_id in reqs:
        assert engine.abort_request(req_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.req_id for o in outputs if o.finished and o.finish_reason == "abort"} == set(reqs)
    assert_clean(engine, free_at_start)
    again = run(engine, reqs)
    assert {r: g["ids"] for r, g in again.items()} == {r: g["ids"] for r, g in undisturbed.items()}


def test_a_failed_choice_ends_alone_and_its_siblings_finish(engines):
    engine = engines()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=3)
    free_at_start = engine.kv_cache_manager.block_pool.get_num_free_blocks()
    engine.fault_injector = Injector("output", "g#1")
    try:
        got = run(engine, {"g": (PROMPTS[0], params)})
    finally:
        engine.fault_injector = None
    outputs = got["g"]["outputs"]
    reasons = {o.index: o.finish_reason for o in outputs if o.finish_reason is not None}
    assert reasons == {0: "length", 1: FINISH_REASON_ERROR, 2: "length"}
    assert outputs[-1].finished and [o.finished for o in outputs].count(True) == 1
    ids = {i: [t for o in outputs if o.index == i for t in o.new_token_ids] for i in range(3)}
    assert len(ids[0]) == len(ids[2]) == MAX_TOKENS and ids[0] == ids[2]  # greedy choices agree
    assert ids[1] == ids[0][:len(ids[1])] and len(ids[1]) < MAX_TOKENS
    assert outputs[-1].usage.completion_tokens == 2 * MAX_TOKENS + len(ids[1])
    assert_clean(engine, free_at_start)
    progress = {p.req_id: p for p in engine.drain_progress()}  # the router hears it finished
    assert progress["g"].status == "finished"
    assert not engine.request_groups.groups and not engine.request_groups.child_of


def test_no_injector_costs_no_calls(engines):
    """The hook is off by default, on the engine and in its sampler."""
    engine = engines()
    assert engine.fault_injector is None and engine.model_runner.sampler.fault_injector is None


def test_sampler_retries_row_by_row_and_keeps_seeded_draws(monkeypatch):
    """A fault after the draws (here in the penalty counts of one row): the batch is sampled
    again one row at a time, the faulty row is reported, and a seeded row keeps its draw, so
    its next draw is the one it would have made anyway."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))

    def make_rows():
        return [SamplingRow(SamplingParams(temperature=1.0, seed=7), torch.Generator().manual_seed(7), req_id="a"),
                SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.5), None, req_id="bad"),
                SamplingRow(SamplingParams(temperature=0.0), None, req_id="c")]

    clean_rows = make_rows()
    clean = Sampler()
    want = clean.sample(logits, clean_rows).sampled_token_ids.tolist()
    want_next = clean.sample(logits[:1], clean_rows[:1]).sampled_token_ids.tolist()

    count = Sampler._count

    def faulty_count(self, sampled, rows, history):
        if any(rows[i].req_id == "bad" for i in history):
            raise InjectedFault("bad row")
        return count(self, sampled, rows, history)

    monkeypatch.setattr(Sampler, "_count", faulty_count)
    rows = make_rows()
    sampler = Sampler()
    got = sampler.sample(logits, rows).sampled_token_ids.tolist()
    assert got[0] == want[0] and got[2] == want[2]
    assert [(row.req_id, point) for row, _, point in sampler.failures] == [("bad", "logits")]
    assert sampler.sample(logits[:1], rows[:1]).sampled_token_ids.tolist() == want_next
    assert not sampler.failures  # each sample call reports its own


def test_sampler_raises_what_no_row_explains(monkeypatch):
    """A failure every row also hits alone (or a batch of one) is not any row's: it raises."""
    def broken(self, logits, rows):
        raise InjectedFault("the device")

    monkeypatch.setattr(Sampler, "processed_logits", broken)
    rows = [SamplingRow(SamplingParams(temperature=1.0), None, req_id=r) for r in "ab"]
    with pytest.raises(InjectedFault):
        Sampler().sample(torch.randn(2, 16), rows)
    with pytest.raises(InjectedFault):
        Sampler().sample(torch.randn(1, 16), rows[:1])
