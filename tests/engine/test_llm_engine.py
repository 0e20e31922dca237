"""The whole engine against HF transformers' `generate` on the same weights.

Greedy token ids must match exactly (fp32) for requests run alone, batched together, with
chunked prefill, after a prefix-cache hit and after a preemption by recompute.
"""

from functools import lru_cache

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model.loader import load_model
from tandem.engine.model.presets import build_hf_model
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
]


@lru_cache(maxsize=None)
def hf_model(name):
    if name == "smollm2-135m":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(load_model(name).hf_path, dtype=torch.float32).eval()
    return build_hf_model(name)


def hf_greedy(name, prompt_ids, max_new_tokens):
    model = hf_model(name)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def run_all(engine, prompts, max_tokens, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    ids = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        ids[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids[out.req_id].extend(out.new_token_ids)
    return [ids[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def smollm2():
    return LLMEngine(EngineConfig(model="smollm2-135m", max_active=4))


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_alone_and_batched(smollm2):
    expected = [hf_greedy("smollm2-135m", smollm2.encode(p), 32) for p in PROMPTS]
    for prompt, want in zip(PROMPTS, expected):
        assert run_all(smollm2, [prompt], 32) == [want]
    assert run_all(smollm2, PROMPTS, 32) == expected  # all four in one batch


@pytest.mark.slow
def test_smollm2_text_and_usage(smollm2):
    smollm2.add_request("t", "The capital of France is", SamplingParams(max_tokens=8, temperature=0.0))
    text, final = "", None
    while smollm2.has_unfinished_requests():
        for out in smollm2.step():
            text += out.new_text
            final = out
    assert "Paris" in text
    assert final.finished and final.finish_reason == "length"
    assert final.usage.prompt_tokens == 5 and final.usage.completion_tokens == 8


@pytest.mark.parametrize("name", ["tiny-qwen2-random", "tiny-llama-random"])
def test_tiny_greedy_matches_hf_chunked_and_batched(name):
    engine = LLMEngine(EngineConfig(model=name, max_num_batched_tokens=7, max_active=3))
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 11)]
    expected = [hf_greedy(name, p, 24) for p in prompts]
    assert run_all(engine, prompts, 24) == expected


def test_greedy_matches_hf_after_prefix_cache_hit():
    name = "tiny-qwen2-random"
    engine = LLMEngine(EngineConfig(model=name, block_size=4))
    prefix = [(7 * i) % 200 + 3 for i in range(21)]
    first, second = prefix + [11, 12], prefix + [13]
    assert run_all(engine, [first], 16) == [hf_greedy(name, first, 16)]
    engine.add_request("hit", second, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    ids, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids.extend(out.new_token_ids)
            final = out
    assert final.usage.cached_tokens == 20
    assert ids == hf_greedy(name, second, 16)


def test_greedy_matches_hf_after_preemption():
    name = "tiny-llama-random"
    # 9 usable blocks of 4 tokens: three requests of 10 + 20 tokens cannot all fit.
    engine = LLMEngine(EngineConfig(model=name, block_size=4, num_kv_blocks=10, max_active=3))
    prompts = [[5 + i + 3 * j for j in range(10)] for i in range(3)]
    got = run_all(engine, prompts, 20)
    assert engine.scheduler.num_preemptions > 0
    assert got == [hf_greedy(name, p, 20) for p in prompts]
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(EngineConfig(model="tiny-llama-random", max_model_len=128))


@pytest.mark.parametrize("prompt, kw, match", [
    ("", {}, "prompt is empty"),
    ([5, 10**6], {}, "prompt token ids"),
    ([5, -1], {}, "prompt token ids"),
    ("hi", {"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ("x" * 200, {}, "context length"),
    ("hi", {"max_tokens": 128}, "context length"),
])
def test_bad_input_names_the_problem(tiny, prompt, kw, match):
    """What only the engine knows (its vocabulary, its context); the sampling settings are the
    edge's to check (tests/cluster/test_request_contract.py)."""
    with pytest.raises(InvalidRequestError, match=match):
        tiny.add_request("bad", prompt, SamplingParams(**{"max_tokens": 4, **kw}))
    assert not tiny.has_unfinished_requests()


def test_unknown_model_names_it():
    with pytest.raises(ValueError, match="no-such-model"):
        LLMEngine(EngineConfig(model="no-such-model"))


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = run_all_params(tiny, [[4, 5, 6]], params)
    batched = run_all_params(tiny, [[4, 5, 6], [9, 9, 9, 9]], params)
    assert alone[0] == batched[0]


def run_all_params(engine, prompts, params):
    ids = {f"s{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids[out.req_id].extend(out.new_token_ids)
    return [ids[f"s{i}"] for i in range(len(prompts))]


def test_abort_frees_blocks_and_emits_final_output(tiny):
    tiny.add_request("ab", [3, 4, 5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    tiny.step()
    assert tiny.abort_request("ab")
    outs = tiny.step()
    assert [(o.req_id, o.finish_reason) for o in outs] == [("ab", "abort")]
    pool = tiny.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert not tiny.abort_request("ab")


@pytest.mark.slow
def test_stop_string_ends_the_request_and_is_not_returned(smollm2):
    params = SamplingParams(max_tokens=32, temperature=0.0, stop=[" Paris"])
    smollm2.add_request("stop", "The capital of France is", params)
    text, final = "", None
    while smollm2.has_unfinished_requests():
        for out in smollm2.step():
            text += out.new_text
            final = out
    assert final.finish_reason == "stop" and "Paris" not in text
    assert final.usage.completion_tokens < 32
