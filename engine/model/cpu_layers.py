"""Decoder layers for the CPU backend with as few torch calls as the arithmetic allows.

On a CPU every eager op costs a dispatch of a few microseconds, and a small model's decode step
is mostly such ops: the reference layer (engine/model/llama.py) spends ~50 top-level calls per
layer, most of them on the 8-op RMSNorm, the 7-op RoPE and the residual adds. `fuse_cpu_model`
swaps each `DecoderLayer` for a `CPUDecoderLayer` that shares its parameters and runs

    rms_norm | qkv linear | RoPE (flip, mul, addcmul) | attention | o_proj (+ residual)
    | rms_norm | gate_up linear | silu, mul | down (+ residual)

with PyTorch's fused `rms_norm` kernel, RoPE as x * cos + flip(x) * sin' where sin' carries the
rotation's sign (so no negate, chunk or concatenate), and the residual adds folded into the
matmul (oneDNN's `add` post-op on packed weights) or done in place on its output. The sums
are the reference's to float32 rounding; bf16 normalises in float32 inside the kernel rather
than in separate casts, a bf16 ulp or so apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.model.cpu_linear import PackedLinear
from tandem.engine.model.ggml_kernels import GGMLLinear
from tandem.engine.model.llama import adopt_layer_parts


class SignedRotaryEmbedding(nn.Module):
    """The reference tables with the first half of sin negated: rotate(x) = flip(halves of x) * sin'."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        half = rotary.head_dim // 2
        self.head_dim = rotary.head_dim
        self.register_buffer("cos_cached", rotary.cos_cached, persistent=False)
        signed = rotary.sin_cached.clone()
        signed[:, :half].neg_()
        self.register_buffer("sin_cached", signed, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin' of shape [T, 1, 2, head_dim / 2] (broadcast over heads)."""
        shape = (-1, 1, 2, self.head_dim // 2)
        return self.cos_cached[positions].view(shape), self.sin_cached[positions].view(shape)


_PACKED_BY_HANDLE: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, residual: torch.Tensor | None, handle: torch.Tensor,
                  out_features: int) -> torch.Tensor:
    """A oneDNN-packed linear (plus `residual`) as one opaque op, for compiled graphs: Dynamo
    cannot trace the packed MKLDNN weight, so the graph names the layer by `handle` (a 0-d tensor
    input, so that one layer's compiled code serves every layer; `packed_handle`)."""
    linear = _PACKED_BY_HANDLE[int(handle)]
    if residual is None:
        return linear(x)
    return linear.add(x, residual)


@packed_linear.register_fake
def _packed_linear_shape(x, residual, handle, out_features):
    return x.new_empty((x.shape[0], out_features))


def packed_handle(linear: PackedLinear) -> torch.Tensor:
    """The 0-d tensor `packed_linear` finds `linear` by (as long as `linear` lives)."""
    _PACKED_BY_HANDLE[id(linear)] = linear
    return torch.tensor(id(linear))


def _linear(x: torch.Tensor, linear: nn.Module, handle: torch.Tensor | None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x) (+ residual): one oneDNN call with an add post-op where the weight is packed,
    through `packed_linear` inside a compiled graph."""
    if handle is not None and torch.compiler.is_compiling():
        return packed_linear(x, residual, handle, linear.out_features)
    if isinstance(linear, GGMLLinear):
        return linear(x, residual)
    if residual is None:
        return linear(x)
    if isinstance(linear, PackedLinear):
        return linear.add(x, residual)
    return linear(x).add_(residual)


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class CPUDecoderLayer(nn.Module):
    """One reference `DecoderLayer`'s parameters in few calls (module docstring)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.self_attn, self.mlp = attn, mlp  # kept for code that inspects a layer's projections
        adopt_layer_parts(self, layer)
        self.hidden_shape = (attn.o_proj.out_features,)
        self.intermediate_size = mlp.down_proj.in_features
        for name in _PROJECTIONS:
            linear = getattr(self, name)
            handle = packed_handle(linear) if isinstance(linear, PackedLinear) else None
            self.register_buffer(f"{name}_handle", handle, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.run(x, cos, sin, lambda q, k, v: self.attn.forward(q, k, v, kv_cache, meta, self.scale))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer with attention left to `attend(q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D] or
        [T, Hq * D]` (which also writes the K/V): the attention backend here, the compiled decode's
        paged reductions in engine/model/cpu_compile.py."""
        num_tokens = x.shape[0]
        norm = self.input_layernorm
        qkv = _linear(F.rms_norm(x, self.hidden_shape, norm.weight, norm.eps), self.qkv_proj, self.qkv_proj_handle)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, 2, self.head_dim // 2)
        qk = torch.addcmul(qk * cos, qk.flip(2), sin).view(num_tokens, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(qk[:, : self.num_heads], qk[:, self.num_heads:], v)
        x = _linear(out.reshape(num_tokens, self.q_size), self.o_proj, self.o_proj_handle, x)
        norm = self.post_attention_layernorm
        gate_up = _linear(F.rms_norm(x, self.hidden_shape, norm.weight, norm.eps), self.gate_up_proj,
                          self.gate_up_proj_handle)
        act = F.silu(gate_up[:, : self.intermediate_size]).mul_(gate_up[:, self.intermediate_size:])
        return _linear(act, self.down_proj, self.down_proj_handle, x)


class CPUFinalNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def fuse_cpu_model(model: nn.Module) -> nn.Module:
    """Swap a `LlamaForCausalLM`'s layers, final norm and RoPE tables for the few-call CPU ones."""
    inner = model.model
    for i, layer in enumerate(inner.layers):
        inner.layers[i] = CPUDecoderLayer(layer)
    inner.norm = CPUFinalNorm(inner.norm)
    inner.rotary_emb = SignedRotaryEmbedding(inner.rotary_emb)
    return model
