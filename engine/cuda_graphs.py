"""CUDA graphs for every step: the whole forward and the logits replayed as one launch.

A decode step of a small model is launch-bound: ~250 kernels of a few microseconds each, which
Python issues more slowly than the GPU runs them. Capturing the step once per batch-size bucket
and replaying it leaves one launch per step, so the GPU runs the kernels back to back.

A graph replays fixed addresses and shapes, so every input lives in a static buffer sized for
the largest bucket, a step copies its rows in and replays the smallest bucket that holds its
batch, and the padded rows are made harmless: slot -1 (their K/V is written nowhere), a context
of one token read from the null block 0, token and position 0. Their logits are computed and
ignored. The attention backend must read only device tensors (plus the maximum query length,
which is 1 for every decode bucket); `TritonPagedAttention` does.

Buckets are 1, 2, 4, 8, then every multiple of 8 up to the engine's `max_active`, captured
largest first into one shared memory pool (vLLM's scheme), so intermediate activations of all
buckets share memory and only each bucket's logits buffer is its own.

Prefill and mixed steps (`MixedGraphRunner`) are captured per token-count bucket (256-token
steps up to 2,048, then 512 up to 4,096, then 1,024 up to the step budget). Eagerly, such a step
costs ~10 ms of host time to launch ~300 kernels while the GPU needs 1-5 ms. Attention is the
one kernel whose launch grid depends on the batch (requests times query tiles); in a graph it
runs over a fixed grid of work items, one per (request, query tile), read from a device buffer
the host fills each step (`build_work_list`); items past the step's last are -1 and exit at
once. Padded tokens write their K/V nowhere (slot -1), are in no work item, and their rows of
the flat batch (row-independent everywhere else) are simply never sampled.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.block_table import BlockTableMirror
from tandem.engine.host_tensors import int_tensor


def _pinned(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Host values staged in pinned memory, so the copy to the device never waits for it."""
    return int_tensor(values, dtype).pin_memory()


