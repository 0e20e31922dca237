"""The paged KV cache's bookkeeping: which block holds which tokens, and which blocks can be
reused by a later request with the same prefix. No torch here: the tensors live in the model
runner; this package only hands out block ids, so it is tested on exact ids in milliseconds."""

from tandem.engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tandem.engine.kv_cache.hashing import hash_block_tokens, hash_request_blocks
from tandem.engine.kv_cache.host_tier import HostKVTier, KVTransfers
from tandem.engine.kv_cache.manager import TIER_DEVICE, TIER_HOST, TIER_NONE, ComputedBlocks, KVCacheManager

__all__ = [
    "TIER_DEVICE",
    "TIER_HOST",
    "TIER_NONE",
    "BlockPool",
    "ComputedBlocks",
    "FreeBlockQueue",
    "HostKVTier",
    "KVTransfers",
    "KVCacheBlock",
    "KVCacheManager",
    "hash_block_tokens",
    "hash_request_blocks",
]
