"""What a long-running engine keeps: nothing per request once its requests are done, and a
bounded set of oneDNN kernels however many prompt lengths it meets.

The soak bench (bench/soak.py) found a CPU engine core growing by ~0.3 GiB over 20 minutes of
mixed traffic; an in-process run of the same mix put all of it in oneDNN's per-shape kernel
caches (docs/benchmarks/soak-2core.notes.md). The first test pins the fix (the packed linears
run at `bucket_rows` row counts only); the second that the engine's own per-request maps are
empty after a mix of every kind of request the soak sends: n > 1, JSON-schema and regex
grammars, stop strings, prompts near the context, aborts before and during generation, and
refused adds, with and without asynchronous scheduling.

CPU, the tiny random preset in float32; the byte tokenizer makes token b byte b.
"""

import random

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model import cpu_linear
from tandem.engine.model.cpu_linear import bucket_rows
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.structured_output import StructuredOutputParams

MAX_MODEL_LEN = 256
PERSON = StructuredOutputParams.from_json_schema(
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False})
LETTERS = StructuredOutputParams(regex="[a-z]{3,20}")


def test_prefills_of_64_lengths_run_the_linears_at_18_row_counts(monkeypatch):
    if not cpu_linear.available(torch.float32):
        pytest.skip("this torch build has no packed float32 linear")
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", dtype="float32", max_model_len=MAX_MODEL_LEN,
                                    max_active=1))
    rows_run = set()
    pointwise = torch.ops.mkldnn._linear_pointwise

    def recording(x, *args):
        rows_run.add(x.shape[0])
        return pointwise(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    lengths = range(17, 81)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for length in lengths:  # one at a time: each prefill step is exactly its prompt
        engine.add_request(f"r{length}", [(7 * length + j) % 200 + 3 for j in range(length)], params)
        while engine.has_unfinished_requests():
            engine.step()
    # Without buckets, 64 prefill row counts (and 64 kernels per linear): 17, 18, ..., 80.
    assert rows_run == {1} | {bucket_rows(n) for n in lengths}
    assert len(rows_run) == 1 + 8 + 8 + 2  # decode; 18..32 by 2; 36..64 by 4; 72, 80


def _mixed_requests(rng, max_model_len):
    """(prompt, params, abort after this many outputs or None) in the soak's proportions."""
    kind = rng.choice(["plain", "plain", "stop", "n", "json", "regex", "long", "abort", "abort_at_once", "bad"])
    prompt = [rng.randrange(3, 250) for _ in range(rng.randint(4, 40))]
    temperature = rng.choice([0.0, 0.8])
    seed = rng.randrange(1 << 30)
    if kind == "plain":
        return prompt, SamplingParams(max_tokens=rng.randint(1, 16), temperature=temperature, seed=seed), None
    if kind == "stop":
        return prompt, SamplingParams(max_tokens=16, temperature=0.8, seed=seed, stop=["e", "ab"]), None
    if kind == "n":
        n = rng.randint(2, 4)
        return prompt, SamplingParams(max_tokens=rng.randint(2, 12), temperature=0.8, seed=seed, n=n), \
            rng.choice([None, None, 2])
    if kind == "json":
        return prompt, SamplingParams(max_tokens=24, temperature=0.0, structured_output=PERSON), None
    if kind == "regex":
        return prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=seed, structured_output=LETTERS), None
    if kind == "long":
        max_tokens = rng.randint(1, 4)
        long_prompt = [rng.randrange(3, 250) for _ in range(max_model_len - max_tokens - 8)]
        return long_prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), None
    if kind == "abort":
        return prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), rng.randint(1, 4)
    if kind == "abort_at_once":
        return prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), 0
    return [5] * (max_model_len + 8), SamplingParams(max_tokens=4), None  # over the context: refused


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_traffic_leaves_no_per_request_state(async_scheduling):
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", dtype="float32", max_model_len=MAX_MODEL_LEN,
                                    max_active=4, async_scheduling=async_scheduling))
    rng = random.Random(0)
    num_requests, concurrency = 120, 8
    live: dict[str, list] = {}  # req_id -> [abort after, outputs seen]
    finished, refused, aborted, sent = set(), 0, 0, 0
    while sent < num_requests or live:
        while sent < num_requests and len(live) < concurrency:
            req_id = f"req-{sent}"
            sent += 1
            prompt, params, abort_after = _mixed_requests(rng, MAX_MODEL_LEN)
            try:
                engine.add_request(req_id, prompt, params)
            except InvalidRequestError:
                refused += 1
                continue
            live[req_id] = [abort_after, 0]
            if abort_after == 0:
                engine.abort_request(req_id)
                aborted += 1
        for out in engine.step():
            state = live[out.req_id]
            state[1] += 1
            if out.finished:
                del live[out.req_id]
                finished.add(out.req_id)
            elif state[0] is not None and state[1] >= state[0]:
                engine.abort_request(out.req_id)
                aborted += 1
        engine.drain_progress()
        engine.drain_cache_changes()
    assert not engine.has_unfinished_requests()
    assert len(finished) + refused == num_requests and refused > 0 and aborted > 0
    engine.drain_progress()
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    assert not engine.output_processor.tracked and not engine.reporter.changed
    assert not engine.request_groups.groups and not engine.request_groups.child_of
    assert not engine._pending_outputs and not engine.output_processor.failed_outputs and engine._in_flight is None
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not kv.req_to_blocks and not kv.req_to_block_ids and not kv.req_to_num_cached_blocks
    assert kv.block_pool.get_num_free_blocks() == kv.num_usable_blocks
    assert not engine.drain_progress() and not engine.drain_cache_changes()