def capture_graph(forward, pool):
    """Run `forward` once eagerly (Triton compiles its kernels and cuBLAS picks its own outside
    the capture), then capture it into a CUDA graph sharing `pool` with the graphs before it.
    Returns (graph, its static output, the pool for the next capture)."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output, graph.pool()


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


class CUDAGraphRunner:
    """Captured decode forwards (+ logits) for every bucket; `run` pads a batch into the smallest."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch_size: int,
                 block_table: BlockTableMirror, block_size: int, pool=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.batch_sizes = bucket_sizes(max_batch_size)
        self.block_table = block_table
        device = kv_caches[0].device
        n = self.batch_sizes[-1]
        # Rows 0..4 of one buffer: input ids, positions, slots, context lengths, block-table
        # rows. One host-to-device copy fills a step's rows of all five.
        self.inputs = torch.zeros(5, n, dtype=torch.int64, device=device)
        self.inputs[2].fill_(-1)
        self.inputs[3].fill_(1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = pool
        self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.inputs[3, :batch_size],
            slot_mapping=self.inputs[2, :batch_size],
            block_tables=self.block_table.table.index_select(0, self.inputs[4, :batch_size]),
            query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=[1] * batch_size,  # unused by graph-safe backends
            block_size=self.block_size,
        )

    def _forward(self, batch_size: int) -> torch.Tensor:
        hidden = self.model(self.inputs[0, :batch_size], self.inputs[1, :batch_size], self.kv_caches,
                            self._metadata(batch_size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = self.pool
        for batch_size in reversed(self.batch_sizes):  # the padded inputs write nothing to the cache
            self.graphs[batch_size], self.logits[batch_size], pool = capture_graph(
                lambda: self._forward(batch_size), pool)
        self.pool = pool
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            table_rows: list[int], before_replay=None) -> torch.Tensor:
        """One decode token per request (its block table in `table_rows` of the shared
        `BlockTableMirror`); returns float32 logits [len(input_ids), vocab].
        `before_replay(inputs)` may patch the static inputs on the device (placeholder ids)."""
        num_reqs = len(input_ids)
        batch_size = next(b for b in self.batch_sizes if b >= num_reqs)
        rows = pack_decode_inputs(input_ids, positions, slots, seq_lens, table_rows, batch_size)
        self.inputs[:, :batch_size].copy_(rows.pin_memory(), non_blocking=True)
        if before_replay is not None:
            before_replay(self.inputs)
        self.graphs[batch_size].replay()
        return self.logits[batch_size][:num_reqs]


def pack_decode_inputs(input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
                       table_rows: list[int], batch_size: int) -> torch.Tensor:
    """The graph's inputs for one decode step, padded to `batch_size` rows, as one host tensor:
    int64 [5, batch_size] (token ids, positions, slots, sequence lengths, block-table rows;
    padded rows write to slot -1, i.e. nowhere, and read the all-zero table row 0)."""
    pad = batch_size - len(input_ids)
    zeros = [0] * pad
    return int_tensor(input_ids + zeros + positions + zeros + slots + [-1] * pad + seq_lens + [1] * pad
                      + table_rows + zeros, torch.int64).view(5, batch_size)


def token_buckets(max_num_tokens: int) -> list[int]:
    """Token counts a prefill or mixed step is padded to: fine steps where a step is short
    (a few hundred decodes plus a prompt) and padding costs most, coarser ones above."""
    sizes = [*range(256, 2049, 256), *range(2560, 4097, 512), *range(5120, max_num_tokens, 1024)]
    return [s for s in sizes if s < max_num_tokens] + [max_num_tokens]


def build_work_list(query_lens: list[int], block_q: int) -> list[int]:
    """Flat (request index, query tile) pairs covering every request's new tokens in tiles of
    `block_q` tokens, in request order."""
    work: list[int] = []
    for i, n in enumerate(query_lens):
        tiles = -(-n // block_q)
        if tiles == 1:
            work += (i, 0)
        else:
            pairs = [0] * (2 * tiles)
            pairs[0::2] = [i] * tiles
            pairs[1::2] = range(tiles)
            work += pairs
    return work


class MixedGraphRunner:
    """Captured forwards (+ logits of the sampled rows) for prefill and mixed steps, one per
    token-count bucket; `run` pads a step into the smallest bucket that holds it."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 block_table: BlockTableMirror, block_size: int, max_num_tokens: int, group: int) -> None:
        from tandem.engine.attention.triton_paged import prefill_block_q

        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_sizes = token_buckets(max_num_tokens)
        self.block_q = prefill_block_q(group)
        device = kv_caches[0].device
        top = self.token_sizes[-1]
        # One int64 buffer (ids, positions, slots, sampled rows, block-table rows) and one int32
        # buffer (query starts, sequence lengths, work list), laid out per bucket: one copy each.
        self.block_table = block_table
        self.i64 = torch.zeros(3 * top + 2 * self.num_seqs(top), dtype=torch.int64, device=device)
        self.i32 = torch.zeros(2 * self.num_seqs(top) + 1 + 2 * self.work_size(top), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture()

    @property
    def max_num_tokens(self) -> int:
        return self.token_sizes[-1]

    def num_seqs(self, num_tokens: int) -> int:
        return min(self.max_num_seqs, num_tokens)

    def work_size(self, num_tokens: int) -> int:
        """Work items a bucket's grid has: enough for any split of its tokens among its requests."""
        return -(-num_tokens // self.block_q) + self.num_seqs(num_tokens)

    def _views(self, t: int):
        r, w = self.num_seqs(t), self.work_size(t)
        i64, i32 = self.i64, self.i32
        return (i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t], i64[3 * t : 3 * t + r], i64[3 * t + r : 3 * t + 2 * r],
                i32[: r + 1], i32[r + 1 : 2 * r + 1], i32[2 * r + 1 : 2 * r + 1 + 2 * w].view(w, 2))

    def _forward(self, num_tokens: int) -> torch.Tensor:
        ids, pos, slots, rows, table_rows, query_start, seq_lens, work = self._views(num_tokens)
        r = self.num_seqs(num_tokens)
        meta = AttentionMetadata(query_start_loc=query_start, seq_lens=seq_lens, slot_mapping=slots,
                                 block_tables=self.block_table.table.index_select(0, table_rows),
                                 query_lens_cpu=[1] * r,
                                 seq_lens_cpu=[1] * r, block_size=self.block_size, work_list=work)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        return self.model.compute_logits(hidden.index_select(0, rows))

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for num_tokens in reversed(self.token_sizes):
            # Harmless inputs: token 0 at position 0, K/V written nowhere, no attention work.
            _, _, slots, _, _, _, seq_lens, work = self._views(num_tokens)
            self.i64.zero_()
            self.i32.zero_()
            slots.fill_(-1)
            seq_lens.fill_(1)
            work.fill_(-1)
            self.graphs[num_tokens], self.logits[num_tokens], pool = capture_graph(
                lambda: self._forward(num_tokens), pool)
        self.pool = pool
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
            seq_lens: list[int], table_rows: list[int], sample_rows: list[int],
            before_replay=None) -> torch.Tensor:
        """A flat varlen step (each request's block table in `table_rows` of the shared
        `BlockTableMirror`); returns float32 logits [len(sample_rows), vocab] of those flat rows.
        `before_replay(input_ids)` may patch the static ids on the device (placeholder ids)."""
        num_tokens, num_reqs = len(input_ids), len(query_lens)
        t = next(b for b in self.token_sizes if b >= num_tokens)
        r, w = self.num_seqs(t), self.work_size(t)
        pad = t - num_tokens
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        work = build_work_list(query_lens, self.block_q)
        i64 = (input_ids + [0] * pad + positions + [0] * pad + slots + [-1] * pad
               + sample_rows + [0] * (r - len(sample_rows)) + table_rows + [0] * (r - num_reqs))
        i32 = (query_start + [num_tokens] * (r - num_reqs) + seq_lens + [1] * (r - num_reqs)
               + work + [-1] * (2 * w - len(work)))
        self.i64[: len(i64)].copy_(_pinned(i64, torch.int64), non_blocking=True)
        self.i32[: len(i32)].copy_(_pinned(i32, torch.int32), non_blocking=True)
        if before_replay is not None:
            before_replay(self.i64[:t])
        self.graphs[t].replay()
        return self.logits[t][: len(sample_rows)]
