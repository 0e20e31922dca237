"""Weight-only int8 and int4 linears for the CPU backend, through PyTorch's own kernels.

A decode step on a CPU reads every weight once per step, so its time is the weight bytes over
the memory bandwidth: int8 weights halve bf16's bytes and int4 quarter them. PyTorch ships the
kernels (what torchao and gpt-fast call on the CPU), so nothing here is hand-written:

  int8  `aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])`: symmetric, one scale per
        output channel.
  int4  `aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_and_zero [K/g, N, 2])` on a
        weight packed once by `aten._convert_weight_to_int4pack_for_cpu`: asymmetric, one scale
        and zero per `group` input columns, w = (q - 8) * scale + zero with q in 0..15.

Both kernels take the activations in the scales' dtype, and their float32 paths are scalar
(an order of magnitude slower than with bfloat16 activations; see "What was measured to
choose" in docs/benchmarks/cpu-vs-llamacpp-2core.md), so the quantized modes run the rest of
the model in bfloat16 (`EngineConfig.torch_dtype`).

GGUF files are mostly Q4_0/Q4_1 blocks of 32 weights, which are exactly this int4 layout at
group 32: Q4_0 is d * (q - 8) (zero 0), Q4_1 is d * q + m (zero m + 8 d). `gguf_int4_linears`
repacks those blocks straight into the kernel's form, with no float copy of the weight; only
the scales round from float16 to bfloat16. Other block types (Q8_0, K-quants) are quantized from
the dequantized weight the loader already holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

QUANTIZATIONS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block; 64 was no faster at SmolLM2's shapes


class Int8Linear(nn.Module):
    """`F.linear` with an int8 weight and one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return out if self.bias is None else out.add_(self.bias)


