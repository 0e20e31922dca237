"""The block pool: every KV block, a free list in LRU order, and the prefix-cache index.

A block is either referenced by running requests (ref_cnt > 0) or sits in the free queue.
A free block may still hold a cached prefix (it keeps its hash): it is reused only when the
free queue's head reaches it, so the least recently freed cached blocks are evicted first.
The free queue is a doubly linked list threaded through the blocks themselves, so taking a
cache hit out of the middle of the queue is O(1) (vLLM v1's FreeKVCacheBlockQueue design).
Block 0 is the null block: never handed out, it is where padded slots point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "num_hits", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.num_hits = 0  # prefix-cache hits on it since it was last handed out
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (LRU), append at the tail,
    remove from anywhere in O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """`on_evict(block_hash, block_id)` is called when a cached block is reused, before its new
    owner writes it; `on_publish(block_hash)` when a block enters the prefix-cache index."""

    def __init__(
        self,
        num_blocks: int,
        on_evict: Callable[[int, int], None] | None = None,
        on_publish: Callable[[int], None] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[int, KVCacheBlock] = {}
        self._on_evict = on_evict
        self._on_publish = on_publish

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            block.num_hits = 0
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            block.num_hits += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks that reach zero join the free queue's tail in the given
        order, so pass a request's blocks tail-first to evict its last blocks first."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Publish a full block under its chained hash. An identical block already published
        (two requests computed the same prefix at once) keeps the index entry."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        if self.cached_blocks.setdefault(block_hash, block) is block and self._on_publish is not None:
            self._on_publish(block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self._on_evict is not None:
                self._on_evict(block.block_hash, block.block_id)
        block.block_hash = None
