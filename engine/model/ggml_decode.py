"""The CPU decode step as one ggml graph: what llama.cpp computes for a token, on Tandem's weights
and Tandem's paged KV cache (engine/model/ggml_decode.cpp).

With ggml's kernels for the linears (`cpu_kernels="ggml"`), the compiled decode of
engine/model/cpu_compile.py still pays the host for every call it makes: inductor's Python
wrapper calls ~12 ops and loops a layer, ~100 us of a layer's time on two cores, and a 30-layer
step of SmolLM2-135M spends ~3 ms of ~13 there. Handing the whole step to ggml makes it one call:
ggml builds the graph (RMSNorm, the quantized linears, RoPE, the KV write, attention over the
paged cache, SwiGLU, the residual adds, the head) and runs its nodes on its own threads, as
llama.cpp does. Nothing is compiled, so there is nothing to warm up or cache.

The step's host side is kept small on purpose: the graph embeds the token ids itself (its first
node reads the float32 embedding rows) and derives every K/V slot from the block tables, so
Python hands over an id tensor and two int lists. Host time per engine step (Python and the
torch ops around the call, SmolLM2 int4, batch 1, 2-core AMD EPYC) went from ~0.59 to ~0.41 ms
that way, of a ~10.3 ms step; most of what is left is the interpreter running from caches the
step's ~100 MB weight stream has just evicted (the first small op after a step takes ~50 us, the
second ~4 us).

It covers decode steps only (one token per request, any number of requests); prefill and mixed
steps keep the eager few-op layers. It takes a model whose projections and head are ggml rows
(`GGMLLinear`'s quantized blocks, or `FloatRows`, a float32 model's weights as they are, which
ggml reads as its F32 type, llama.cpp's F32 GGUF) and whose KV caches are float32; `supports`
says whether a model qualifies. A float32 model's eager layers run packed copies of its weights
while the graph reads the plain ones (`GraphRows`), so each kind of step runs on its fastest
kernels; this is what a cpu engine runs by default where ggml is built (`cpu_kernels="auto"`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tandem.engine.model.ggml_kernels import load

logger = logging.getLogger(__name__)

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_ROWS = ("blocks", "ggml_type", "in_features", "out_features", "bias")


def _on_ggml(module: nn.Module | None) -> bool:
    """A linear whose weight is rows in a ggml type (`GGMLLinear`: `blocks`, `ggml_type`, ...)."""
    return module is not None and all(hasattr(module, name) for name in _ROWS)


class FloatRows(nn.Module):
    """A float32 linear whose weight rows the ggml graph reads as they are (ggml type F32); eager
    steps (prefill) run it as `F.linear`."""

    ggml_type = 0  # GGML_TYPE_F32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.float32:
            raise ValueError(f"float rows are float32, got {weight.dtype}")
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    @property
    def blocks(self) -> torch.Tensor:
        """The weight's bytes, as ggml reads them (wherever the weight lives now)."""
        return self.weight.data.view(torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class GraphRows(nn.Module):
    """The weights the graph reads as ggml rows, by layer (`layers[i][name]`) and the head.

    A float32 model's eager steps (prefill, mixed) run its linears as oneDNN-packed copies
    (engine/model/cpu_linear.py), faster than `F.linear` on the plain weights at prefill's many
    rows, and ggml cannot read that layout. So the graph keeps the plain float32 rows here, taken
    before packing: the linears' weights are held twice, the price of running prefill and decode
    each on its fastest kernels (a tied head reads the embedding, no copy). Quantized projections
    (`GGMLLinear`) are ggml's rows already and are shared with the eager layers."""

    def __init__(self, layers: list[dict[str, nn.Module]], head: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict(layer) for layer in layers)
        self.head = head

    @classmethod
    def of(cls, model: nn.Module) -> GraphRows:
        """The rows of a model whose linears are `nn.Linear` (float32) or ggml's, fused or not."""
        def rows(linear: nn.Module) -> nn.Module:
            return FloatRows(linear.weight, linear.bias) if isinstance(linear, nn.Linear) else linear

        layers = [{name: rows(getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name))
                   for name in _PROJECTIONS} for layer in model.model.layers]
        head = model.logits_proj if model.logits_proj is not None else FloatRows(model.output_weight(), None)
        return cls(layers, head)