class Int4Linear(nn.Module):
    """`F.linear` with a 4-bit weight in PyTorch's CPU int4 packing, group-wise scale and zero."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """q [N, K] integers 0..15; scales, zeros [N, K / group_size]: w = (q - 8) * scale + zero."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        scale_and_zero = torch.stack((scales.float(), zeros.float()), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scale_and_zero", scale_and_zero.to(dtype))
        # The group size as a tensor, for the op inductor lowers this kernel to (`forward`).
        self.register_buffer("group_size_tensor", torch.tensor(group_size), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                   dtype: torch.dtype) -> Int4Linear:
        """Asymmetric min/max quantization per group, as GGUF's Q4_1 does it."""
        n, k = weight.shape
        groups = weight.detach().float().view(n, k // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).view(n, k)
        return cls(q, scales, low + 8.0 * scales, group_size, bias, dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] as the kernel sees it (through the kernel itself, in the scales' dtype)."""
        eye = torch.eye(self.in_features, dtype=self.scale_and_zero.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed_weight, self.group_size,
                                                          self.scale_and_zero).float().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # What inductor lowers the aten op to, with the group size as an input rather than a
            # constant it creates: constants of a subgraph compiled once for every layer
            # (engine/model/cpu_compile.py) come out unset in torch 2.13.
            out = torch.ops.quantized.int4mm_packed_weight_cpu(x, self.packed_weight, self.group_size_tensor,
                                                               self.scale_and_zero)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed_weight, self.group_size,
                                                             self.scale_and_zero)
        return out if self.bias is None else out.add_(self.bias)


@functools.cache
def available(quantization: str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build runs `quantization` linears with `dtype` activations correctly."""
    aten = torch.ops.aten
    needed = {"int8": ("_weight_int8pack_mm",),
              "int4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")}[quantization]
    if not all(hasattr(aten, name) for name in needed):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator) * 0.1
    x = torch.randn(3, 64, generator=generator).to(dtype)
    try:
        layer = _quantized_linear(quantization, weight, None, dtype)
        out = layer(x).float()
    except (RuntimeError, NotImplementedError):
        return False
    expected = x.float() @ weight.t()
    return bool((out - expected).abs().max() < 0.1 * expected.abs().max())


def _group_size(in_features: int, preferred: int) -> int | None:
    for group in (preferred, 32):
        if in_features % group == 0:
            return group
    return None


def _quantized_linear(quantization: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                      group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """int4 where the input width splits into groups (else int8), int8 when asked."""
    group = _group_size(weight.shape[1], group_size) if quantization == "int4" else None
    if group is None:
        return Int8Linear(weight, bias, dtype)
    return Int4Linear.from_float(weight, bias, group, dtype)


def quantize_model(model: nn.Module, quantization: str, gguf_path: Path | None = None,
                   group_size: int = DEFAULT_GROUP_SIZE, head_quantization: str = "int8") -> int:
    """Replace every `nn.Linear` of a `LlamaForCausalLM` (and its output projection) with a
    quantized one, in place; returns how many. With `gguf_path`, int4 linears whose GGUF tensors
    are Q4_0/Q4_1 are repacked from those blocks as they are. The output projection (tied to the
    embedding, which the lookup still reads in full precision) gets `head_quantization`, int8 by
    default, as GGUF files keep their output matrix at 6-8 bits."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    dtype = model.model.embed_tokens.weight.dtype
    if not available(quantization, dtype):
        raise RuntimeError(f"this torch build ({torch.__version__}) has no working {quantization} CPU linear kernel "
                           f"for {dtype} activations")
    from_gguf = gguf_int4_linears(gguf_path, model.config, dtype) if gguf_path and quantization == "int4" else {}

    def quantized(full_name: str, child: nn.Linear) -> nn.Module:
        replacement = from_gguf.get(full_name)
        if replacement is None:
            return _quantized_linear(quantization, child.weight, child.bias, dtype, group_size)
        if child.bias is not None:
            replacement.bias = nn.Parameter(child.bias.detach().to(dtype), requires_grad=False)
        return replacement

    count = replace_linears(model, quantized)
    model.logits_proj = _quantized_linear(head_quantization, model.output_weight(), None, dtype, group_size)
    return count + 1


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    """Swap every `nn.Linear` of a `LlamaForCausalLM` except its output head for `make(its full
    module name, it)`, in place; returns how many."""
    count = 0
    for layer_name, parent in model.named_modules():
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child is getattr(model, "lm_head", None):
                continue
            setattr(parent, name, make(f"{layer_name}.{name}" if layer_name else name, child))
            count += 1
    return count


# -- GGUF blocks --------------------------------------------------------------------------------
GGUF_PROJ = {  # GGUF tensor -> (our module under model.layers.{i}, shard index in the merged weight)
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1), "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0), "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
GGUF_SHARDS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2, "self_attn.o_proj": 1, "mlp.down_proj": 1}


def _q4_blocks(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, bytes] of Q4_0 / Q4_1 blocks -> q [rows, K] (0..15), scale and zero [rows, K/32]."""
    rows = raw.shape[0]
    header = 2 if kind == "Q4_0" else 4
    blocks = raw.reshape(rows, -1, header + 16)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    zero = -8.0 * d if kind == "Q4_0" else torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]
                                                           .astype(np.float32))
    qs = torch.from_numpy(blocks[..., header:].copy())
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(rows, -1)  # low nibbles hold values 0..15, high 16..31
    return q, d, zero + 8.0 * d


def unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (its RoPE pairs adjacent dims; HF's pairs the two halves)."""
    rows = t.shape[0]
    return t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def gguf_projection_shards(reader, config, usable: tuple[int, ...]) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """Every merged projection (model.layers.{i}.self_attn.qkv_proj, ...) whose GGUF tensors are all
    of a `usable` type (GGUF's type numbers): its shards in merge order, each as (its raw blocks,
    uint8 [rows, row bytes], with q/k rows back in HF's order; its type)."""
    parts: dict[str, dict[int, tuple[torch.Tensor, int] | None]] = {}
    for tensor in reader.tensors:
        name = tensor.name.split(".")
        if len(name) != 4 or name[0] != "blk" or name[2] not in GGUF_PROJ:
            continue
        module, shard = GGUF_PROJ[name[2]]
        key = f"model.layers.{name[1]}.{module}"
        kind = int(tensor.tensor_type)
        if kind not in usable:
            parts.setdefault(key, {})[shard] = None
            continue
        blocks = torch.from_numpy(np.array(tensor.data))
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name[2])
        parts.setdefault(key, {})[shard] = (blocks if heads is None else unpermute_rows(blocks, heads), kind)
    complete = {}
    for key, shards in parts.items():
        expected = GGUF_SHARDS[key.split(".", 3)[3]]
        if len(shards) == expected and all(s is not None for s in shards.values()):
            complete[key] = [shards[i] for i in range(expected)]
    return complete


def gguf_int4_linears(gguf_path: Path, config, dtype: torch.dtype) -> dict[str, Int4Linear]:
    """Int4 linears, by module name, for every merged projection whose GGUF tensors are all Q4_0/Q4_1."""
    from gguf import GGMLQuantizationType, GGUFReader

    usable = (GGMLQuantizationType.Q4_0.value, GGMLQuantizationType.Q4_1.value)
    linears = {}
    for key, shards in gguf_projection_shards(GGUFReader(str(gguf_path)), config, usable).items():
        parts = [_q4_blocks(blocks.numpy(), GGMLQuantizationType(kind).name) for blocks, kind in shards]
        q, scale, zero = (torch.cat([part[j] for part in parts]) for j in range(3))
        linears[key] = Int4Linear(q, scale, zero, 32, None, dtype)
    return linears
