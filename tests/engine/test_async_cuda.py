"""Graphs for prefill and mixed steps, the work-list attention they use, and asynchronous
scheduling on the GPU, against the reference path. Skipped without CUDA.

- The work-list attention kernel (a fixed grid of (request, query tile) items, padded with
  empty items) matches `TorchRefAttention` on mixed batches and writes the same cache.
- A mixed step replayed from a token-count bucket gives the eager fused model's logits, and its
  padded tokens write no K/V; in bf16 on qwen2.5-0.5b-random its logits are within 2x the
  reference path's own bf16 error (+1e-3) of an fp32 reference.
- Whole-engine fp32 greedy tokens equal the reference path's with asynchronous scheduling,
  mixed-step graphs and decode graphs, through chunked prefill, prefix hits and preemption; and
  bf16 tokens on qwen2.5-0.5b-random are the same with and without asynchronous scheduling.
"""

import math

import pytest
import torch

from tandem.engine.attention import TorchRefAttention
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model.loader import load_model
from tandem.engine.sampling_params import SamplingParams
from tests.conftest import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

if torch.cuda.is_available():
    from tandem.engine.attention.triton_paged import TritonPagedAttention, prefill_block_q
    from tandem.engine.block_table import BlockTableMirror
    from tandem.engine.cuda_graphs import MixedGraphRunner, build_work_list
    from tandem.engine.model.fused_layers import fuse_model

DEVICE = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (4, 4, 16), (6, 1, 32)])
def test_work_list_attention_matches_reference(make_step, dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(0)
    reqs = [(0, 5), (6, 1), (9, 4), (0, 70), (40, 1), (33, 17), (100, 1)]
    _, meta = make_step(reqs, 4, DEVICE)
    work = build_work_list(meta.query_lens_cpu, prefill_block_q(num_heads // num_kv_heads))
    work += [-1] * 10  # empty items, as a graph bucket has
    meta.work_list = torch.tensor(work, dtype=torch.int32, device=DEVICE).view(-1, 2)
    num_tokens = sum(n for _, n in reqs)
    cache = torch.randn(2, 256, 4, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = TorchRefAttention().forward(q, k, v, ref_cache, meta, 1 / math.sqrt(head_dim))
    out = TritonPagedAttention().forward(q, k, v, fast_cache, meta, 1 / math.sqrt(head_dim))
    assert torch.equal(ref_cache, fast_cache)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def _mixed_step_inputs(block_size=4):
    """A decode, a chunk on a cached prefix, a fresh prompt: (ids, positions, slots, query lens,
    sequence lengths, tables, sampled rows)."""
    reqs = [(9, 1), (12, 7), (0, 11)]
    tables = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13]]
    ids, positions, slots, rows, offset = [], [], [], [], 0
    gen = torch.Generator().manual_seed(5)
    for (cached, new), table in zip(reqs, tables):
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        ids += torch.randint(0, 200, (new,), generator=gen).tolist()
        offset += new
        rows.append(offset - 1)
    return ids, positions, slots, [n for _, n in reqs], [c + n for c, n in reqs], tables, rows


def _with_rows(mirror, step):
    """The step's inputs with its block tables replaced by rows of `mirror`."""
    ids, positions, slots, query_lens, seq_lens, tables, rows = step
    mirror.rows_for([("other", [1, 2])])  # so the step's rows are not simply 1, 2, 3
    table_rows = mirror.rows_for([(f"r{i}", t) for i, t in enumerate(tables)])
    return ids, positions, slots, query_lens, seq_lens, table_rows, rows


def _eager_logits(model, caches, ids, positions, slots, query_lens, seq_lens, tables, rows):
    from tandem.engine.attention.metadata import AttentionMetadata

    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=4)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE), caches, meta)
        return model.compute_logits(hidden[torch.tensor(rows, device=DEVICE)])


