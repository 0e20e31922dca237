"""The CPU backend's decode step as one graph compiled by torch.compile's CPU (inductor) backend.

A small model's decode step on a CPU is mostly not arithmetic: SmolLM2-135M int4 at one row
spends ~6 ms of a ~20 ms eager step in its linears, and the rest in ~1,100 small aten ops
dispatched one by one from Python (norms, RoPE, the KV write, the attention's gather, masks,
SiLU, adds). Compiling the whole decode forward (embedding to logits) turns each layer's small
ops into a few generated C++ loops, while the linears stay library calls inside the graph: the
weight-only quantized ones (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) as they are,
the oneDNN-packed float32/bfloat16 ones through one opaque custom op (`packed_linear` in
engine/model/cpu_layers.py), since Dynamo cannot trace a packed MKLDNN weight.

Three choices make the graph compile once and stay valid:

* Tensor-only inputs: token ids, positions, slots, context lengths and block tables; no
  Python-side metadata, so nothing the guards would see changes from one step to the next. The
  batch dimension is dynamic for two rows and up, and one row gets its own graph (inductor
  specialises a size-1 dimension anyway); the block-table width is dynamic (at least two blocks,
  padded with block 0 and masked), so a growing context never recompiles.
* The KV write is one `index_put_` on the flat cache (K rows then V rows): inductor lowers it
  to a scatter into the cache in place. `index_copy_` on a slice of the cache made it copy the
  whole cache every layer.
* Attention for one query row per request is written as reductions over the gathered context
  (scores, softmax, weighted sum), which inductor fuses into loops that read K and V straight
  from the paged cache; SDPA's CPU kernel costs ~70 us a call at these sizes, most of it setup.

Compiled artifacts go to inductor's on-disk cache under Tandem's cache directory (unless
`TORCHINDUCTOR_CACHE_DIR` is set), so a restart with the same model, dtype, threads and torch
build loads them in seconds instead of compiling again (a minute or more on two cores).
Prefill and mixed steps keep the eager few-op layers (engine/model/cpu_layers.py).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable

import torch
from torch import nn

from tandem.engine.model.cpu_layers import CPUDecoderLayer, packed_handle, packed_linear
from tandem.engine.model.cpu_linear import PackedLinear

logger = logging.getLogger(__name__)
MIN_TABLE_BLOCKS = 2  # a dynamic dimension must not be 1 (a size-1 dimension is specialised)
# No per-call size checks of the graph's inputs in inductor's Python wrapper (~450 a step), and no
# bounds check on indirect loads inside the generated loops (the attention's block-table gather
# does one per element): the indices are the engine's own slots and block tables.
INDUCTOR_OPTIONS = {"size_asserts": False, "assert_indirect_indexing": False}


@functools.cache
def compiler_available() -> bool:
    """Whether inductor finds a C++ compiler to build its CPU kernels with."""
    from torch._inductor import config

    return shutil.which(os.environ.get("CXX") or config.cpp.cxx[-1] or "g++") is not None


def inductor_cache_dir() -> str:
    """Inductor's cache: `$TORCHINDUCTOR_CACHE_DIR` as the user set it, else `inductor/` in Tandem's
    cache directory. Inductor writes its own default (a folder in /tmp, lost at reboot) into the
    variable the first time it looks, so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from tandem.engine.config import cache_root

    explicit = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if explicit and os.path.abspath(explicit) != os.path.abspath(default_cache_dir()):
        return explicit
    return str(cache_root() / "inductor")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     slots: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per request over its paged context, the new K/V written first.

    q [B, Hq, D], k/v [B, Hkv, D], kv_cache [2, NB, BS, Hkv, D], slots [B], tables [B, W]
    (int64), mask [B, W * BS] additive float32 -> [B, Hq * D]. Scores and the weighted sum are in
    float32, as SDPA's CPU kernel accumulates.
    """
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    flat = kv_cache.view(-1, num_kv_heads, head_dim)
    half = kv_cache.shape[1] * kv_cache.shape[2]
    flat.index_put_((torch.cat((slots, slots + half)),), torch.cat((k, v)))
    context = kv_cache[:, tables].flatten(2, 3)  # [2, B, L, Hkv, D]
    grouped = q.view(num_reqs, 1, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = (grouped * context[0].unsqueeze(3).float()).sum(-1) * scale  # [B, L, Hkv, G]
    probs = torch.softmax(scores + mask.view(num_reqs, -1, 1, 1), dim=1)
    out = (probs.unsqueeze(-1) * context[1].unsqueeze(3).float()).sum(1)  # [B, Hkv, G, D]
    return out.to(q.dtype).reshape(num_reqs, num_heads * head_dim)


def decode_forward(model: nn.Module, head_handle: torch.Tensor | None, input_ids: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                   kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """One token per request through a `fuse_cpu_model` model: float32 logits [B, vocab]."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(positions)
    cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
    context_len = tables.shape[1] * kv_caches[0].shape[2]
    valid = torch.arange(context_len, device=input_ids.device)[None, :] < seq_lens[:, None]
    mask = torch.where(valid, 0.0, float("-inf"))
    for layer, kv_cache in zip(inner.layers, kv_caches, strict=True):
        hidden = decode_layer(layer, hidden, cos, sin, kv_cache, slots, tables, mask)
    hidden = inner.norm(hidden)
    if head_handle is not None:  # a packed output projection (engine/model/cpu_layers.py, packed_linear)
        return packed_linear(hidden, None, head_handle, model.logits_proj.out_features).float()
    return model.compute_logits(hidden)


