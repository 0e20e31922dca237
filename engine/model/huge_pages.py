"""A CPU model's weights on 2 MB pages (Linux transparent huge pages), for decode steps that
stream every weight once.

A CPU decode step of a small model is a pass over its weights: SmolLM2-135M reads 540 MB a step
in float32, ~100 MB as int4 blocks. On 4 KB pages that is one TLB entry per 4 KB, ~130,000 page
walks a float32 step; on 2 MB pages a few hundred. Measured in one process, one ggml graph
decode (engine/model/ggml_decode.py) alternating with a second one over huge-page copies of the
same weights, 180 steps each (2-core AMD EPYC, batch 1, context 161): float32 21.2 -> 19.8 ms a
step (-6.6%), int4 10.2 -> 9.9 ms (-3%), the same logits.

PyTorch's allocator asks for huge pages only under `THP_MEM_ALLOC_ENABLE=1`, read once per
process and then applied to every large allocation; here only the weights move. Each tensor of at
least 2 MB is copied into a private anonymous mapping aligned to 2 MB and marked MADV_HUGEPAGE
before anything touches it, which is what the kernel's default THP mode (`madvise`) honours.
Where THP is off, or the platform has no MADV_HUGEPAGE, nothing moves.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel gives anonymous memory huge pages when asked (THP `always` or `madvise`)."""
    try:
        return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in _THP.read_text()
    except OSError:
        return False


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory aligned to 2 MB and advised as huge pages. The
    mapping lives as long as the tensor (torch.frombuffer keeps it)."""
    nbytes = tensor.numel() * tensor.element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copy below faults 2 MB pages
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


def move_to_huge_pages(model: nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Copy each CPU parameter and buffer of at least `min_bytes` onto huge pages, in place
    (tensors that share memory, like a tied embedding and head, share the copy); returns the bytes
    moved (0 where huge pages are not available; a tensor whose mapping cannot be made stays
    where it is). Run it before anything keeps a raw pointer to a weight (a ggml graph, packed
    kernels)."""
    if not available():
        return 0
    copies: dict[tuple, torch.Tensor] = {}  # by (address, dtype, shape) before the move
    placed: set[tuple] = set()  # the same, after
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if (tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous()
                        or tensor.numel() * tensor.element_size() < min_bytes):
                    continue
                key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
                if key in placed:  # a parameter seen under another name (tied), moved already
                    continue
                if key not in copies:
                    try:
                        copies[key] = huge_page_copy(tensor.detach())
                    except OSError:  # no memory for the mapping: this tensor stays where it is
                        continue
                    placed.add((copies[key].data_ptr(), tensor.dtype, tuple(tensor.shape)))
                if isinstance(tensor, nn.Parameter):
                    tensor.data = copies[key]
                else:
                    store[name] = copies[key]
    return sum(t.numel() * t.element_size() for t in copies.values())
