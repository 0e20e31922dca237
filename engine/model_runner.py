"""Runs one scheduled step on the device: build the flat batch, forward, sample.

The runner owns everything with tensors: the model, the paged KV cache tensors, and the
translation from the scheduler's plain-Python decisions (request, number of tokens) into
`input_ids`, `positions`, `slot_mapping` and `block_tables`. Inputs are built on the host in
one go and copied with a single transfer per tensor; the only device-to-host sync of a step is
reading the sampled ids back.

On cuda the runner takes the fast path unless `attention_backend="torch"` asks for the
reference: the layers are fused (`engine/model/fused_layers.py`), attention reads the block
table in Triton (`engine/attention/triton_paged.py`), and decode-only steps replay a CUDA graph
per batch-size bucket (`engine/cuda_graphs.py`). Prefill and mixed steps run the same fused
model eagerly. Everything else, mps included, runs the reference path.
"""

from __future__ import annotations

import importlib.util

import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.host_tensors import int_tensor
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.model.loader import LoadedModel
from tandem.engine.sampler import Sampler, SamplingRow
from tandem.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, attention_backend: str = "torch",
                 max_num_seqs: int = 4, max_model_len: int = 2048, enforce_eager: bool = False,
                 pack_cpu_weights: bool = True) -> None:
        self.model = loaded.model
        self.model_config = loaded.model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(loaded.sampling_vocab_size)
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.attention_backend = resolve_attention_backend(attention_backend, device)
        self.graph_runner = None
        self.num_packed_linears = 0
        if self.attention_backend == "triton":
            self._enable_fast_path(max_num_seqs, max_model_len, enforce_eager)
        elif device.type == "cpu" and pack_cpu_weights:
            from tandem.engine.model.cpu_linear import pack_model

            self.num_packed_linears = pack_model(self.model)

    def _enable_fast_path(self, max_num_seqs: int, max_model_len: int, enforce_eager: bool) -> None:
        from tandem.engine.attention.triton_paged import TritonPagedAttention
        from tandem.engine.model.fused_layers import fuse_model

        fuse_model(self.model, TritonPagedAttention())
        if not enforce_eager and self.device.type == "cuda":
            from tandem.engine.cuda_graphs import CUDAGraphRunner

            max_blocks_per_seq = -(-max_model_len // self.block_size)
            self.graph_runner = CUDAGraphRunner(self.model, self.kv_caches, max_num_seqs,
                                                max_blocks_per_seq, self.block_size)

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
            if n == 1:  # a decode: no per-token ranges
                input_ids.append(req.all_token_ids[start])
                positions.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(req.all_token_ids[start : start + n])
                positions.extend(range(start, start + n))
                slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(block_ids)
        max_blocks = max(len(t) for t in tables)
        flat_tables = []
        for t in tables:
            flat_tables += t
            flat_tables += [0] * (max_blocks - len(t))
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=int_tensor(query_start, torch.int32).to(dev, non_blocking=True),
            seq_lens=int_tensor(seq_lens, torch.int32).to(dev, non_blocking=True),
            slot_mapping=int_tensor(slots, torch.int64).to(dev, non_blocking=True),
            block_tables=int_tensor(flat_tables, torch.int32).view(len(tables), max_blocks).to(dev, non_blocking=True),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        ids = int_tensor(input_ids, torch.int64).to(dev, non_blocking=True)
        pos = int_tensor(positions, torch.int64).to(dev, non_blocking=True)
        return ids, pos, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv_manager: KVCacheManager,
                rows: dict[str, SamplingRow]) -> dict[str, int]:
        """Forward the scheduled tokens; sample for requests whose prompt is now complete."""
        sample_reqs = [s.request.req_id for s in sched.scheduled if s.completes_prefill]
        if self._replays_graph(sched):
            logits = self._execute_decode_graph(sched, kv_manager)
            if len(sample_reqs) < len(sched.scheduled):  # a 1-token prefill chunk samples nothing
                keep = [i for i, s in enumerate(sched.scheduled) if s.completes_prefill]
                logits = logits[keep]
        else:
            logits = self._execute_eager(sched, kv_manager)
        if not sample_reqs:
            return {}
        tokens = self.sampler(logits, [rows[r] for r in sample_reqs])
        return dict(zip(sample_reqs, tokens))

    def _execute_eager(self, sched: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor | None:
        """The flat varlen forward; logits at each sampling request's last token (None if none)."""
        ids, pos, meta = self.prepare_inputs(sched, kv_manager)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        last_rows, offset = [], 0
        for s in sched.scheduled:
            offset += s.num_scheduled_tokens
            if s.completes_prefill:
                last_rows.append(offset - 1)
        if not last_rows:
            return None
        index = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index))

    def _replays_graph(self, sched: SchedulerOutput) -> bool:
        return (self.graph_runner is not None and len(sched.scheduled) <= self.graph_runner.max_batch_size
                and all(s.num_scheduled_tokens == 1 for s in sched.scheduled))

    def _execute_decode_graph(self, sched: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """One token per request, straight into the graph's static buffers; logits for every row."""
        bs = self.block_size
        ids, pos, slots, seq_lens, tables = [], [], [], [], []
        for s in sched.scheduled:
            req = s.request
            p = req.num_computed_tokens
            block_ids = kv_manager.get_block_ids(req.req_id)
            ids.append(req.all_token_ids[p])
            pos.append(p)
            slots.append(block_ids[p // bs] * bs + p % bs)
            seq_lens.append(p + 1)
            tables.append(block_ids)
        return self.graph_runner.run(ids, pos, slots, seq_lens, tables)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"auto" is the fast path on cuda when Triton is installed, else the reference "torch"."""
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton" and not has_triton:
        raise RuntimeError("attention_backend='triton' needs the triton package (pip install triton)")
    if name not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton; got {name!r}")
    return name
