"""The host KV tier's index: which prefix-cache blocks a second, larger cache in host memory holds.

A GPU's KV pool evicts the least recently used cached block whenever it needs a free one. With
a host tier the evicted block is first copied to a host slot (an *offload*), so a later request
with that prefix copies it back (a *reload*, a host-to-device copy of a few milliseconds)
instead of prefilling it again (vLLM's CPU offloading, SGLang's HiCache and LMCache keep the
same second tier). This module is only the bookkeeping: a slot per host block, a hash -> slot
index in LRU order, and pin counts. The host tensors live in the model runner; the KV cache
manager (engine/kv_cache/manager.py) decides when to store and when to reload.

LRU across the two tiers: an entry is touched when it is stored (its block just left the GPU)
and when it is reloaded, so the host evicts the blocks that have gone longest without use on
either tier. A pinned slot is the source of a reload that has not been handed to the runner
yet: storing never overwrites it, so a copy planned in a step never reads a slot another copy
of that step writes. When every slot is pinned, `store` stores nothing.

A step's copies (`KVTransfers`) run in this order, before the step's forward:
1. offloads, device -> host: each reads a device block as the previous steps left it (nothing
   of this step has written yet), so a block evicted and handed to a new owner this step is
   saved before its new owner's reload or forward overwrites it;
2. reloads, host -> device: each reads a slot after the offloads, so a block offloaded and
   reloaded within one step comes back whole. The slot it reads was pinned from the moment the
   reload was planned until the step's copies were handed over, so no offload of the step
   writes it (a reload racing an eviction loses nothing: the eviction takes another slot, or
   stores nothing). A slot stored twice in one step is written by its last store only.
On cuda both run on the stream of the forwards, so the steps before (still running under
asynchronous scheduling) finish writing a block before an offload reads it, and a reload's
writes land before the forward that reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class KVTransfers:
    """One step's copies between the tiers, for the runner to apply before the step's forward:
    every offload, then every reload (module doc)."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    reloads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block id)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.reloads)


class HostKVTier:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._on_evict = on_evict  # called with the hash of each entry a store evicts
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._slot_hash: list[int | None] = [None] * num_blocks
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # popped from the end: slot 0 first
        self._pins = [0] * num_blocks
        # Totals since start, in blocks.
        self.num_hit_blocks = 0  # blocks a prefix lookup found here
        self.num_offloaded_blocks = 0  # stores (device -> host copies)
        self.num_reloaded_blocks = 0  # reloads (host -> device copies)

    @property
    def num_used_blocks(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding `block_hash`, or None. Changes nothing."""
        return self._index.get(block_hash)

    def hashes(self) -> list[int]:
        """Every hash held, least recently used first."""
        return list(self._index)

    def slot_hash(self, slot: int) -> int | None:
        return self._slot_hash[slot]

    def touch(self, block_hash: int) -> None:
        """Make an entry the most recently used."""
        self._index.move_to_end(block_hash)

    def store(self, block_hash: int) -> int | None:
        """A slot for `block_hash` (not held yet), evicting the least recently used unpinned
        entry when no slot is free; the caller copies the block into it. None when every slot
        is pinned: nothing is stored."""
        if block_hash in self._index:
            raise ValueError(f"block hash {block_hash} is already in the host tier")
        slot = self._free_slots.pop() if self._free_slots else self._evict_lru()
        if slot is None:
            return None
        self._index[block_hash] = slot
        self._slot_hash[slot] = block_hash
        self.num_offloaded_blocks += 1
        return slot

    def _evict_lru(self) -> int | None:
        pins = self._pins
        victim = next((h for h, slot in self._index.items() if not pins[slot]), None)
        if victim is None:
            return None
        slot = self._index.pop(victim)
        self._slot_hash[slot] = None
        if self._on_evict is not None:
            self._on_evict(victim)
        return slot

    def pin(self, slot: int) -> None:
        if self._slot_hash[slot] is None:
            raise ValueError(f"host slot {slot} holds no block")
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise ValueError(f"host slot {slot} is not pinned")
        self._pins[slot] -= 1

    def is_pinned(self, slot: int) -> bool:
        return self._pins[slot] > 0

    def record_reload(self, block_hash: int) -> None:
        """A reload of `block_hash` was planned: it becomes the most recently used."""
        self._index.move_to_end(block_hash)
        self.num_reloaded_blocks += 1
