"""The one allocator API the scheduler uses (vLLM v1's KVCacheManager shape):
look up computed blocks, allocate slots or return None, free.

Blocks are published to the prefix cache when they are allocated for tokens being computed
this step, i.e. as soon as their prefill is scheduled: a second request with the same prefix
hits before the first one finishes. The forward writes every new token's K/V before any
attention reads, so a hit on a block filled in the same step reads finished data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tandem.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from tandem.engine.kv_cache.hashing import hash_request_blocks

if TYPE_CHECKING:  # engine.request imports engine.kv_cache.hashing: a runtime import would be circular
    from tandem.engine.request import Request


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


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_evict: Callable[[int], None] | None = None,
        on_publish: Callable[[int], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, on_evict=on_evict, on_publish=on_publish)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks as ids, kept in step so the runner's per-step block tables cost nothing.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are already published, so each step only
        # publishes the blocks that just became full.
        self.req_to_num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.block_pool.get_num_free_blocks() / self.num_usable_blocks

    def _longest_cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[KVCacheBlock]:
        # Cap the hit at num_tokens - 1 so the last token is always computed: its logits
        # are what the next token is sampled from.
        max_blocks = (num_tokens - 1) // self.block_size
        hits = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks a waiting request can start from, and how many tokens they cover."""
        hits = self._longest_cached_prefix(request.block_hashes(self.block_size), request.num_tokens)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many tokens of this prompt would hit now. Changes no cache state or stats."""
        hashes = hash_request_blocks(token_ids, self.block_size)
        return num_cached_prefix_tokens(hashes, len(token_ids), self.block_size,
                                        self.block_pool.cached_blocks.__contains__)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed tokens (and
        after `new_computed_blocks`, a prefix hit being taken now). Returns the newly
        allocated blocks, or None, changing nothing, when the pool cannot supply them."""
        if not new_computed_blocks and self._fits_without_change(request, num_new_tokens):
            return []
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        req_block_ids = self.req_to_block_ids.setdefault(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        num_hits_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_hits_free:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        for block in (*new_computed_blocks, *new_blocks):
            req_blocks.append(block)
            req_block_ids.append(block.block_id)
        self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        return new_blocks

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
