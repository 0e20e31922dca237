"""Block pool and KV cache manager bookkeeping, on exact block ids (no torch)."""

import subprocess
import sys

from tandem.engine.kv_cache import BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager, hash_request_blocks
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

BS = 4


def make_request(req_id, token_ids, max_tokens=8):
    return Request(req_id, token_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_bookkeeping_imports_no_torch():
    code = "import sys, tandem.engine.scheduler, tandem.engine.kv_cache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_each_bookkeeping_module_imports_first_without_a_cycle():
    for module in ("tandem.engine.request", "tandem.engine.kv_cache.manager", "tandem.engine.scheduler", "tandem.engine.kv_cache"):
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)


def test_free_queue_is_lru_with_o1_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4


def test_block_pool_reserves_null_block_and_hands_out_in_order():
    pool = BlockPool(6)
    assert pool.get_num_free_blocks() == 5
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.free_queue.block_ids() == [4, 5]


def test_chained_hashes_cover_whole_prefix():
    a = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = hash_request_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different parent
    assert hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], BS, a[:1])[:2] == a


def test_prefix_hit_is_capped_below_prompt_length():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r1 = make_request("a", list(range(8)))
    assert kv.allocate_slots(r1, 8) is not None
    assert kv.get_block_ids("a") == [1, 2]
    # Identical 8-token prompt: only the first block may hit, the last token must be computed.
    r2 = make_request("b", list(range(8)))
    computed = kv.get_computed_blocks(r2)
    assert [b.block_id for b in computed.blocks] == [1] and computed.num_tokens == 4
    # A longer prompt with the same prefix hits both blocks.
    assert kv.num_cached_tokens(list(range(9))) == 8


def test_num_cached_tokens_changes_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    kv.free(r1)
    before = (kv.block_pool.free_queue.block_ids(), kv.prefix_cache_queries, kv.prefix_cache_hits)
    assert kv.num_cached_tokens(list(range(12))) == 8
    assert (kv.block_pool.free_queue.block_ids(), kv.prefix_cache_queries, kv.prefix_cache_hits) == before


def test_free_returns_tail_first_and_cached_blocks_are_evicted_last_used_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    r1 = make_request("a", list(range(10)))
    kv.allocate_slots(r1, 10)  # blocks 1, 2 full (cached), 3 partial
    assert kv.get_block_ids("a") == [1, 2, 3]
    kv.free(r1)
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 3, 2, 1]
    # A hit on the cached prefix pulls blocks 1 and 2 out of the middle of the free queue.
    r2 = make_request("b", list(range(8)) + [99, 98])
    computed = kv.get_computed_blocks(r2)
    assert computed.num_tokens == 8 and computed.host_slots == []
    r2.num_computed_tokens = 0
    new = kv.allocate_slots(r2, 2, computed)
    assert [b.block_id for b in new] == [4]
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert kv.block_pool.free_queue.block_ids() == [5, 3]


def test_eviction_drops_hash_and_notifies():
    changes = []
    kv = KVCacheManager(num_blocks=4, block_size=BS, on_change=lambda h, state: changes.append((h, state)))
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    kv.free(r1)
    assert kv.num_cached_tokens(list(range(9))) == 8
    r2 = make_request("b", [50 + i for i in range(12)])
    kv.allocate_slots(r2, 12)  # needs all 3 usable blocks: evicts both cached ones
    hashes = hash_request_blocks(list(range(8)), BS)
    assert [c for c in changes if c[1] == 0] == [(hashes[1], 0), (hashes[0], 0)]  # the tail first
    assert [c for c in changes if c[1] == 1][:2] == [(hashes[0], 1), (hashes[1], 1)]
    assert kv.num_cached_tokens(list(range(9))) == 0


def test_allocate_returns_none_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    r2 = make_request("b", [7] * 8)
    assert kv.allocate_slots(r2, 8) is None
    assert kv.get_block_ids("b") == []
    assert kv.block_pool.free_queue.block_ids() == [3]


def test_decode_within_a_block_allocates_and_publishes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    assert [b.block_id for b in kv.allocate_slots(req, 6)] == [1, 2]
    req.num_computed_tokens = 6
    req.append_output_token(7)
    assert kv.allocate_slots(req, 1) == []  # position 6 fits in block 2, nothing becomes full
    assert list(kv.block_pool.cached_blocks.values()) == [kv.block_pool.blocks[1]]
    req.num_computed_tokens = 7
    req.append_output_token(8)
    assert kv.allocate_slots(req, 1) == []  # position 7 fills block 2: it is published
    assert [b.block_id for b in kv.block_pool.cached_blocks.values()] == [1, 2]
    assert kv.block_pool.blocks[2].block_hash == req.block_hashes(BS)[1]
    req.num_computed_tokens = 8
    req.append_output_token(9)
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [3]
    assert kv.get_block_ids("a") == [1, 2, 3]