@torch.compiler.nested_compile_region
def decode_layer(layer: CPUDecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One layer, compiled once and stamped out for every layer (hierarchical compilation): the
    whole model as one graph took ~450 s to compile for SmolLM2's 30 layers on two busy cores,
    this ~130 s, at the same step time."""
    def attend(q, k, v):
        return decode_attention(q, k, v, kv_cache, slots, tables, mask, layer.scale)

    return layer.run(hidden, cos, sin, attend)


class CompiledCPUDecode:
    """Decode steps (one token per request) of a CPU model through its compiled graphs."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> None:
        if not all(isinstance(layer, CPUDecoderLayer) for layer in model.model.layers):
            raise ValueError("the compiled CPU decode runs the few-op layers: call fuse_cpu_model first")
        if not compiler_available():
            raise RuntimeError("cpu_compile needs a C++ compiler for torch.compile's CPU backend (g++ or $CXX)")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()  # read by inductor at each lookup
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.compile_s = 0.0  # wall time of the calls that compiled (or loaded) a graph
        head = model.logits_proj
        head_handle = packed_handle(head) if isinstance(head, PackedLinear) else None

        def step(input_ids, positions, slots, seq_lens, tables, kv_caches):
            return decode_forward(model, head_handle, input_ids, positions, slots, seq_lens, tables, kv_caches)

        self._compiled = torch.compile(step, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        self._graphs: dict[bool, Callable] = {}  # single row, several rows -> their compiled step

    def inputs(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
               ) -> tuple[torch.Tensor, ...]:
        """The step's tensors from host lists; block tables padded to the longest (at least two blocks)."""
        bs = self.block_size
        width = max(MIN_TABLE_BLOCKS, max(len(t) for t in block_tables))
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)]
        return (torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64), torch.tensor([p + 1 for p in positions], dtype=torch.int64),
                torch.tensor(tables, dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                seq_lens: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] (float32) of one decode token per request; writes their K/V."""
        several = input_ids.shape[0] > 1
        graph = self._graphs.get(several)
        if graph is None:
            t0 = time.perf_counter()
            graph = self._graphs[several] = self._compile(several, (input_ids, positions, slots, seq_lens, tables))
            self.compile_s += time.perf_counter() - t0
            logger.info("compiled the CPU decode graph for %s in %.1f s", "2+ rows" if several else "1 row",
                        time.perf_counter() - t0)
        return graph(input_ids, positions, slots, seq_lens, tables, self.kv_caches)

    def _compile(self, several: bool, example: tuple[torch.Tensor, ...]) -> Callable:
        """The step for one or several rows, compiled ahead of its calls with Dynamo's guards off
        (`aot_compile`): checking ~460 guarded inputs cost ~1 ms of a ~15 ms step, and nothing they
        check changes here (the model, the caches and the input dtypes are fixed; the batch picks
        the graph; the dynamic dimensions are marked). Where this torch has no `aot_compile`, the
        plain compiled function with its guards."""
        torch._dynamo.mark_dynamic(example[4], 1)
        if several:
            for t in example:
                torch._dynamo.mark_dynamic(t, 0)
        if not hasattr(self._compiled, "aot_compile"):
            self._compiled(*example, self.kv_caches)
            return self._compiled
        graph = self._compiled.aot_compile((example + (self.kv_caches,), {}))
        graph.disable_guard_check()
        return graph

    __call__ = forward

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> float:
        """Compile (or load from the cache) the graphs for these batch sizes now, on scratch
        slots of block 0 (the null block no request owns); returns the seconds it took."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for batch in batch_sizes:
                positions = list(range(batch))
                self(*self.inputs([0] * batch, positions, [[0]] * batch))
        return time.perf_counter() - t0
