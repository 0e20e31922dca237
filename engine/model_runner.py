"""Runs one scheduled step on the device: build the flat batch, forward, sample.

The runner owns everything with tensors: the model, the paged KV cache tensors (and a host KV
tier's, whose copies it runs before each step's forward: engine/kv_host_cache.py), and the
translation from the scheduler's plain-Python decisions (request, number of tokens) into
`input_ids`, `positions`, `slot_mapping` and `block_tables`. Inputs are built on the host in
one go and copied with a single transfer per tensor (from pinned memory on cuda, so the copy
never waits for the device).

`launch` enqueues a step and returns at once with a `StepHandle`: the sampled ids (and the
logprobs of rows that asked for them) stay on the device, and asynchronous copies bring them to
pinned host memory behind one event, which `StepHandle.tokens` waits for. So the engine can plan and launch step N+1 while step N runs. A request whose last
token is still such a placeholder (`PLACEHOLDER_TOKEN`) gets its input id from the previous
step's sampled ids on the device, gathered by a small index copy before the forward.

On cuda the runner takes the fast path unless `attention_backend="torch"` asks for the
reference: the layers are fused (`engine/model/fused_layers.py`), attention reads the block
table in Triton (`engine/attention/triton_paged.py`), decode-only steps replay a CUDA graph per
batch-size bucket and prefill and mixed steps one per token-count bucket
(`engine/cuda_graphs.py`). Steps larger than the biggest bucket run the fused model eagerly.
Everything else, mps included, runs the reference path.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace

import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.host_tensors import to_device
from tandem.engine.kv_cache.host_tier import KVTransfers
from tandem.engine.kv_cache.manager import KVCacheManager
from tandem.engine.kv_host_cache import HostKVCache
from tandem.engine.model.loader import LoadedModel
from tandem.engine.request import PLACEHOLDER_TOKEN
from tandem.engine.sampler import LogprobsTensors, Sampler, SamplingRow
from tandem.engine.scheduler import SchedulerOutput


logger = logging.getLogger("tandem.engine")

class StepHandle:
    """A launched step's sampled ids (and logprobs, for rows that asked), on their way to the host."""

    def __init__(self, sampled: torch.Tensor | None = None, logprobs: LogprobsTensors | None = None) -> None:
        self.num_sampled = 0 if sampled is None else sampled.shape[0]
        self._host = sampled
        self._logprobs = logprobs
        self._event = None
        if sampled is not None and sampled.device.type == "cuda":
            self._host = _to_pinned(sampled)
            if logprobs is not None:
                self._logprobs = replace(logprobs, sampled=_to_pinned(logprobs.sampled),
                                         top_ids=_to_pinned(logprobs.top_ids),
                                         top_logprobs=_to_pinned(logprobs.top_logprobs))
            self._event = torch.cuda.Event()
            self._event.record()

    def tokens(self) -> list[int]:
        """The sampled ids in sampling order; waits for the copy (the step's only sync)."""
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def logprobs(self) -> dict[int, tuple]:
        """Sampling row -> (sampled token's logprob, top ids, top logprobs), for the rows that
        asked; call after `tokens`."""
        lp = self._logprobs
        if lp is None:
            return {}
        sampled, top_ids, top_logprobs = lp.sampled.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()
        return {row: (sampled[i], top_ids[i][:k], top_logprobs[i][:k])
                for i, (row, k) in enumerate(zip(lp.rows, lp.num_top))}


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class ModelRunner:
    def __init__(self, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, attention_backend: str = "torch",
                 max_num_seqs: int = 4, max_model_len: int = 2048, enforce_eager: bool = False,
                 pack_cpu_weights: bool = True, max_num_batched_tokens: int = 0, cpu_compile: bool = False,
                 ggml_graph: bool = False, num_host_blocks: int = 0) -> None:
        self.model = loaded.model
        self.model_config = loaded.model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(loaded.sampling_vocab_size)
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        # The host KV tier's tensors (engine/kv_host_cache.py); None without a host tier.
        self.host_kv_cache = self._make_host_kv_cache(num_host_blocks)
        self.attention_backend = resolve_attention_backend(attention_backend, device)
        self.graph_runner = None
        self.mixed_graph_runner = None
        self.block_table = None  # the graphs' device-resident block tables
        # CPU decode steps: compiled graphs (engine/model/cpu_compile.py) or ggml graphs (engine/model/ggml_decode.py)
        self.cpu_decode = None
        self.num_packed_linears = 0
        # The last launched step's sampled ids (device) and each sampling request's row in them.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        if self.attention_backend == "triton":
            self._enable_fast_path(max_num_seqs, max_model_len, enforce_eager, max_num_batched_tokens)
        elif device.type == "cpu" and pack_cpu_weights:
            self._prepare_cpu_model(block_size, max_num_seqs, cpu_compile, ggml_graph)

    def _prepare_cpu_model(self, block_size: int, max_num_seqs: int, cpu_compile: bool, ggml_graph: bool) -> None:
        """Packed linears and few-call layers for eager steps; decode steps through compiled graphs
        or ggml graphs where asked."""
        from tandem.engine.model.cpu_layers import fuse_cpu_model
        from tandem.engine.model.cpu_linear import pack_model

        graph_rows = None
        if ggml_graph:
            from tandem.engine.model.ggml_decode import GraphRows
            from tandem.engine.model.huge_pages import move_to_huge_pages

            move_to_huge_pages(self.model)  # the graph's steps stream every weight (engine/model/huge_pages.py)
            graph_rows = GraphRows.of(self.model)  # plain rows, before packing replaces the linears
        self.num_packed_linears = pack_model(self.model)
        fuse_cpu_model(self.model)  # few-call layers (engine/model/cpu_layers.py)
        if cpu_compile:
            from tandem.engine.model.cpu_compile import CompiledCPUDecode

            self.cpu_decode = CompiledCPUDecode(self.model, self.kv_caches, block_size)
            self.cpu_decode.warm_up((1, 2) if max_num_seqs > 1 else (1,))
        elif ggml_graph:
            from tandem.engine.model.ggml_decode import GGMLGraphDecode

            self.cpu_decode = GGMLGraphDecode(self.model, self.kv_caches, block_size, rows=graph_rows)

    def _enable_fast_path(self, max_num_seqs: int, max_model_len: int, enforce_eager: bool,
                          max_num_batched_tokens: int) -> None:
        from tandem.engine.attention.triton_paged import TritonPagedAttention
        from tandem.engine.model.fused_layers import fuse_model

        fuse_model(self.model, TritonPagedAttention())
        if not enforce_eager and self.device.type == "cuda":
            from tandem.engine.block_table import BlockTableMirror
            from tandem.engine.cuda_graphs import CUDAGraphRunner, MixedGraphRunner

            max_blocks_per_seq = -(-max_model_len // self.block_size)
            self.block_table = BlockTableMirror(2 * max_num_seqs + 8, max_blocks_per_seq, self.device)
            cfg = self.model_config
            if max_num_batched_tokens > max_num_seqs:
                self.mixed_graph_runner = MixedGraphRunner(
                    self.model, self.kv_caches, max_num_seqs, self.block_table, self.block_size,
                    max_num_batched_tokens, cfg.num_attention_heads // cfg.num_key_value_heads)
            self.graph_runner = CUDAGraphRunner(self.model, self.kv_caches, max_num_seqs,
                                                self.block_table, self.block_size,
                                                pool=self.mixed_graph_runner.pool if self.mixed_graph_runner else None)

    @property
    def num_host_blocks(self) -> int:
        """The host KV tier's blocks this runner holds (0: none)."""
        return 0 if self.host_kv_cache is None else self.host_kv_cache.num_blocks

    def _make_host_kv_cache(self, num_blocks: int) -> HostKVCache | None:
        """The host tier's tensors, or None: none asked for, or the host could not give them (pinned
        memory refused, or not addressable from the GPU). A tier is an optimisation: the engine
        then runs without one and says why, as it would with the tier off."""
        if not num_blocks:
            return None
        try:
            return HostKVCache(self.kv_caches, num_blocks)
        except (RuntimeError, ValueError) as exc:  # torch's OutOfMemoryError is a RuntimeError
            logger.warning("no host KV tier: %d blocks of host memory could not be set up (%s: %s)",
                           num_blocks, type(exc).__name__, str(exc)[:300])
            return None

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        cfg = self.model_config
        shape = (2, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(cfg.num_hidden_layers)]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * model_config.num_key_value_heads * model_config.head_dim
        return per_token * block_size * model_config.num_hidden_layers * dtype.itemsize

    # -- host-side inputs ---------------------------------------------------------------------
    def build_inputs(self, sched: SchedulerOutput, kv_manager: KVCacheManager):
        """The flat batch as Python lists: input ids, positions, slots, per-request query and
        sequence lengths, block tables, and (flat row, request id) of each placeholder input."""
        input_ids, positions, slots, query_lens, seq_lens, tables, pending = [], [], [], [], [], [], []
        bs = self.block_size
        for s in sched.scheduled:
            req, n = s.request, s.num_scheduled_tokens
            start = req.num_computed_tokens
            block_ids = kv_manager.get_block_ids(req.req_id)
            if n == 1:  # a decode: no per-token ranges
                token = req.all_token_ids[start]
                if token == PLACEHOLDER_TOKEN:
                    pending.append((len(input_ids), req.req_id))
                input_ids.append(token)
                positions.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
            else:
                end = start + n
                input_ids.extend(req.all_token_ids[start:end])
                positions.extend(range(start, end))
                for b in range(start // bs, (end - 1) // bs + 1):  # one range per block, not per token
                    base = block_ids[b] * bs
                    slots.extend(range(base + max(start - b * bs, 0), base + min(end - b * bs, bs)))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(block_ids)
        return input_ids, positions, slots, query_lens, seq_lens, tables, pending

    def prepare_inputs(self, sched: SchedulerOutput, kv_manager: KVCacheManager):
        input_ids, positions, slots, query_lens, seq_lens, tables, pending = self.build_inputs(sched, kv_manager)
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
            query_start_loc=to_device(query_start, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            block_tables=to_device(flat_tables, torch.int32, dev).view(len(tables), max_blocks),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        ids = to_device(input_ids, torch.int64, dev)
        self.fill_pending(ids, pending)
        pos = to_device(positions, torch.int64, dev)
        return ids, pos, meta

    def fill_pending(self, ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        """Write the previous step's sampled ids (still on the device) into the placeholder rows."""
        if not pending:
            return
        if self._last_sampled is None:
            raise RuntimeError("a placeholder input without a previous step's sampled ids")
        dst = [row for row, _ in pending]
        try:
            src = [self._last_rows[req_id] for _, req_id in pending]
        except KeyError as exc:
            raise RuntimeError(f"request {exc.args[0]!r} has a placeholder input its previous step did not sample")
        index = to_device(dst + src, torch.int64, self.device)
        ids.index_copy_(0, index[: len(dst)], self._last_sampled.index_select(0, index[len(dst):]))

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv_manager: KVCacheManager,
                rows: dict[str, SamplingRow]) -> dict[str, int]:
        """Forward the scheduled tokens; sample for requests whose prompt is now complete."""
        sample_reqs = [s.request.req_id for s in sched.scheduled if s.completes_prefill]
        return dict(zip(sample_reqs, self.launch(sched, kv_manager, rows).tokens()))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, kv_manager: KVCacheManager,
               rows: dict[str, SamplingRow]) -> StepHandle:
        """Enqueue the step's KV copies between tiers, the forward and the sampling; the handle's
        ids are in the order of the scheduled requests that complete their prompt."""
        if sched.kv_transfers is not None:
            self.apply_kv_transfers(sched.kv_transfers)
        sample_reqs = [s.request.req_id for s in sched.scheduled if s.completes_prefill]
        if self._replays_decode_graph(sched) or self._runs_cpu_decode(sched):
            logits = (self._execute_decode_graph(sched, kv_manager) if self.graph_runner is not None
                      else self._execute_cpu_decode(sched, kv_manager))
            if len(sample_reqs) < len(sched.scheduled):  # a 1-token prefill chunk samples nothing
                keep = [i for i, s in enumerate(sched.scheduled) if s.completes_prefill]
                logits = logits[keep]
        elif self._replays_mixed_graph(sched):
            logits = self._execute_mixed_graph(sched, kv_manager, len(sample_reqs))
        else:
            logits = self._execute_eager(sched, kv_manager)
        if not sample_reqs:
            self._last_sampled, self._last_rows = None, {}
            return StepHandle()
        out = self.sampler.sample(logits, [rows[r] for r in sample_reqs])
        self._last_sampled = out.sampled_token_ids
        self._last_rows = {r: i for i, r in enumerate(sample_reqs)}
        return StepHandle(out.sampled_token_ids, out.logprobs)

    def apply_kv_transfers(self, transfers: KVTransfers | None) -> None:
        """Enqueue copies between the KV cache's tiers (a step's, before its forward; or alone,
        for a step whose requests all left it)."""
        if transfers is not None:
            if self.host_kv_cache is None:
                raise RuntimeError("KV transfers for a runner without a host KV tier")
            self.host_kv_cache.apply(transfers)

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
        index = to_device(last_rows, torch.int64, self.device)
        return self.model.compute_logits(hidden.index_select(0, index))

    def _replays_decode_graph(self, sched: SchedulerOutput) -> bool:
        return (self.graph_runner is not None and len(sched.scheduled) <= self.graph_runner.max_batch_size
                and all(s.num_scheduled_tokens == 1 for s in sched.scheduled))

    def _runs_cpu_decode(self, sched: SchedulerOutput) -> bool:
        return self.cpu_decode is not None and all(s.num_scheduled_tokens == 1 for s in sched.scheduled)

    def _execute_cpu_decode(self, sched: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """One token per request through the CPU decode graph (compiled, or ggml's); logits for every row."""
        ids, positions, tables, pending = [], [], [], []
        req_to_block_ids = kv_manager.req_to_block_ids
        for i, s in enumerate(sched.scheduled):
            req = s.request
            p = req.num_computed_tokens
            token = req.all_token_ids[p]
            if token == PLACEHOLDER_TOKEN:
                pending.append((i, req.req_id))
            ids.append(token)
            positions.append(p)
            tables.append(req_to_block_ids[req.req_id])
        inputs = self.cpu_decode.inputs(ids, positions, tables)
        self.fill_pending(inputs[0], pending)
        return self.cpu_decode(*inputs)

    def _replays_mixed_graph(self, sched: SchedulerOutput) -> bool:
        graphs = self.mixed_graph_runner
        return (graphs is not None and len(sched.scheduled) <= graphs.max_num_seqs
                and sched.num_scheduled_tokens <= graphs.max_num_tokens)

    def _execute_decode_graph(self, sched: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """One token per request, straight into the graph's static buffers; logits for every row."""
        bs = self.block_size
        ids, pos, slots, seq_lens, tables, pending = [], [], [], [], [], []
        req_to_block_ids = kv_manager.req_to_block_ids
        for i, s in enumerate(sched.scheduled):
            req = s.request
            req_id = req.req_id
            p = req.num_computed_tokens
            block_ids = req_to_block_ids[req_id]
            token = req.all_token_ids[p]
            if token == PLACEHOLDER_TOKEN:
                pending.append((i, req_id))
            ids.append(token)
            pos.append(p)
            slots.append(block_ids[p // bs] * bs + p % bs)
            seq_lens.append(p + 1)
            tables.append((req_id, block_ids))
        rows = self.block_table.rows_for(tables)
        return self.graph_runner.run(ids, pos, slots, seq_lens, rows,
                                     before_replay=lambda inputs: self.fill_pending(inputs[0], pending))

    def _execute_mixed_graph(self, sched: SchedulerOutput, kv_manager: KVCacheManager,
                             num_sampled: int) -> torch.Tensor:
        input_ids, positions, slots, query_lens, seq_lens, tables, pending = self.build_inputs(sched, kv_manager)
        sample_rows, offset = [], 0
        for s in sched.scheduled:
            offset += s.num_scheduled_tokens
            if s.completes_prefill:
                sample_rows.append(offset - 1)
        rows = self.block_table.rows_for([(s.request.req_id, t) for s, t in zip(sched.scheduled, tables)])
        return self.mixed_graph_runner.run(
            input_ids, positions, slots, query_lens, seq_lens, rows, sample_rows,
            before_replay=lambda ids: self.fill_pending(ids, pending))


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

