"""oneDNN-packed weights for the CPU backend's linear layers.

`F.linear` on the CPU reads each weight in its stored layout at every call, which at decode's
few rows is far from what the cores can do. oneDNN can reorder a weight once, at load, into its
own blocked layout; its linear kernel then runs 2-5x faster with the same result (bit-identical
in bf16, within ~1e-5 in fp32; per-shape timings in docs/benchmarks/cpu-decode-2core.md).

The kernels are PyTorch's own (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`, what torch.compile's CPU backend emits), not a public API: `available()`
tries them once on a tiny weight, and the model keeps plain `F.linear` where they are missing
or disagree. Packing replaces each `nn.Linear` in place (its plain weight is dropped, so memory
stays the same); a tied output projection gets a packed copy of the embedding matrix, which
the embedding lookup still needs.

On a CPU with AMX (Sapphire Rapids and later), oneDNN runs bf16 linears on AMX tiles. At
decode's 4 rows those stream weights slower than its AVX-512 BF16 kernels, but at prefill's
hundreds of rows AMX is about 3x faster, and a whole serving run (prefill and decode) comes out
ahead with it (docs/benchmarks/fast-path-h200.md). So we leave oneDNN's choice alone;
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` (oneDNN's own variable, read once per process, inherited
by Ray's workers) trades prefill for decode where outputs are long.

Row counts. oneDNN builds (JIT-compiles) a kernel per input shape, and PyTorch keeps each in two
caches of 1,024 entries (oneDNN's primitive cache and ideep's LRU cache, both process-wide). A
kernel costs host memory and milliseconds to build, and the row count of a step is whatever its
batch adds up to (1 to `max_num_batched_tokens`), so a serving engine that met every row count
would build a kernel for each linear at each of them, the caches churning at their cap and the
process growing for as long as it serves (docs/benchmarks/soak-2core.notes.md measures it). So
a packed linear runs at a bounded set of row counts (`bucket_rows`): exact up to 16 rows (every
decode batch of a CPU engine), above that rounded up to one of eight sizes per doubling (zero
rows appended, their outputs dropped). That adds under 1/8 to a prefill step's linear work, less than the kernel
builds it saves under mixed traffic, and keeps a model at 56 row counts up to 512.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 4  # rows oneDNN tunes the layout for: a decode batch; other sizes still run, and faster
EXACT_ROWS = 16  # row counts run as they are (module doc)
LOG2_SIZES_PER_DOUBLING = 3  # above EXACT_ROWS: 2**3 = 8 row counts per doubling


def bucket_rows(num_rows: int) -> int:
    """The row count a packed linear runs `num_rows` rows at: `num_rows` itself up to
    EXACT_ROWS, else the next multiple of 1/8 of the power of two below it (17 -> 18, 33 -> 36,
    257 -> 288, 512 -> 512)."""
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << ((num_rows - 1).bit_length() - 1 - LOG2_SIZES_PER_DOUBLING)
    return -(-num_rows // step) * step


def _pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    return torch.cat((x, x.new_zeros(num_rows - x.shape[0], x.shape[1])))


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` with the weight held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`forward(x) + residual` in one oneDNN call (its `add` post-op)."""
        return self._run(x, residual)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """At `bucket_rows` rows (module doc): rows [N, in] (or [..., in], flattened)."""
        shape = x.shape
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
            residual = None if residual is None else residual.reshape(-1, self.out_features)
        num_rows = x.shape[0]
        padded = bucket_rows(num_rows)
        if padded != num_rows:
            x = _pad_rows(x, padded)
            residual = None if residual is None else _pad_rows(residual, padded)
        if residual is None:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, residual, self.packed_weight, self.bias, "add")
        if padded != num_rows:
            out = out[:num_rows]
        return out if len(shape) == 2 else out.reshape(*shape[:-1], self.out_features)


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and runs `dtype` linears, and agrees with `F.linear`."""
    if dtype not in DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 16, generator=generator).to(dtype)
        bias = torch.randn(24, generator=generator).to(dtype)
        x = torch.randn(3, 16, generator=generator).to(dtype)
        out = PackedLinear(weight, bias)(x)
    except (RuntimeError, NotImplementedError):
        return False
    expected = nn.functional.linear(x, weight, bias)
    return bool(torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2))


def pack_model(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (and its output projection) with a `PackedLinear`
    when this build supports the model's dtype; returns how many were packed (0: none)."""
    dtype = next(model.parameters()).dtype
    if not available(dtype):
        return 0
    output_head = getattr(model, "lm_head", None)  # projected through `logits_proj` instead
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child is not output_head]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    if getattr(model, "logits_proj", False) is None:  # not already quantized (engine/model/quant.py)
        model.logits_proj = PackedLinear(model.output_weight(), None)
        return len(targets) + 1
    return len(targets)
