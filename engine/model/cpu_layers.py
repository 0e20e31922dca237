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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.model.cpu_linear import PackedLinear
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


def _linear_plus(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """residual + linear(x): one oneDNN call with an add post-op where the weight is packed."""
    if isinstance(linear, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(x, residual, linear.packed_weight, linear.bias, "add")
    return linear(x).add_(residual)


class CPUDecoderLayer(nn.Module):
    """One reference `DecoderLayer`'s parameters in few calls (module docstring)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.self_attn, self.mlp = attn, mlp  # kept for code that inspects a layer's projections
        adopt_layer_parts(self, layer)
        self.hidden_shape = (attn.o_proj.out_features,)
        self.intermediate_size = mlp.down_proj.in_features

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
        qkv = self.qkv_proj(F.rms_norm(x, self.hidden_shape, norm.weight, norm.eps))
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, 2, self.head_dim // 2)
        qk = torch.addcmul(qk * cos, qk.flip(2), sin).view(num_tokens, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(qk[:, : self.num_heads], qk[:, self.num_heads:], v)
        x = _linear_plus(x, out.reshape(num_tokens, self.q_size), self.o_proj)
        norm = self.post_attention_layernorm
        gate_up = self.gate_up_proj(F.rms_norm(x, self.hidden_shape, norm.weight, norm.eps))
        act = F.silu(gate_up[:, : self.intermediate_size]).mul_(gate_up[:, self.intermediate_size:])
        return _linear_plus(x, act, self.down_proj)


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
