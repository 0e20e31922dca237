"""Asynchronous scheduling against the synchronous loop, on the CPU's reference path.

With `async_scheduling` the engine plans step N+1 while step N's sampled ids are still on the
device: the next token is a placeholder, its input id is gathered on the device, and the
token is filled in (and detokenized, and stop-checked) one call later. None of that may change
what a request produces: the same greedy tokens, texts, finish reasons and usage, through
chunked prefill, prefix hits, preemption, stop tokens, stop strings, min_tokens and aborts,
and the prefix cache must end up with the same block hashes (no placeholder is ever hashed).
"""

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import PLACEHOLDER_TOKEN
from tandem.engine.sampling_params import SamplingParams

MODEL = "tiny-llama-random"
BASE = [7 + (i * 13) % 200 for i in range(45)]
PROMPTS = [BASE, BASE + [1, 2, 3], BASE[:20] + [9] * 11, [5, 6, 7], BASE[:33], list(range(60, 130))]


def make(async_scheduling, **kw):
    kw = {"model": MODEL, "max_active": 4, "max_num_batched_tokens": 40, "block_size": 4, **kw}
    return LLMEngine(EngineConfig(async_scheduling=async_scheduling, **kw))


def run(engine, prompts, params, abort_after=None):
    """Every output of every request; `abort_after` = (req_id, step number) aborts mid-run."""
    got = {f"r{i}": {"ids": [], "text": "", "final": None} for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            g = got[out.req_id]
            assert g["final"] is None, "an output after the final one"
            assert PLACEHOLDER_TOKEN not in out.new_token_ids
            g["ids"] += out.new_token_ids
            g["text"] += out.new_text
            if out.finished:
                g["final"] = (out.finish_reason, out.usage.completion_tokens, out.usage.prompt_tokens)
        steps += 1
        if abort_after and steps == abort_after[1]:
            engine.abort_request(abort_after[0])
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    return got


def both(prompts, params, abort_after=None, **kw):
    sync, asyn = make(False, **kw), make(True, **kw)
    expected, got = run(sync, prompts, params, abort_after), run(asyn, prompts, params, abort_after)
    return expected, got, sync, asyn


def test_greedy_batched_chunked_prefix_hits_same_as_sync():
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 21, 18, 15, 12, 27)]
    expected, got, sync, asyn = both(PROMPTS, params)
    assert got == expected
    assert all(g["final"][1] == len(g["ids"]) for g in got.values())
    assert asyn.get_stats().prefix_cache_hits == sync.get_stats().prefix_cache_hits > 0
    # A block that a placeholder fills is published once the id has arrived, on the request's
    # next step; a request that finishes with that step never publishes it (one block less).
    assert set(asyn.cached_block_hashes()) <= set(sync.cached_block_hashes())


def test_preemption_same_as_sync():
    prompts = [[5 + i + 3 * j for j in range(10)] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected, got, sync, asyn = both(prompts, params, num_kv_blocks=10, max_active=3)
    assert asyn.scheduler.num_preemptions > 0
    assert got == expected


def test_stop_tokens_and_strings_same_as_sync():
    free = run(make(False), PROMPTS[:4], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    # stop on a token each request really produces (its 5th), and on a piece of one's text
    params = [SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[free[f"r{i}"]["ids"][4]])
              for i in range(3)]
    text = free["r3"]["text"]
    params.append(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[text[6:9]]))
    expected, got, _, _ = both(PROMPTS[:4], params)
    assert got == expected
    assert [g["final"][0] for g in got.values()] == ["stop"] * 4
    assert all(g["final"][1] == len(g["ids"]) <= 5 for g in list(got.values())[:3])


def test_min_tokens_and_single_token_requests_same_as_sync():
    free = run(make(False), PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stop = free["r0"]["ids"][1]
    params = [SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop], min_tokens=4),
              SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=2, temperature=0.0)]
    expected, got, _, _ = both(PROMPTS[:3], params)
    assert got == expected
    assert got["r1"]["final"] == ("length", 1, len(PROMPTS[1]))


@pytest.mark.parametrize("abort_step", [1, 2, 5])
def test_abort_while_a_step_is_in_flight(abort_step):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected, got, _, asyn = both(PROMPTS[:3], params, abort_after=("r1", abort_step))
    assert got["r1"]["final"][0] == "abort"
    assert got["r1"]["final"][1] == len(got["r1"]["ids"])
    assert got["r0"] == expected["r0"] and got["r2"] == expected["r2"]
    assert not asyn.abort_request("r1")


def test_seeded_sampling_same_as_sync():
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    expected, got, _, _ = both(PROMPTS[:3], params)
    assert got == expected


def test_stats_and_progress_count_only_known_tokens():
    engine = make(True)
    engine.add_request("a", PROMPTS[3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert engine.step() == []  # launched; its token is read on the next call
    assert engine.has_unfinished_requests()
    progress = {p.req_id: p for p in engine.drain_progress()}
    assert progress["a"].num_output_tokens == 0
    outs = engine.step()
    assert [len(o.new_token_ids) for o in outs] == [1]
    assert engine.get_stats().num_prompt_tokens_total > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert {p.req_id: (p.status, p.num_output_tokens) for p in engine.drain_progress()} == {"a": ("finished", 6)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_progress_drained_after_every_step_ends_finished(async_scheduling):
    """The router's ledger lives on these reports: drained after every step (as a busy engine
    core does), each request's last reported state must be `finished`. With asynchronous
    scheduling a request that reaches max_tokens at launch is reported while its last token is
    still on the device; the call that resolves that token must report it again."""
    engine = make(async_scheduling)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 9, 3, 7, 4)]
    params.append(SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=1, ignore_eos=True))  # a group
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", prompt, p)
    last = {}
    while engine.has_unfinished_requests():
        engine.step()
        last.update({p.req_id: (p.status, p.num_output_tokens) for p in engine.drain_progress()})
    last.update({p.req_id: (p.status, p.num_output_tokens) for p in engine.drain_progress()})
    assert last == {f"r{i}": ("finished", p.max_tokens * p.n) for i, p in enumerate(params)}