def supports(model: nn.Module, kv_caches: list[torch.Tensor], rows: GraphRows | None = None) -> bool:
    """Whether every projection and the head are ggml rows (`rows`, else the fused model's own
    modules), and the embedding and caches float32."""
    layers = rows.layers if rows is not None else [
        {name: getattr(layer, name, None) for name in _PROJECTIONS} for layer in model.model.layers]
    head = rows.head if rows is not None else model.logits_proj
    return (_on_ggml(head) and all(_on_ggml(layer[name]) for layer in layers for name in _PROJECTIONS)
            and model.model.embed_tokens.weight.dtype == torch.float32
            and all(c.dtype == torch.float32 and c.is_contiguous() for c in kv_caches))


class GGMLGraphDecode:
    """Decode steps (one token per request) of a CPU model through one ggml graph each; the same
    interface as `CompiledCPUDecode` (`inputs`, then a call), so the runner drives either."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 attention_chunks: int = 0, repack: bool = True, rows: GraphRows | None = None) -> None:
        """`rows`: the projections and head the graph reads (None: the fused model's own modules).
        `attention_chunks`: pieces each (request, K/V head)'s context is cut into across threads
        (0: chosen per step from the batch, the threads and the context; see ggml_decode.cpp).
        `repack`: quantized weights that have a faster layout of ggml's on this CPU (AMX tiles on
        Xeons with AMX, interleaved Q4_0 rows on AVX2; llama.cpp's `--repack`, on by default there
        too) are copied into it for the graph, which then holds them twice (eager prefill steps
        keep reading the originals); `repacked` says how many linears were."""
        if not supports(model, kv_caches, rows):
            raise ValueError("the ggml graph decode needs every projection and the head as ggml rows "
                             "(GGMLLinear or FloatRows), a float32 embedding and float32 KV caches")
        load()
        config = model.config
        inner = model.model
        tensors, biases, types = [], [], []
        for i, layer in enumerate(inner.layers):
            qkv, o, gate_up, down = (rows.layers[i][name] if rows is not None else getattr(layer, name)
                                     for name in _PROJECTIONS)
            tensors += [layer.input_layernorm.weight, qkv.blocks, o.blocks, layer.post_attention_layernorm.weight,
                        gate_up.blocks, down.blocks]
            biases += [linear.bias for linear in (qkv, o, gate_up, down)]
            types += [linear.ggml_type for linear in (qkv, o, gate_up, down)]
        head = rows.head if rows is not None else model.logits_proj
        tensors += [inner.norm.weight, head.blocks, inner.embed_tokens.weight]
        biases.append(head.bias)
        types.append(head.ggml_type)
        layer = inner.layers[0]
        dims = [config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                layer.intermediate_size, head.out_features, block_size, attention_chunks, int(repack)]
        floats = [float(layer.input_layernorm.eps), float(config.rope_theta), float(layer.scale)]
        self._id = torch.ops.tandem_ggml.decoder_new(tensors, biases, types, kv_caches, dims, floats)
        self._keep = (tensors, kv_caches)  # the graph reads these tensors' memory
        self.rows = rows  # None: the model's own modules
        self.repacked = torch.ops.tandem_ggml.decoder_repacked(self._id)
        if self.repacked:
            logger.info("ggml graph decode: %d linears in ggml's repacked layouts", self.repacked)
        self.compile_s = 0.0

    def __del__(self) -> None:
        try:
            torch.ops.tandem_ggml.decoder_free(self._id)
        except Exception:  # interpreter shutdown
            pass

    def inputs(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> tuple:
        """The step's inputs from host lists: the ids (a tensor, which the runner fills where a
        token is still pending), the positions, and the block tables flattened, each padded on the
        right to the longest; the graph derives every slot it reads and writes from them."""
        width = max(map(len, block_tables))
        tables = [block for table in block_tables for block in (*table, *[0] * (width - len(table)))]
        return torch.tensor(input_ids, dtype=torch.int64), positions, tables, width

    def forward(self, input_ids: torch.Tensor, positions: list[int], block_tables: list[int], width: int,
                ) -> torch.Tensor:
        """Logits [B, vocab] (float32) of one decode token per request; writes their K/V. The
        embedding is the graph's first node."""
        return torch.ops.tandem_ggml.decoder_step(self._id, input_ids, positions, block_tables, width)

    __call__ = forward

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> float:
        """Nothing to compile; kept for the runner's interface."""
        return 0.0
