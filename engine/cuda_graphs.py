"""CUDA graphs for decode steps: the whole forward and the logits replayed as one launch.

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
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.host_tensors import int_tensor


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


class CUDAGraphRunner:
    """Captured decode forwards (+ logits) for every bucket; `run` pads a batch into the smallest."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch_size: int,
                 max_blocks_per_seq: int, block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.batch_sizes = bucket_sizes(max_batch_size)
        device = kv_caches[0].device
        n = self.batch_sizes[-1]
        # Rows 0..3 of one buffer: input ids, positions, slots, context lengths. One host-to-device
        # copy fills a step's rows of all four.
        self.inputs = torch.zeros(4, n, dtype=torch.int64, device=device)
        self.inputs[2].fill_(-1)
        self.inputs[3].fill_(1)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.inputs[3, :batch_size],
            slot_mapping=self.inputs[2, :batch_size],
            block_tables=self.block_tables[:batch_size],
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
        pool = None
        for batch_size in reversed(self.batch_sizes):
            # An eager run first compiles the Triton kernels and lets cuBLAS choose its kernels
            # outside the capture; the padded inputs write nothing to the cache.
            self._forward(batch_size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[batch_size] = self._forward(batch_size)
            pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """One decode token per request; returns float32 logits [len(input_ids), vocab]."""
        num_reqs = len(input_ids)
        batch_size = next(b for b in self.batch_sizes if b >= num_reqs)
        rows, table = pack_decode_inputs(input_ids, positions, slots, seq_lens, block_tables, batch_size)
        self.inputs[:, :batch_size].copy_(rows, non_blocking=True)
        # Only the first ceil(seq_len / block_size) entries of a row are read, so columns past
        # this step's widest table may keep stale block ids; padded rows read column 0, set to 0.
        self.block_tables[:batch_size, : table.shape[1]].copy_(table, non_blocking=True)
        self.graphs[batch_size].replay()
        return self.logits[batch_size][:num_reqs]


def pack_decode_inputs(input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph's inputs for one decode step, padded to `batch_size` rows, as host tensors:
    int64 [4, batch_size] (token ids, positions, slots, sequence lengths; padded rows write to
    slot -1, i.e. nowhere) and the int32 block table [batch_size, widest table]."""
    pad = batch_size - len(input_ids)
    rows = int_tensor(input_ids + [0] * pad + positions + [0] * pad + slots + [-1] * pad + seq_lens + [1] * pad,
                      torch.int64).view(4, batch_size)
    width = max(len(t) for t in block_tables)
    table: list[int] = []
    for t in block_tables:
        table += t
        table += [0] * (width - len(t))
    table += [0] * (width * pad)
    return rows, int_tensor(table, torch.int32).view(batch_size, width)
