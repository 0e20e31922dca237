"""A simulated backend's prefix cache: a fixed number of KV blocks with LRU eviction.

It follows the engine's block pool closely enough for routing questions (which backend holds
which prefix, and what a cache too small for every tenant's prefix on every backend does):
- Only a prompt's full blocks are modelled, each identified by its chained hash; partial
  blocks and the blocks of generated tokens are not, so `num_kv_blocks` is the room for
  prompts' full blocks.
- When a request is admitted, its longest run of cached leading blocks is its hit (capped so
  the prompt's last token is computed), and all of its blocks are pinned while it runs: cached
  ones are reused, the others are allocated and published at once, as the engine publishes a
  block when its prefill is scheduled. A request admitted in the same step after another one
  with the same prefix therefore hits it.
- A finished request unpins its blocks; unpinned blocks stay cached in LRU order and are
  evicted, least recently used first, only when a new block needs the room. They are freed
  tail first, as vLLM does, so a shared prefix outlives the unique suffixes behind it.
- Pinned blocks are never evicted. If the running requests alone need more blocks than
  `num_kv_blocks`, the cache runs over (the engine would hold a request back instead); size
  the cache for at least `max_active` prompts.

Every publication and eviction is recorded as a change (hash -> cached or not), which the
simulated backend reports to the router's mirror at the end of the step, like a live backend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.routing.inflight import num_cached_prefix_tokens


class SimPrefixCache:
    def __init__(self, num_blocks: int | None, block_size: int) -> None:
        self.num_blocks = num_blocks  # None: unlimited
        self.block_size = block_size
        self.hash_to_ref_cnt: dict[int, int] = {}  # pinned by running requests
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, unpinned, LRU first
        self.changes: dict[int, bool] = {}  # since the last drain: published (True) / evicted
        self.num_evicted = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.hash_to_ref_cnt or block_hash in self.free

    @property
    def num_used_blocks(self) -> int:
        return len(self.hash_to_ref_cnt) + len(self.free)

    def num_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int) -> int:
        return num_cached_prefix_tokens(block_hashes, num_tokens, self.block_size, self.__contains__)

    def admit(self, block_hashes: Sequence[int], num_tokens: int) -> int:
        """Pin a request's blocks (allocating and publishing the missing ones); returns its hit."""
        num_hit_tokens = self.num_cached_tokens(block_hashes, num_tokens)
        for block_hash in block_hashes:
            if block_hash in self.hash_to_ref_cnt:
                self.hash_to_ref_cnt[block_hash] += 1
            elif block_hash in self.free:
                del self.free[block_hash]
                self.hash_to_ref_cnt[block_hash] = 1
            else:
                self._make_room()
                self.hash_to_ref_cnt[block_hash] = 1
                self.changes[block_hash] = True
        return num_hit_tokens

    def release(self, block_hashes: Sequence[int]) -> None:
        """Unpin a finished request's blocks, tail first, so the prefix is evicted last."""
        for block_hash in reversed(block_hashes):
            ref_cnt = self.hash_to_ref_cnt[block_hash] - 1
            if ref_cnt:
                self.hash_to_ref_cnt[block_hash] = ref_cnt
            else:
                del self.hash_to_ref_cnt[block_hash]
                self.free[block_hash] = None

    def drain_changes(self) -> dict[int, bool]:
        changes, self.changes = self.changes, {}
        return changes

    def _make_room(self) -> None:
        if self.num_blocks is None or self.num_used_blocks < self.num_blocks or not self.free:
            return
        block_hash, _ = self.free.popitem(last=False)
        self.changes[block_hash] = False
        self.num_evicted += 1
