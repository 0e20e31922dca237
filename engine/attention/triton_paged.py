"""Paged attention in Triton: one kernel for decode, prefill, prefix hits and mixed batches.

The reference path gathers each request's context out of its blocks and calls SDPA once per
request; that costs a Python loop, a copy of the context and a host-side length per request,
none of which can live inside a CUDA graph. This backend reads the block table directly from
the kernel, so a decode step is two launches whatever the batch (write the new K/V, attend),
and the launch grid depends only on host-side sizes the runner fixes per graph bucket.

One program handles one request, one KV head and a tile of that request's new tokens. All
query heads that share the KV head (grouped-query attention) are packed into the rows of one
`tl.dot`, so each K/V tile is loaded once for the whole group: a decode step's 7 Qwen2.5 query
heads fill 7 of the 16 rows the tensor cores need, instead of 7 separate passes over the cache.
The context is walked in tiles with an online softmax (flash attention), and the causal limit
(query j of a request with `L` context tokens and `Q` new ones sees positions up to
`L - Q + j`) covers a fresh prefill, a chunk on top of a cached prefix and a decode alike.

Long contexts are split. A program walks its context tile after tile, each tile a chain of
dependent loads (block table, K, V), so a program over a 4k-token context is latency-bound
whatever the batch's size; and a step with few programs (16 decodes, a 64-token prompt on top of
a 4k-token cached prefix: a few dozen programs for 132 SMs) leaves the GPU mostly idle while
they walk. Such a step splits every context over several programs, which write unnormalised
partial results that a second small kernel merges (flash-decoding): `paged_decode` for a step of
decodes alone, the kernel below with `NUM_SPLITS` > 1 for every other step whose programs are too
few to fill the GPU. A step of many programs (a large prefill) runs unsplit.

Padded rows of a CUDA-graph bucket carry slot -1 (the write skips them) and a context of one
token in the null block 0, so they read defined memory and their output is simply ignored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634

# Launch settings (tiles of BLOCK_N context tokens, warps, pipeline stages, and how many
# programs a decode launch aims for by splitting contexts), chosen on the H200 by a sweep on
# workload W's shapes (256 decodes of 600-3,000-token contexts, with and without a 1,500-token
# prompt; results and the sweep's commit in docs/benchmarks/throughput-h200.md, "Attention
# retuned on W's shapes"). Each launch reads them, so a sweep can change them.
DECODE_TUNING = {"block_n": 128, "num_warps": 4, "num_stages": 3, "target_programs": 4096, "max_splits": 16}
PREFILL_TUNING = {"block_n": 128, "num_warps": 4, "num_stages": 3}
# A split step's partial results hold (tokens x splits) rows of every query head: 4,096 rows
# of Qwen2.5-0.5B's 14 heads are 15 MB of float32. Steps of more tokens split less, or not at all.
MAX_PARTIAL_ROWS = 4096


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    mask = (offs < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)  # slot -1: a padded row, writes nowhere
    dst = slot * stride_cache_slot + head * stride_cache_head + dim
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _attend_kv_tile(
    q, q_pos, m_i, l_i, acc, start, kv_end, table, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
    stride_cache_block, stride_cache_slot, stride_cache_head, block_size, offs_d, d_valid,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One online-softmax step over context positions [start, start + BLOCK_N), capped at kv_end,
    read through the block table; returns the updated running max, sum and accumulator."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < kv_end
    block_ids = tl.load(table + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
    kv_offs = block_ids * stride_cache_block + (offs_n % block_size) * stride_cache_slot
    kv_offs += kv_head * stride_cache_head
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(k_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2
    visible = n_valid[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, work_list_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, WORK_LIST: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
):
    # Grid dimension 1 is (KV head, split of the context): NUM_SPLITS programs per KV head.
    kv_head, split = tl.program_id(1) // NUM_SPLITS, tl.program_id(1) % NUM_SPLITS
    if WORK_LIST:  # grid (work items, KV heads x splits): the item names the request and query tile
        req = tl.load(work_list_ptr + 2 * tl.program_id(0))
        q_tile = tl.load(work_list_ptr + 2 * tl.program_id(0) + 1)
        if req < 0:
            return
    else:  # grid (requests, KV heads x splits, query tiles of the longest query)
        req, q_tile = tl.program_id(0), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest query in the batch
    num_before = seq_len - q_len  # context tokens that precede this step's new tokens

    # Row m of the tile is query token q_tile * BLOCK_Q + m // GROUP, head m % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    q_pos = num_before + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The tile's last query sees positions < kv_end; nothing past it is loaded. A split walks
    # its share of those positions' tiles.
    kv_end = tl.minimum(seq_len, num_before + (q_tile + 1) * BLOCK_Q)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS)
    kv_start = split * tiles_per_split * BLOCK_N
    kv_stop = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    for start in range(kv_start, kv_stop, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, q_pos, m_i, l_i, acc, start, kv_stop, table, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
            stride_cache_block, stride_cache_slot, stride_cache_head, block_size, offs_d, d_valid,
            CAUSAL=True, BLOCK_N=BLOCK_N, INPUT_PRECISION=INPUT_PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    else:  # partials [T, Hq, NUM_SPLITS, ...], as `_paged_decode_split_kernel` writes them
        part = (q_rows * NUM_HEADS + head) * NUM_SPLITS + split
        saw = m_valid & (offs_m * 0 + kv_start < kv_stop)  # the merge reads no split that saw nothing
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=saw[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=m_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=m_valid)


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
    block_size,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One split of one decode token's context for one KV head's query group: unnormalised acc, max, sum."""
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    kv_start = split * tiles_per_split * BLOCK_N
    kv_end = tl.minimum(seq_len, kv_start + tiles_per_split * BLOCK_N)

    offs_m = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + offs_m
    m_valid = offs_m < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    for start in range(kv_start, kv_end, BLOCK_N):  # a decode token sees its whole context: no q_pos
        m_i, l_i, acc = _attend_kv_tile(
            q, 0, m_i, l_i, acc, start, kv_end, table, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
            stride_cache_block, stride_cache_slot, stride_cache_head, block_size, offs_d, d_valid,
            CAUSAL=False, BLOCK_N=BLOCK_N, INPUT_PRECISION=INPUT_PRECISION)
    # partials are [T, Hq, NUM_SPLITS, ...]; an empty split leaves m = -inf, l = 0, acc = 0
    part = (token * NUM_HEADS + head) * NUM_SPLITS + split
    saw = m_valid & (offs_m * 0 + kv_start < kv_end)  # the merge reads no split that saw nothing
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=saw[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=m_valid)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=m_valid)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, query_start_loc_ptr, num_rows, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """One token's output for one head from its splits' partials. A token past the step's last
    (a CUDA-graph bucket's padding) has no partials and is left alone, and a split that saw none
    of the token's context (m = -inf) is not read."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_rows):
        return
    part = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    seen = m > float("-inf")
    w = tl.where(seen, tl.exp2(m - m_max), 0.0)  # a token always sees itself, so some split has seen it
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=seen[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(tl.where(seen, l, 0.0) * w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V [T, Hkv, D] at its slot in kv_cache [2, NB, BS, Hkv, D]; slot -1 skips."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_cache_layout(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache[0], kv_cache[1], slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
    )


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over each request's cached context."""
    num_kv_heads = kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    # Decode packs a lone token's query heads into the 16 rows a tensor-core dot needs; longer
    # queries stack several tokens' groups into 64 rows so each K/V tile serves them all.
    block_m = max(16, triton.next_power_of_2(group)) if max_query_len == 1 else prefill_block_m(group)
    block_q = block_m // group
    num_programs = sum(triton.cdiv(n, block_q) for n in meta.query_lens_cpu) * num_kv_heads
    grid = (meta.num_reqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    return _launch_paged_attention(q, kv_cache, meta, scale, grid, block_m, block_q, work_list=False,
                                   num_splits=num_context_splits(num_programs, q.shape[0]))


def prefill_block_m(group: int) -> int:
    """Rows of a multi-token query tile: 64 rows of stacked query groups."""
    return max(64, triton.next_power_of_2(group))


def prefill_block_q(group: int) -> int:
    """Query tokens per program for multi-token queries."""
    return prefill_block_m(group) // group


def paged_attention_work_list(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """`paged_attention` over a fixed grid of work items (request, query tile of
    `prefill_block_q` tokens) from `meta.work_list`: the launch reads no host-side lengths,
    so a CUDA graph can hold it whatever the batch. Decode rows take one tile each. The split
    count is the bucket's (from its work items and tokens), fixed when the graph is captured."""
    num_kv_heads = kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    block_q = prefill_block_q(group)
    num_splits = num_context_splits(meta.work_list.shape[0] * num_kv_heads, q.shape[0])
    grid = (meta.work_list.shape[0], num_kv_heads)
    return _launch_paged_attention(q, kv_cache, meta, scale, grid, prefill_block_m(group), block_q, work_list=True,
                                   num_splits=num_splits)


def num_context_splits(num_programs: int, num_tokens: int) -> int:
    """Splits per context for a step of `num_programs` (query tile, KV head) programs over
    `num_tokens` tokens: enough for the launch to reach `DECODE_TUNING`'s target of programs (a
    program is latency-bound: more in flight hide more of it), a power of two, at most its limit,
    and 1 once the step alone fills the GPU. The partial results take `num_tokens` x splits rows,
    kept to `MAX_PARTIAL_ROWS`."""
    splits = min(DECODE_TUNING["target_programs"] // max(1, num_programs), DECODE_TUNING["max_splits"],
                 MAX_PARTIAL_ROWS // max(1, num_tokens))
    return 1 << (max(1, splits).bit_length() - 1)


def _launch_paged_attention(q, kv_cache, meta, scale, grid, block_m, block_q, work_list: bool,
                            num_splits: int) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not written
    grid = (grid[0], grid[1] * num_splits, *grid[2:])
    _paged_attention_kernel[grid](
        q, kv_cache[0], kv_cache[1], out, part_acc, part_ml,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.work_list if work_list else meta.seq_lens,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        meta.block_size,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=_block_n(PREFILL_TUNING, q.dtype),
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WORK_LIST=work_list, NUM_SPLITS=num_splits, NUM_HEADS=num_heads,
        num_warps=PREFILL_TUNING["num_warps"], num_stages=PREFILL_TUNING["num_stages"],
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, meta.query_start_loc, meta.num_reqs, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
    return out


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 num_splits: int) -> torch.Tensor:
    """Flash-decoding: one query token per request, its context split over `num_splits` programs.

    A decode batch has too few (request, KV head) pairs to fill 132 SMs, and one program walking
    a 600-token context tile by tile is latency-bound (block-table load, then K, then V, each a
    round trip to memory). Splitting the context runs those tiles side by side; a second small
    kernel merges the partial softmaxes.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_acc = torch.empty(num_tokens, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(meta.num_reqs, num_kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], part_acc, part_ml,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * _LOG2E, q.stride(0), q.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        meta.block_size,
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=_block_n(DECODE_TUNING, q.dtype),
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=DECODE_TUNING["num_warps"], num_stages=DECODE_TUNING["num_stages"],
    )
    out = torch.empty_like(q)
    _merge_splits_kernel[(num_tokens, num_heads)](
        part_acc, part_ml, out, meta.query_start_loc, meta.num_reqs, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
    )
    return out


def _block_n(tuning: dict, dtype: torch.dtype) -> int:
    """The tuned context tile for 16-bit caches; float32 tiles stay at 64 tokens so the
    pipelined K/V tiles fit in shared memory (the tuning was measured on bf16)."""
    return tuning["block_n"] if dtype.itemsize <= 2 else min(64, tuning["block_n"])


def num_decode_splits(num_reqs: int, num_kv_heads: int) -> int:
    """`num_context_splits` for a step of decodes alone: one program per (request, KV head)."""
    return num_context_splits(num_reqs * num_kv_heads, num_reqs)


def _check_cache_layout(kv_cache: torch.Tensor) -> None:
    """The kernels index slots as block * block_size + offset over a dense last three dims."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    s = kv_cache.stride()
    if s[4] != 1 or s[3] != head_dim or s[2] != num_kv_heads * head_dim or s[1] != block_size * s[2]:
        raise ValueError(f"kv_cache must be dense in its last four dims, got strides {s}")


class TritonPagedAttention:
    """Same interface as `TorchRefAttention`; stateless, so one instance serves every layer.

    It reads only device tensors and the host-side maximum query length (which sizes the grid),
    never a per-request host list, so the runner can capture it in a CUDA graph.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, NB, BS, Hkv, D] -> [T, Hq, D]."""
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        if meta.work_list is not None:
            return paged_attention_work_list(q, kv_cache, meta, scale)
        max_query_len = max(meta.query_lens_cpu)
        if max_query_len == 1 and q.shape[0] == meta.num_reqs:
            num_splits = num_decode_splits(meta.num_reqs, kv_cache.shape[3])
            if num_splits > 1:
                return paged_decode(q, kv_cache, meta, scale, num_splits)
        return paged_attention(q, kv_cache, meta, scale, max_query_len)

    __call__ = forward
