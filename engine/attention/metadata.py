"""What one forward step tells the attention layers about the batch.

The runner flattens every scheduled token of every request into one sequence of `T` tokens
(vLLM's varlen layout), so prefill chunks and decode tokens run in the same forward. Each
attention layer needs to know where each request's new tokens sit in that flat batch, where to
write their K/V in the paged cache (`slot_mapping`), and which blocks hold the request's whole
context (`block_tables`). Host-side copies of the per-request lengths let the reference path
loop over requests without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [B + 1] int32 on device: request i's new tokens are flat rows query_start_loc[i]:query_start_loc[i+1].
    query_start_loc: torch.Tensor
    # [B] int32 on device: context length after this step (computed before + scheduled now).
    seq_lens: torch.Tensor
    # [T] int64 on device: cache slot (block_id * block_size + offset) of each new token; -1 writes nowhere.
    slot_mapping: torch.Tensor
    # [B, max_num_blocks] int32 on device, padded with 0: the blocks of each request's context, in order.
    block_tables: torch.Tensor
    # Host copies (python ints) of the same lengths.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # [W, 2] int32 on device, or None: (request, query tile) per attention program, -1 for none.
    # Set by CUDA-graph steps, whose launch grid must not depend on the batch; backends that
    # do not use it (the reference path) ignore it.
    work_list: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
