"""The GPU fast path (Triton paged attention, fused layers, CUDA graphs) against the reference.

Skipped without CUDA. The fast path must compute the reference's function: the attention
kernel matches `TorchRefAttention` on mixed batches and writes the same cache; in bfloat16 the
fused model's logits are as close to a float32 reference as the reference path's own bfloat16
logits are; in float32 whole-engine greedy tokens are identical, through chunked prefill mixed
with decodes, prefix-cache hits and CUDA-graph buckets padded past the batch.
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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast path needs CUDA")

if torch.cuda.is_available():
    from tandem.engine.attention.triton_paged import TritonPagedAttention
    from tandem.engine.block_table import BlockTableMirror
    from tandem.engine.cuda_graphs import CUDAGraphRunner, bucket_sizes
    from tandem.engine.model.fused_layers import fuse_model

DEVICE = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (4, 4, 16), (6, 1, 32)])
def test_attention_kernel_matches_reference(make_step, dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(0)
    # fresh prefill, decode on cached context, chunk on a cached prefix, a long fresh prompt
    reqs = [(0, 5), (6, 1), (9, 4), (0, 70), (40, 1), (33, 17)]
    _, meta = make_step(reqs, 4, DEVICE)
    num_tokens = sum(n for _, n in reqs)
    cache = torch.randn(2, 128, 4, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    scale = 1 / math.sqrt(head_dim)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = TorchRefAttention().forward(q, k, v, ref_cache, meta, scale)
    out = TritonPagedAttention().forward(q, k, v, fast_cache, meta, scale)
    assert torch.equal(ref_cache, fast_cache)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_reqs", [1, 5, 64])
def test_split_decode_matches_reference(make_step, dtype, num_reqs):
    """Decode-only batches take the split-context kernel (16, 16 and 2 splits here)."""
    torch.manual_seed(0)
    reqs = [((600, 130, 63, 64, 1)[i % 5] + i, 1) for i in range(num_reqs)]
    _, meta = make_step(reqs, 16, DEVICE)
    num_blocks = int(meta.block_tables.max()) + 1
    cache = torch.randn(2, num_blocks, 16, 2, 64, device=DEVICE, dtype=dtype)
    q = torch.randn(num_reqs, 14, 64, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_reqs, 2, 64, device=DEVICE, dtype=dtype) for _ in range(2))
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = TorchRefAttention().forward(q, k, v, ref_cache, meta, 0.125)
    out = TritonPagedAttention().forward(q, k, v, fast_cache, meta, 0.125)
    assert torch.equal(ref_cache, fast_cache)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_padded_slots_write_nowhere(make_step):
    _, meta = make_step([(0, 3)], 4, DEVICE)
    meta.slot_mapping[1] = -1
    cache = torch.zeros(2, 32, 4, 2, 16, device=DEVICE)
    ones = torch.ones(3, 2, 16, device=DEVICE)
    TritonPagedAttention().forward(torch.randn(3, 4, 16, device=DEVICE), ones, ones, cache, meta, 0.25)
    written = (cache.view(2, -1, 32) != 0).all(-1)
    assert written[0].nonzero().flatten().tolist() == [4, 6]


def _two_steps(model, make_step, dtype, seed=0):
    """Logits of a fresh prefill step, then of a mixed step (a decode and two chunks on cached context)."""
    cfg = model.config
    caches = [torch.zeros(2, 64, 4, cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, dtype=dtype)
              for _ in range(cfg.num_hidden_layers)]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = []
    for reqs in ([(0, 9), (0, 6), (0, 3)], [(9, 1), (6, 5), (3, 4)]):
        pos, meta = make_step(reqs, 4, DEVICE)
        ids = torch.randint(0, 256, (len(pos),), generator=gen).to(DEVICE)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(logits)


@pytest.mark.parametrize("name", ["tiny-qwen2-random", "qwen2.5-0.5b-random"])
def test_bf16_logits_as_close_as_reference(make_step, name):
    exact = _two_steps(load_model(name, DEVICE, torch.float32).model, make_step, torch.float32)
    ref = _two_steps(load_model(name, DEVICE, torch.bfloat16).model, make_step, torch.bfloat16)
    fast_model = fuse_model(load_model(name, DEVICE, torch.bfloat16).model, TritonPagedAttention())
    fast = _two_steps(fast_model, make_step, torch.bfloat16)
    ref_err, fast_err = rel_err(ref, exact), rel_err(fast, exact)
    print(f"{name}: bf16 reference vs fp32 {ref_err:.2e}, bf16 fast vs fp32 {fast_err:.2e}, "
          f"fast vs reference {rel_err(fast, ref):.2e}")
    assert fast_err < 2 * ref_err + 1e-3
    assert rel_err(fast, ref) < 5e-2


@pytest.mark.parametrize("name", ["tiny-qwen2-random", "qwen2.5-0.5b-random"])
def test_fp32_fused_logits_match_reference(make_step, name):
    ref = _two_steps(load_model(name, DEVICE, torch.float32).model, make_step, torch.float32)
    fast_model = fuse_model(load_model(name, DEVICE, torch.float32).model, TritonPagedAttention())
    assert rel_err(_two_steps(fast_model, make_step, torch.float32), ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_matches_eager_and_pads_safely(dtype):
    """A batch of 3 replays the 4-bucket: same logits as eager, and the padded row writes nothing."""
    loaded = load_model("tiny-qwen2-random", DEVICE, dtype)
    model = fuse_model(loaded.model, TritonPagedAttention())
    cfg = model.config
    caches = [torch.randn(2, 64, 4, cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, dtype=dtype)
              for _ in range(cfg.num_hidden_layers)]
    for c in caches:
        c[:, 0].zero_()  # the null block
    mirror = BlockTableMirror(8, 16, torch.device(DEVICE))
    runner = CUDAGraphRunner(model, caches, 6, mirror, 4)
    assert runner.batch_sizes == [1, 2, 4, 6]
    before = [c.clone() for c in caches]
    seq_lens = [7, 13, 2]
    tables = [[5, 9], [11, 3, 20, 21], [30]]
    slots = [tables[i][(s - 1) // 4] * 4 + (s - 1) % 4 for i, s in enumerate(seq_lens)]
    ids, positions = [17, 99, 3], [s - 1 for s in seq_lens]
    mirror.rows_for([("x", [1, 2, 3])])  # another request's row, so the step's rows are not 1, 2, 3
    rows = mirror.rows_for([(f"r{i}", t) for i, t in enumerate(tables)])
    logits = runner.run(ids, positions, slots, seq_lens, rows).clone()

    from tandem.engine.attention.metadata import AttentionMetadata

    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(4, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        query_lens_cpu=[1, 1, 1], seq_lens_cpu=seq_lens, block_size=4)
    eager_caches = [b.clone() for b in before]
    with torch.inference_mode():
        eager = model.compute_logits(model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE),
                                           eager_caches, meta))
    assert rel_err(logits, eager) < (1e-5 if dtype == torch.float32 else 1e-2)
    for graph_cache, eager_cache, old in zip(caches, eager_caches, before):
        assert rel_err(graph_cache, eager_cache) < 1e-5
        changed = (graph_cache != old).flatten(3).any(-1).any(0).flatten().nonzero().flatten().tolist()
        assert changed == sorted(slots)


def _greedy(engine, prompts, max_tokens):
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    return list(out.values())


@pytest.mark.parametrize("name", ["tiny-llama-random", "tiny-qwen2-random", "qwen2.5-0.5b-random"])
def test_fp32_greedy_tokens_match_reference(name):
    base = [7 + (i * 13) % 200 for i in range(45)]
    # shared prefixes (prefix-cache hits), odd lengths, and 6 requests over max_active 4 so
    # decode batches of 3 replay the padded 4-bucket, chunked prefill mixed with decodes
    prompts = [base, base + [1, 2, 3], base[:20] + [9] * 11, [5, 6, 7], base[:33], list(range(60, 130))]
    kw = dict(model=name, device=DEVICE, dtype="float32", max_active=4, max_num_batched_tokens=40)
    ref_engine = LLMEngine(EngineConfig(attention_backend="torch", **kw))
    fast_engine = LLMEngine(EngineConfig(attention_backend="auto", **kw))
    runner = fast_engine.model_runner
    assert runner.attention_backend == "triton" and runner.graph_runner is not None
    replays = []
    run = runner.graph_runner.run
    runner.graph_runner.run = lambda *a, **k: replays.append(len(a[0])) or run(*a, **k)
    max_tokens = [24, 21, 18, 15, 12, 27]  # staggered finishes: decode batches of 4, 3, 2, 1
    expected = _greedy(ref_engine, prompts, max_tokens)
    assert _greedy(fast_engine, prompts, max_tokens) == expected
    assert 3 in replays and len(replays) > 20
    assert fast_engine.get_stats().prefix_cache_hits > 0


def test_cuda_defaults_to_bf16_fast_path():
    engine = LLMEngine(EngineConfig(model="tiny-qwen2-random", device=DEVICE, max_active=8))
    assert engine.dtype == torch.bfloat16
    assert engine.model_runner.attention_backend == "triton"
    assert engine.model_runner.graph_runner.batch_sizes == bucket_sizes(8) == [1, 2, 4, 8]
    tokens = _greedy(engine, [[1, 2, 3, 4], list(range(10, 40))], 8)
    assert [len(t) for t in tokens] == [8, 8]
