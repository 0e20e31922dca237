"""The one allocator API the scheduler uses (vLLM v1's KVCacheManager shape):
look up computed blocks, allocate slots or return None, free.

Blocks are published to the prefix cache when they are allocated for tokens being computed
this step, i.e. as soon as their prefill is scheduled: a second request with the same prefix
hits before the first one finishes. The forward writes every new token's K/V before any
attention reads, so a hit on a block filled in the same step reads finished data.

With a host tier (engine/kv_cache/host_tier.py) a cached block the pool evicts is offloaded to
host memory, and a prefix hit continues into the host tier where the device's ends: those
blocks get fresh device blocks, reloaded from their host slots and published at once, and
count as computed. The step's copies are taken with `take_transfers` (the scheduler puts them
on its output) and run before the step's forward, offloads first (host_tier.py says why that
order is safe). Without a host tier nothing here changes.

Every evicted cached block is offloaded by default (`offload_min_hits` 0), as vLLM's CPU
offloading and LMCache store every block. `offload_min_hits` N keeps only blocks hit at least N
times (SGLang HiCache's selective write-through): it spares a workload without reuse its copies,
but on many tenants' prefixes the prefix a tenant sent once is gone by its next request, and
measured on an H100 the gate cost more than it saved (docs/benchmarks/host-tier-h100.md).

Every change of where a block hash is held goes to `on_change(block_hash, state)`:
`TIER_DEVICE` (1) published on the device, `TIER_HOST` (2) evicted from the device but held in
the host tier, `TIER_NONE` (0) held nowhere (a host eviction of a hash the device holds is not
a change). 1 and 0 read as the True and False of a cache without a host tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.kv_cache.host_tier import HostKVTier, KVTransfers

if TYPE_CHECKING:  # engine.request imports engine.kv_cache.hashing: a runtime import would be circular
    from tandem.engine.request import Request

TIER_NONE = 0
TIER_DEVICE = 1
TIER_HOST = 2
DEFAULT_OFFLOAD_MIN_HITS = 0  # the host tier keeps an evicted block hit at least this often (module doc)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_cached_prefix_tokens(
    block_hashes: Sequence[int], num_tokens: int, block_size: int, is_cached: Callable[[int], bool]
) -> int:
    """Tokens covered by the longest run of cached leading blocks, capped at num_tokens - 1 so
    the last token is always computed (its logits are what the next token is sampled from).
    Shared by the engine and by anyone mirroring its cache index (the router)."""
    max_blocks = (num_tokens - 1) // block_size
    num_hits = 0
    for block_hash in block_hashes[:max_blocks]:
        if not is_cached(block_hash):
            break
        num_hits += 1
    return num_hits * block_size


@dataclass
class ComputedBlocks:
    """A waiting request's prefix hit: the device blocks it shares, then the host slots of the
    blocks that follow them, reloaded if the request is admitted."""

    blocks: list[KVCacheBlock]
    host_slots: list[int]
    num_tokens: int  # tokens both cover
    num_host_tokens: int  # tokens of the host slots


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_change: Callable[[int, int], None] | None = None,
        num_host_blocks: int = 0,
        offload_min_hits: int = DEFAULT_OFFLOAD_MIN_HITS,
    ) -> None:
        """`on_change(block_hash, state)` hears where each hash is held (module doc);
        `num_host_blocks` > 0 adds a host tier of that many blocks, which keeps evicted blocks
        that were hit at least `offload_min_hits` times."""
        self.block_size = block_size
        self.offload_min_hits = offload_min_hits
        self._on_change = on_change
        self.host_tier = HostKVTier(num_host_blocks, on_evict=self._on_host_evict) if num_host_blocks else None
        on_evict = self._on_device_evict if self.host_tier is not None or on_change is not None else None
        on_publish = None if on_change is None else (lambda block_hash: on_change(block_hash, TIER_DEVICE))
        self.block_pool = BlockPool(num_blocks, on_evict=on_evict, on_publish=on_publish)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks as ids, kept in step so the runner's per-step block tables cost nothing.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are already published, so each step only
        # publishes the blocks that just became full.
        self.req_to_num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found, in either tier
        self.prefix_cache_host_hits = 0  # tokens found in the host tier
        # This step's copies between the tiers, until `take_transfers`: host slot -> device block
        # (a slot stored twice in a step is written by its last store only), and (slot, block).
        self._offloads: dict[int, int] = {}
        self._reloads: list[tuple[int, int]] = []

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.block_pool.get_num_free_blocks() / self.num_usable_blocks

    # -- where a hash is held ------------------------------------------------------------------
    def _on_device_evict(self, block_hash: int, block_id: int) -> None:
        """The pool reuses a cached block: keep it in the host tier (an offload) if there is one."""
        tier, state = self.host_tier, TIER_NONE
        if tier is not None:
            if block_hash in tier:
                tier.touch(block_hash)
                state = TIER_HOST
            elif self.block_pool.blocks[block_id].num_hits >= self.offload_min_hits:
                slot = tier.store(block_hash)
                if slot is not None:
                    self._offloads[slot] = block_id
                    state = TIER_HOST
        if self._on_change is not None:
            self._on_change(block_hash, state)

    def _on_host_evict(self, block_hash: int) -> None:
        if self._on_change is not None and block_hash not in self.block_pool.cached_blocks:
            self._on_change(block_hash, TIER_NONE)

    def take_transfers(self) -> KVTransfers | None:
        """The copies planned since the last call (None if none); the slots reloads read are
        unpinned, so later steps may overwrite them (their copies run after these)."""
        if not (self._offloads or self._reloads):
            return None
        transfers = KVTransfers([(block_id, slot) for slot, block_id in self._offloads.items()], self._reloads)
        for slot, _ in self._reloads:
            self.host_tier.unpin(slot)
        self._offloads, self._reloads = {}, []
        return transfers

    # -- prefix hits -----------------------------------------------------------------------------
    def _longest_cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> tuple[list[KVCacheBlock],
                                                                                          list[int]]:
        """Device hits, then the host slots of the blocks after them. Capped at num_tokens - 1
        so the last token is always computed: its logits are what the next token is sampled from."""
        max_blocks = (num_tokens - 1) // self.block_size
        hits, host_slots = [], []
        get_cached_block = self.block_pool.get_cached_block
        for block_hash in block_hashes[:max_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        tier = self.host_tier
        if tier is not None:
            for block_hash in block_hashes[len(hits):max_blocks]:
                slot = tier.lookup(block_hash)
                if slot is None:
                    break
                host_slots.append(slot)
        return hits, host_slots

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The prefix a waiting request can start from: cached device blocks and host slots."""
        hits, host_slots = self._longest_cached_prefix(request.block_hashes(self.block_size), request.num_tokens)
        num_host_tokens = len(host_slots) * self.block_size
        num_hit_tokens = len(hits) * self.block_size + num_host_tokens
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        if host_slots:
            self.prefix_cache_host_hits += num_host_tokens
            self.host_tier.num_hit_blocks += len(host_slots)
        return ComputedBlocks(hits, host_slots, num_hit_tokens, num_host_tokens)

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many tokens of this prompt would hit now, in either tier. Changes no cache state or stats."""
        return self._num_cached_tokens(hash_request_blocks(token_ids, self.block_size), len(token_ids))

    def num_request_cached_tokens(self, request: Request) -> int:
        """`num_cached_tokens` of a request's tokens, from its memoized block hashes: a lookup
        per cached block, no hashing (what re-reporting a long waiting queue can afford)."""
        return self._num_cached_tokens(request.block_hashes(self.block_size), request.num_tokens)

    def _num_cached_tokens(self, hashes: Sequence[int], num_tokens: int) -> int:
        cached = self.block_pool.cached_blocks
        num_device = num_cached_prefix_tokens(hashes, num_tokens, self.block_size, cached.__contains__)
        tier = self.host_tier
        if tier is None:
            return num_device
        first = num_device // self.block_size
        return num_device + num_cached_prefix_tokens(hashes[first:], num_tokens - num_device, self.block_size,
                                                     tier.__contains__)

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed tokens (and
        after `computed`, a prefix hit being taken now). Returns the newly allocated blocks
        (reload targets first), or None, changing nothing, when the pool cannot supply them."""
        if computed is None and self._fits_without_change(request, num_new_tokens):
            return []
        hits = computed.blocks if computed is not None else ()
        host_slots = computed.host_slots if computed is not None else ()
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        req_block_ids = self.req_to_block_ids.setdefault(request.req_id, [])
        num_computed = request.num_computed_tokens + (computed.num_tokens if computed is not None else 0)
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(hits)
        # Hits that sit in the free queue stop being free once touched.
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_hits_free:
            return None
        self.block_pool.touch(hits)
        for slot in host_slots:  # before allocating: the evictions it causes must not take these slots
            self.host_tier.pin(slot)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        if host_slots:
            self._plan_reloads(request, len(hits), host_slots, new_blocks)
        for block in (*hits, *new_blocks):
            req_blocks.append(block)
            req_block_ids.append(block.block_id)
        self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        return new_blocks

    def _plan_reloads(self, request: Request, first: int, host_slots: Sequence[int],
                      targets: Sequence[KVCacheBlock]) -> None:
        """Reload each host slot into the next new block (published with the rest of the
        request's full blocks); its slot stays pinned until `take_transfers`."""
        tier = self.host_tier
        hashes = request.block_hashes(self.block_size)
        for i, (slot, block) in enumerate(zip(host_slots, targets)):
            self._reloads.append((slot, block.block_id))
            tier.record_reload(hashes[first + i])

    def _fits_without_change(self, request: Request, num_new_tokens: int) -> bool:
        """The common decode case, checked before any hashing or list building: the request's
        blocks already hold the new tokens and no block becomes full, so there is nothing to
        allocate or publish. Fifteen of every sixteen decode steps take this path."""
        req_blocks = self.req_to_blocks.get(request.req_id)
        if req_blocks is None:
            return False
        num_tokens = request.num_computed_tokens + num_new_tokens
        return (num_tokens <= len(req_blocks) * self.block_size
                and num_tokens // self.block_size <= self.req_to_num_cached_blocks.get(request.req_id, 0))

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        hashes = request.block_hashes(self.block_size)
        num_full = min(num_tokens // self.block_size, len(hashes))
        num_cached = self.req_to_num_cached_blocks.get(request.req_id, 0)
        for i in range(num_cached, num_full):
            self.block_pool.cache_block(req_blocks[i], hashes[i])
        self.req_to_num_cached_blocks[request.req_id] = max(num_cached, num_full)

    def free(self, request: Request) -> None:
        """Release a request's blocks, last block first, so its tail is evicted before its
        (more shareable) head."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.req_to_num_cached_blocks.pop(request.req_id, None)
        self.req_to_block_ids.pop(request.req_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table (a live list: copy it to keep a snapshot)."""
        return self.req_to_block_ids.get(req_id, [])
