"""TorchRefAttention against dense causal attention computed from each request's full K/V.

The paged path must give the same output whatever mix of fresh prefills, prefill chunks on top
of cached context and decode tokens shares the flat batch, and must write each new token's K/V
to exactly its slot.
"""

import math

import pytest
import torch

from tandem.engine.attention import TorchRefAttention

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def dense_attention(q, k, v, scale):
    """q [Q, Hq, D] are the last Q positions of a sequence with k/v [S, Hkv, D]."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_step(reqs, num_heads, num_kv_heads, make_step, head_dim=8):
    """Cache the context of every request, then attend its new tokens; return (out, expected, cache, meta)."""
    torch.manual_seed(0)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    full = [
        (torch.randn(c + n, num_heads, head_dim), torch.randn(c + n, num_kv_heads, head_dim),
         torch.randn(c + n, num_kv_heads, head_dim))
        for c, n in reqs
    ]
    backend, scale = TorchRefAttention(), 1 / math.sqrt(head_dim)
    _, prior = make_step([(0, c) for c, _ in reqs], BLOCK_SIZE)
    if any(c for c, _ in reqs):
        k0 = torch.cat([k[:c] for (c, _), (_, k, _) in zip(reqs, full)])
        v0 = torch.cat([v[:c] for (c, _), (_, _, v) in zip(reqs, full)])
        backend.forward(torch.zeros(len(k0), num_heads, head_dim), k0, v0, cache, prior, scale)
    _, meta = make_step(reqs, BLOCK_SIZE)
    q, k, v = (torch.cat([t[c:] for (c, _), t in zip(reqs, ts)]) for ts in zip(*full))
    out = backend.forward(q, k, v, cache, meta, scale)
    expected = torch.cat([dense_attention(fq[c:], fk, fv, scale) for (c, _), (fq, fk, fv) in zip(reqs, full)])
    return out, expected, cache, meta


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, make_step):
    # fresh prefill, decode on a cached context, prefill chunk on a cached context
    reqs = [(0, 5), (6, 1), (9, 4)]
    out, expected, _, _ = run_step(reqs, num_heads, num_kv_heads, make_step)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "reqs",
    [
        [(3, 1), (8, 1), (13, 1)],  # decode-only, lengths differ (padding mask)
        [(7, 1), (7, 1)],  # decode-only, equal lengths (no mask)
        [(6, 1), (3, 1), (0, 5), (9, 1), (4, 3)],  # leading decodes batched, the rest one by one
    ],
)
def test_decode_batches_match_dense(reqs, make_step):
    out, expected, _, _ = run_step(reqs, 4, 2, make_step)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_new_kv_lands_at_its_slot(make_step):
    torch.manual_seed(0)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8)
    _, meta = make_step([(0, 6), (0, 3)], BLOCK_SIZE)
    k, v = torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    TorchRefAttention().forward(torch.randn(9, 4, 8), k, v, cache, meta, 0.5)
    flat = cache.view(2, -1, 2, 8)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v, atol=0, rtol=0)
    # strided blocks: request 0 owns blocks 1 and 3, request 1 owns block 2
    assert meta.slot_mapping.tolist() == [4, 5, 6, 7, 12, 13, 8, 9, 10]


def test_negative_slot_writes_nowhere(make_step):
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8)
    _, meta = make_step([(0, 3)], BLOCK_SIZE)
    meta.slot_mapping[1] = -1
    TorchRefAttention().forward(torch.randn(3, 4, 8), torch.ones(3, 2, 8), torch.ones(3, 2, 8), cache, meta, 0.5)
    written = (cache.view(2, -1, 16) != 0).all(-1)
    assert written[0].nonzero().flatten().tolist() == [4, 6]
    assert written[1].nonzero().flatten().tolist() == [4, 6]


def test_repeated_kv_fallback_matches_native_gqa(make_step, monkeypatch):
    """Old torch and MPS before 2.7 lack SDPA's enable_gqa; the repeat_interleave path must agree."""
    from tandem.engine.attention import torch_ref

    monkeypatch.setattr(torch_ref, "_native_gqa", lambda device: False)
    out, expected, _, _ = run_step([(2, 1), (5, 1), (0, 6), (7, 3)], 6, 2, make_step)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_layers_share_one_plan_per_step(make_step):
    """One backend serves every layer: the per-step plan is reused within a step, rebuilt for the next."""
    torch.manual_seed(0)
    backend, scale = TorchRefAttention(), 0.5
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8) for _ in range(2)]
    prompts = [(torch.randn(n, 2, 8), torch.randn(n, 2, 8)) for n in (5, 9)]
    _, prefill = make_step([(0, 5), (0, 9)], BLOCK_SIZE)
    k0, v0 = (torch.cat(t) for t in zip(*prompts))
    for cache in caches:  # two layers, one metadata object
        backend.forward(torch.randn(14, 4, 8), k0, v0, cache, prefill, scale)
    for step, lens in enumerate([(5, 9), (6, 10)]):
        _, meta = make_step([(lens[0], 1), (lens[1], 1)], BLOCK_SIZE)
        q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
        for cache in caches:
            out = backend.forward(q, k, v, cache, meta, scale)
            flat = cache.view(2, -1, 2, 8)
            for i, seq_len in enumerate(n + 1 for n in lens):
                slots = make_step_slots(meta, i, seq_len)
                expected = dense_attention(q[i : i + 1], flat[0, slots], flat[1, slots], scale)
                torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def make_step_slots(meta, i, seq_len):
    """Request i's context slots, read from its block table."""
    blocks = meta.block_tables[i, : -(-seq_len // BLOCK_SIZE)].long()
    return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:seq_len]