def _caches(cfg, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    caches = [torch.randn(2, 64, 4, cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, generator=gen).to(dtype)
              for _ in range(cfg.num_hidden_layers)]
    for c in caches:
        c[:, 0].zero_()
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_graph_matches_eager_and_pads_safely(dtype):
    model = fuse_model(load_model("tiny-qwen2-random", DEVICE, dtype).model, TritonPagedAttention())
    cfg = model.config
    caches = _caches(cfg, dtype)
    before = [c.clone() for c in caches]
    mirror = BlockTableMirror(8, 16, torch.device(DEVICE))
    runner = MixedGraphRunner(model, caches, 4, mirror, 4, 40, cfg.num_attention_heads // cfg.num_key_value_heads)
    assert runner.token_sizes == [40]
    step = _mixed_step_inputs()  # 19 tokens padded to 40
    logits = runner.run(*_with_rows(mirror, step)).clone()
    eager_caches = [b.clone() for b in before]
    eager = _eager_logits(model, eager_caches, *step)
    assert rel_err(logits, eager) < (1e-5 if dtype == torch.float32 else 1e-2)
    for graph_cache, eager_cache, old in zip(caches, eager_caches, before):
        assert rel_err(graph_cache, eager_cache) < 1e-5
        changed = (graph_cache != old).flatten(3).any(-1).any(0).flatten().nonzero().flatten().tolist()
        assert changed == sorted(step[2])


def test_mixed_graph_bf16_logits_close_to_fp32():
    name = "qwen2.5-0.5b-random"
    step = _mixed_step_inputs()
    exact_model = load_model(name, DEVICE, torch.float32).model
    exact = _eager_logits(exact_model, _caches(exact_model.config, torch.float32), *step)
    ref_model = load_model(name, DEVICE, torch.bfloat16).model
    ref = _eager_logits(ref_model, _caches(ref_model.config, torch.bfloat16), *step)
    fast_model = fuse_model(load_model(name, DEVICE, torch.bfloat16).model, TritonPagedAttention())
    cfg = fast_model.config
    mirror = BlockTableMirror(8, 16, torch.device(DEVICE))
    runner = MixedGraphRunner(fast_model, _caches(cfg, torch.bfloat16), 4, mirror, 4, 64,
                              cfg.num_attention_heads // cfg.num_key_value_heads)
    fast = runner.run(*_with_rows(mirror, step))
    ref_err, fast_err = rel_err(ref, exact), rel_err(fast, exact)
    print(f"bf16 reference vs fp32 {ref_err:.2e}, bf16 mixed graph vs fp32 {fast_err:.2e}")
    assert fast_err < 2 * ref_err + 1e-3


def _greedy(engine, prompts, max_tokens):
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    return list(out.values())


def _count_calls(obj, name, calls):
    fn = getattr(obj, name)
    setattr(obj, name, lambda *a, **k: calls.append(len(a[0])) or fn(*a, **k))


@pytest.mark.parametrize("name", ["tiny-llama-random", "tiny-qwen2-random", "qwen2.5-0.5b-random"])
@pytest.mark.parametrize("num_kv_blocks", [None, 40])
def test_fp32_async_graphs_greedy_tokens_match_reference(name, num_kv_blocks):
    base = [7 + (i * 13) % 200 for i in range(45)]
    prompts = [base, base + [1, 2, 3], base[:20] + [9] * 11, [5, 6, 7], base[:33], list(range(60, 130))]
    max_tokens = [24, 21, 18, 15, 12, 27]
    kw = dict(model=name, device=DEVICE, dtype="float32", max_active=4, max_num_batched_tokens=40,
              block_size=4, num_kv_blocks=num_kv_blocks)
    expected = _greedy(LLMEngine(EngineConfig(attention_backend="torch", async_scheduling=False, **kw)),
                       prompts, max_tokens)
    fast = LLMEngine(EngineConfig(attention_backend="auto", **kw))
    assert fast.async_scheduling
    runner = fast.model_runner
    mixed, decode = [], []
    _count_calls(runner.mixed_graph_runner, "run", mixed)
    _count_calls(runner.graph_runner, "run", decode)
    assert _greedy(fast, prompts, max_tokens) == expected
    assert mixed and decode and 3 in decode
    assert fast.get_stats().prefix_cache_hits > 0
    if num_kv_blocks:
        assert fast.scheduler.num_preemptions > 0


def test_bf16_async_same_tokens_as_sync():
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 700))] for _ in range(24)]
    max_tokens = [rng.randint(4, 60) for _ in prompts]
    kw = dict(model="qwen2.5-0.5b-random", device=DEVICE, max_active=16, max_num_batched_tokens=1024)
    sync = _greedy(LLMEngine(EngineConfig(async_scheduling=False, **kw)), prompts, max_tokens)
    assert _greedy(LLMEngine(EngineConfig(async_scheduling=True, **kw)), prompts, max_tokens) == sync
    assert [len(t) for t in sync] == max_tokens
