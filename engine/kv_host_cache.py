"""The host KV tier's tensors, and the copies between them and the device's KV cache.

The host cache has the device cache's per-layer layout, [2, num_host_blocks, block_size,
kv_heads, head_dim], so a block moves as one slice of dim 1 of each layer. A step's copies
(engine/kv_cache/host_tier.py's `KVTransfers`) run before its forward, offloads then reloads,
each batched per layer: one gather from the source and one scatter into the destination
(`index_select` / `index_copy_`), never one copy per block. They write the device cache tensors
in place, so the CUDA graphs and CPU decode graphs that captured those tensors read the blocks.

On cuda the host tensors are pinned, and the copies run as kernels on the current stream that
read and write the pinned memory through its device address (unified virtual addressing: pinned
host memory is directly addressable by the GPU). So the gather and the scatter happen on the
GPU in stream order: an offload runs after every earlier step's writes (asynchronous scheduling
launches a step before the previous one has finished), a reload after the offloads before it,
and the forward after the reload, with no host synchronisation; the host never reads or writes
these tensors itself. A host-side `index_select` on the pinned tensor would instead read it now,
before the offloads already queued on the device have written it. On cpu the host tier is plain
memory and the copies run at once, which is in order too.

The pinned tensors come from PyTorch's pinned allocator, which rounds each allocation up to a
power of two. So a pinned tier is rounded down to the blocks whose layer tensor fills a power of
two bytes (`pinned_num_blocks`): what it pins is what it uses and never more than asked, at the
cost of up to half the blocks asked for (none where a layer's share is a power of two already).
"""

from __future__ import annotations

import statistics
import time

import torch

from tandem.engine.host_tensors import to_device
from tandem.engine.kv_cache.host_tier import KVTransfers


def pinned_num_blocks(num_blocks: int, layer_block_bytes: int) -> int:
    """The most blocks, at most `num_blocks`, whose layer tensor the pinned allocator gives
    without rounding: its bytes are the largest power of two the asked tensor holds."""
    if num_blocks < 1 or layer_block_bytes < 1:
        return 0
    power = 1 << ((num_blocks * layer_block_bytes).bit_length() - 1)
    return power // layer_block_bytes


def _layer_block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block in one layer's cache ([2, blocks, block_size, heads, dim])."""
    return cache[:, 0].numel() * cache.element_size()


class HostKVCache:
    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.device_caches = device_caches
        self.device = device_caches[0].device
        pin = self.device.type == "cuda"
        if pin:
            num_blocks = pinned_num_blocks(num_blocks, _layer_block_bytes(device_caches[0]))
        self.num_blocks = num_blocks
        self.host_caches = [torch.zeros((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype, pin_memory=pin)
                            for c in device_caches]
        # What the copies index: on cuda, device views of the pinned memory (module doc).
        self._views = [_device_view(h, self.device) for h in self.host_caches] if pin else self.host_caches

    def apply(self, transfers: KVTransfers | None) -> None:
        """Run a step's copies: every offload (device -> host), then every reload (host -> device)."""
        if transfers is None:
            return
        if transfers.offloads:
            blocks, slots = zip(*transfers.offloads)
            _copy_blocks(self.device_caches, list(blocks), self._views, list(slots))
        if transfers.reloads:
            slots, blocks = zip(*transfers.reloads)
            _copy_blocks(self._views, list(slots), self.device_caches, list(blocks))


    def measure_reload_tok_s(self, block_size: int, num_blocks: int = 64, repeats: int = 5) -> float:
        """Prompt tokens per second a reload copies back to the device: `num_blocks` blocks of
        scratch tensors shaped as the caches, copied the way `apply` copies (the device view of
        pinned memory on cuda), median of `repeats`. The caches themselves are not touched."""
        num_blocks = max(1, min(num_blocks, self.num_blocks))
        device = [torch.empty((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype, device=self.device)
                  for c in self.device_caches]
        host = [torch.zeros_like(d, device="cpu", pin_memory=self.device.type == "cuda") for d in device]
        views = [_device_view(h, self.device) for h in host] if self.device.type == "cuda" else host
        ids = list(range(num_blocks))
        runs = []
        for _ in range(repeats + 1):  # the first warms the kernels up
            _synchronize(self.device)
            start = time.perf_counter()
            _copy_blocks(views, ids, device, ids)
            _synchronize(self.device)
            runs.append(num_blocks * block_size / (time.perf_counter() - start))
        return statistics.median(runs[1:])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_blocks(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor], dst_ids: list[int]) -> None:
    """dst[l][:, dst_ids] = src[l][:, src_ids] for every layer l: a gather and a scatter per layer.
    Both sides are on one device except on mps (host tensors on the cpu, moved between)."""
    src_device, dst_device = src[0].device, dst[0].device
    if src_device == dst_device:
        index = to_device(src_ids + dst_ids, torch.int64, src_device)
        src_index, dst_index = index[: len(src_ids)], index[len(src_ids):]
    else:
        src_index, dst_index = to_device(src_ids, torch.int64, src_device), to_device(dst_ids, torch.int64, dst_device)
    for s, d in zip(src, dst):
        d.index_copy_(1, dst_index, s.index_select(1, src_index).to(dst_device))


class _CudaArray:
    """A pinned host buffer as the CUDA array interface describes it, for `torch.as_tensor`."""

    def __init__(self, host: torch.Tensor) -> None:
        self._host = host  # keeps the memory alive as long as the view
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "strides": None, "data": (host.data_ptr(), False), "version": 3}


def _device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A cuda tensor over the (zeroed) pinned host tensor's memory: the GPU's kernels read and
    write it in place. Checked once by a write from the device that the host must see."""
    if not host.is_pinned():
        raise ValueError("a device view needs pinned host memory")
    flat = torch.as_tensor(_CudaArray(host), device=device)
    if flat.data_ptr() != host.data_ptr() or flat.device.type != "cuda":
        raise RuntimeError("the pinned host KV tier is not addressable from the device (no unified addressing)")
    flat[:1].fill_(1)
    torch.cuda.synchronize(device)
    seen = host.view(torch.uint8)
    if seen.view(-1)[0].item() != 1:
        raise RuntimeError("a device write to the pinned host KV tier did not reach host memory")
    seen.view(-1)[0] = 0
    return flat.view(host.dtype).view(host.shape)
