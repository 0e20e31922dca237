"""Fused decoder layers for the GPU fast path: the same weights, a third of the kernel launches.

A decode step of a 0.5B model moves ~1 GB of weights in ~0.25 ms at HBM speed, but in eager
PyTorch every layer launches ~36 kernels (an RMSNorm alone is eight: cast, square, mean, add,
rsqrt, multiply, cast, scale), each a few microseconds even inside a CUDA graph, so a step costs
several times its memory floor in launch gaps. `fuse_model` swaps each `DecoderLayer` for a
`FusedDecoderLayer` that shares the reference layer's parameters and runs ten kernels:

    rms_norm | qkv addmm | rotary(q, k) | write K/V | attention | o_proj addmm (+ residual)
    | rms_norm | gate_up mm | silu_and_mul | down addmm (+ residual)

RMSNorm, RoPE and SiLU-and-mul are one Triton kernel each, and both residual adds ride in the
epilogue of the matmul before them (`addmm` with beta = 1). Arithmetic follows the reference
order (normalise in float32, cast, then scale; RoPE and SiLU in float32), rounding once where
the reference rounds between ops, so bf16 results agree within a bf16 ulp or two and float32
results agree to float32 rounding. Attention still goes through the layer's backend, behind the
common `forward(q, k, v, kv_cache, meta, scale)` interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.model.llama import adopt_layer_parts


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference casts before scaling
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, stride_qkv, stride_cos, stride_sin, stride_out,
                   NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    """Rotate the first NUM_HEADS heads (all q heads, then all k heads) of one token's qkv row."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < HALF
    mask = (heads < NUM_HEADS) & dim_mask
    src = qkv_ptr + token * stride_qkv + heads * (2 * HALF) + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_sin + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_out + heads * (2 * HALF) + dims
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps,
                                        BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
           head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D], cos/sin [T, 1, D] -> rotated q [T, Hq, D] and k [T, Hkv, D] (views of one buffer)."""
    num_tokens = qkv.shape[0]
    rotated = torch.empty(num_tokens, num_heads + num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            qkv, cos, sin, rotated, qkv.stride(0), cos.stride(0), sin.stride(0), rotated.stride(0),
            NUM_HEADS=num_heads + num_kv_heads, HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return rotated[:, :num_heads], rotated[:, num_heads:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    num_tokens, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, n_cols, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(n_cols, block))](
            x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block)
    return out


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class FusedDecoderLayer(nn.Module):
    """One reference `DecoderLayer`'s parameters, run as ten kernels (module docstring)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        adopt_layer_parts(self, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        norm = self.input_layernorm
        qkv = self.qkv_proj(rms_norm(x, norm.weight, norm.eps))
        q, k = rotary(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn_out = self.attn.forward(q, k, v, kv_cache, meta, self.scale).reshape(num_tokens, self.q_size)
        x = _linear_plus(x, attn_out, self.o_proj)
        norm = self.post_attention_layernorm
        act = silu_and_mul(self.gate_up_proj(rms_norm(x, norm.weight, norm.eps)))
        return _linear_plus(x, act, self.down_proj)


def _linear_plus(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """residual + linear(x) as one GEMM whose epilogue adds the residual."""
    if linear.bias is not None:
        return residual + linear(x)
    return torch.addmm(residual, x, linear.weight.t())


def fuse_model(model: nn.Module, attn_backend) -> nn.Module:
    """Swap a `LlamaForCausalLM`'s layers and final norm for fused ones sharing its parameters."""
    inner = model.model
    for i, layer in enumerate(inner.layers):
        layer.self_attn.attn = attn_backend
        inner.layers[i] = FusedDecoderLayer(layer)
    inner.norm = FusedRMSNorm(inner.norm)
    return model
