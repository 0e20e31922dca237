"""Runs one scheduled step on the device: build the flat batch, forward, sample.

The runner owns everything with tensors: the model, the paged KV cache tensors, and the
translation from the scheduler's plain-Python decisions (request, number of tokens) into
`input_ids`, `positions`, `slot_mapping` and `block_tables`. Inputs are built on the host in
one go and copied with a single transfer per tensor; the only device-to-host sync of a step is
reading the sampled ids back.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.manager import KVCacheManager
from engine.model.loader import LoadedModel
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int) -> None:
        self.model = loaded.model
        self.model_config = loaded.model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(loaded.sampling_vocab_size)
        self.kv_caches = self._allocate_kv_caches(num_blocks)

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        cfg = self.model_config
        shape = (2, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(cfg.num_hidden_layers)]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * model_config.num_key_value_heads * model_config.head_dim
        return per_token * block_size * model_config.num_hidden_layers * dtype.itemsize

    def prepare_inputs(self, sched: SchedulerOutput, kv_manager: KVCacheManager):
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        bs = self.block_size
        for s in sched.scheduled:
            req, n = s.request, s.num_scheduled_tokens
            start = req.num_computed_tokens
            block_ids = kv_manager.get_block_ids(req.req_id)
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(block_ids)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=torch.tensor(padded, dtype=torch.int32).to(dev, non_blocking=True),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, pos, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv_manager: KVCacheManager,
                rows: dict[str, SamplingRow]) -> dict[str, int]:
        """Forward the scheduled tokens; sample for requests whose prompt is now complete."""
        ids, pos, meta = self.prepare_inputs(sched, kv_manager)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        sample_reqs, last_rows, offset = [], [], 0
        for s in sched.scheduled:
            offset += s.num_scheduled_tokens
            if s.completes_prefill:
                sample_reqs.append(s.request.req_id)
                last_rows.append(offset - 1)
        if not sample_reqs:
            return {}
        index = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        tokens = self.sampler(logits, [rows[r] for r in sample_reqs])
        return dict(zip(sample_reqs, tokens))
