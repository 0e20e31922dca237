"""The host KV tier: its index (LRU, pins), the KV cache manager's offloads and reloads, the
scheduler's transfers and tier reports, on exact ids (no torch), then whole engines on the cpu
and the sim device, with the tier on and off."""

import random

import pytest

from tandem.engine.kv_cache import TIER_DEVICE, TIER_HOST, TIER_NONE, HostKVTier, KVCacheManager, KVTransfers
from tandem.engine.kv_cache import hash_request_blocks
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def make_request(req_id, token_ids, max_tokens=4):
    return Request(req_id, token_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


# -- the index --------------------------------------------------------------------------------
def test_store_and_lookup():
    tier = HostKVTier(3)
    assert tier.store(10) == 0 and tier.store(11) == 1
    assert tier.lookup(10) == 0 and tier.lookup(11) == 1 and tier.lookup(12) is None
    assert 10 in tier and 12 not in tier
    assert tier.num_used_blocks == 2 and tier.num_offloaded_blocks == 2
    with pytest.raises(ValueError, match="already"):
        tier.store(10)


def test_a_full_tier_evicts_the_least_recently_stored_or_reloaded():
    evicted = []
    tier = HostKVTier(2, on_evict=evicted.append)
    tier.store(10)
    tier.store(11)
    tier.record_reload(10)  # 10 is now the most recently used
    assert tier.store(12) == 1  # 11's slot
    assert evicted == [11] and tier.hashes() == [10, 12]
    tier.touch(10)
    assert tier.store(13) == 1 and evicted == [11, 12]
    assert tier.slot_hash(1) == 13 and tier.lookup(12) is None


def test_a_pinned_slot_is_never_evicted():
    evicted = []
    tier = HostKVTier(2, on_evict=evicted.append)
    tier.store(10)
    tier.store(11)
    tier.pin(0)  # 10, the least recently used
    assert tier.store(12) == 1 and evicted == [11]
    assert tier.lookup(10) == 0


def test_every_slot_pinned_stores_nothing():
    tier = HostKVTier(2)
    tier.store(10)
    tier.store(11)
    tier.pin(0)
    tier.pin(1)
    tier.pin(1)
    assert tier.store(12) is None
    assert tier.hashes() == [10, 11] and tier.num_offloaded_blocks == 2
    tier.unpin(1)
    assert tier.store(12) is None  # still pinned once
    tier.unpin(1)
    assert tier.store(12) == 1
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin(1)
    with pytest.raises(ValueError, match="holds no block"):
        HostKVTier(1).pin(0)


# -- the manager ------------------------------------------------------------------------------
class Changes:
    def __init__(self):
        self.log = []

    def __call__(self, block_hash, state):
        self.log.append((block_hash, state))

    def latest(self):
        return dict(self.log)


def test_an_eviction_offloads_and_reports_the_host_tier():
    changes = Changes()
    kv = KVCacheManager(num_blocks=4, block_size=BS, on_change=changes, num_host_blocks=4, offload_min_hits=0)
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)  # blocks 1, 2, published
    kv.free(r1)
    h = hash_request_blocks(list(range(8)), BS)
    assert changes.latest() == {h[0]: TIER_DEVICE, h[1]: TIER_DEVICE}
    assert kv.take_transfers() is None
    kv.allocate_slots(make_request("b", [50 + i for i in range(12)]), 12)  # evicts block 2 (tail first), then 1
    assert kv.take_transfers() == KVTransfers(offloads=[(2, 0), (1, 1)], reloads=[])
    assert changes.latest()[h[0]] == TIER_HOST and changes.latest()[h[1]] == TIER_HOST
    assert kv.host_tier.lookup(h[0]) == 1 and kv.host_tier.lookup(h[1]) == 0
    assert kv.num_cached_tokens(list(range(9))) == 8  # both tiers count
    assert kv.take_transfers() is None  # taken once


def test_the_gate_offloads_an_evicted_block_only_if_it_was_hit():
    changes = Changes()
    kv = KVCacheManager(num_blocks=4, block_size=BS, on_change=changes, num_host_blocks=4, offload_min_hits=1)
    h = hash_request_blocks(list(range(8)), BS)
    first = make_request("a", list(range(8)))
    kv.allocate_slots(first, 8)  # blocks 1, 2, published, never hit
    kv.free(first)
    second = make_request("b", list(range(4)) + [90, 91, 92, 93, 94])
    computed = kv.get_computed_blocks(second)  # block 1 (the first 4 tokens) is hit once
    kv.allocate_slots(second, 9 - computed.num_tokens, computed)
    kv.free(second)
    kv.allocate_slots(make_request("c", [50 + i for i in range(12)]), 12)  # evicts every cached block
    transfers = kv.take_transfers()
    assert transfers is not None and [block for block, _ in transfers.offloads] == [1]
    assert changes.latest()[h[0]] == TIER_HOST and changes.latest()[h[1]] == TIER_NONE


def test_a_later_request_reloads_instead_of_recomputing():
    changes = Changes()
    kv = KVCacheManager(num_blocks=5, block_size=BS, on_change=changes, num_host_blocks=8, offload_min_hits=0)
    scheduler = Scheduler(SchedulerConfig(max_active=1, max_num_batched_tokens=64, block_size=BS, num_blocks=5), kv)
    prompt = list(range(12))
    run_to_end(scheduler, make_request("a", prompt, max_tokens=1))  # publishes 3 blocks
    run_to_end(scheduler, make_request("b", [90 + i for i in range(16)], max_tokens=1))  # evicts them
    h = hash_request_blocks(prompt, BS)
    assert all(changes.latest()[x] == TIER_HOST for x in h)
    again = make_request("c", prompt + [7], max_tokens=1)
    scheduler.add_request(again)
    out = scheduler.schedule()
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("c", 1)]
    assert again.num_computed_tokens == 12 and again.num_cached_tokens == 12 and again.num_host_cached_tokens == 12
    block_ids = kv.get_block_ids("c")
    assert [dst for _, dst in out.kv_transfers.reloads] == block_ids[:3]
    assert [src for src, _ in out.kv_transfers.reloads] == [kv.host_tier.lookup(x) for x in h]
    assert all(changes.latest()[x] == TIER_DEVICE for x in h)  # published on the device again
    assert kv.prefix_cache_host_hits == 12 and kv.host_tier.num_reloaded_blocks == 3
    assert not any(kv.host_tier.is_pinned(slot) for slot in range(8))  # unpinned once taken


def fill_both_tiers(num_host_blocks):
    """Three usable device blocks: one-block prompts a, b, c, then a two-block x that pushes a
    and b out of the device (to the host tier if it has room). Returns the cache, its reports,
    and the hashes of a, b, c and of x's second block."""
    changes = Changes()
    kv = KVCacheManager(num_blocks=4, block_size=BS, on_change=changes, num_host_blocks=num_host_blocks, offload_min_hits=0)
    prompts = [[10 * p + i for i in range(4)] for p in range(3)] + [[50 + i for i in range(8)]]
    for n, prompt in enumerate(prompts):
        request = make_request(f"fill{n}", prompt)
        kv.allocate_slots(request, len(prompt))
        kv.free(request)
    kv.take_transfers()
    *hashes, x = (hash_request_blocks(p, BS)[-1] for p in prompts)
    return kv, changes, prompts[0], (*hashes, x)


def test_a_reload_racing_an_eviction_keeps_its_slot():
    """The host tier is full; a request reloads its least recently used entry, and the device
    blocks its allocation evicts go to another slot, never the one the reload reads."""
    kv, changes, a, (ha, hb, hc, hx) = fill_both_tiers(num_host_blocks=2)
    assert kv.host_tier.hashes() == [ha, hb] and {hc, hx} <= set(kv.block_pool.cached_blocks)
    slot_a, slot_b = kv.host_tier.lookup(ha), kv.host_tier.lookup(hb)
    request = make_request("d", a + [9, 9, 9])  # hits a's block in the host tier, needs 2 device blocks
    computed = kv.get_computed_blocks(request)
    assert computed.host_slots == [slot_a] and computed.num_host_tokens == 4
    assert kv.allocate_slots(request, 3, computed) is not None  # evicts c's block, then x's
    transfers = kv.take_transfers()
    assert [slot for _, slot in transfers.offloads] == [slot_b]  # the slot's last store only
    assert [src for src, _ in transfers.reloads] == [slot_a]
    latest = changes.latest()
    assert (latest[ha], latest[hb], latest[hc], latest[hx]) == (TIER_DEVICE, TIER_NONE, TIER_NONE, TIER_HOST)
    assert kv.host_tier.hashes() == [hx, ha]  # the reload made a the most recently used


def test_an_eviction_with_every_host_slot_pinned_is_dropped():
    kv, changes, a, (ha, hb, hc, hx) = fill_both_tiers(num_host_blocks=1)
    assert kv.host_tier.hashes() == [hb]
    b = [10 + i for i in range(4)]
    request = make_request("d", b + [9, 9, 9])
    kv.allocate_slots(request, 3, kv.get_computed_blocks(request))  # reload b, evict c and x: no room
    transfers = kv.take_transfers()
    assert transfers.offloads == [] and len(transfers.reloads) == 1
    latest = changes.latest()
    assert (latest[ha], latest[hb], latest[hc], latest[hx]) == (TIER_NONE, TIER_DEVICE, TIER_NONE, TIER_NONE)
    assert kv.host_tier.hashes() == [hb]


def test_a_cache_without_a_host_tier_plans_no_transfers():
    kv = KVCacheManager(num_blocks=4, block_size=BS, on_change=Changes())
    request = make_request("a", list(range(8)))
    kv.allocate_slots(request, 8)
    kv.free(request)
    kv.allocate_slots(make_request("b", [50 + i for i in range(12)]), 12)
    assert kv.host_tier is None and kv.take_transfers() is None
    assert kv.get_computed_blocks(make_request("c", list(range(9)))).host_slots == []


def run_to_end(scheduler, request):
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, {s.request.req_id: 1 for s in out.scheduled if s.completes_prefill})


class Contents:
    """What each device block and host slot holds, moved as the runner would: a step's offloads,
    then its reloads, then its forward writing each scheduled token's block."""

    def __init__(self):
        self.device, self.host = {}, {}

    def step(self, out, kv):
        if out.kv_transfers is not None:
            before = dict(self.device)
            for block_id, slot in out.kv_transfers.offloads:
                self.host[slot] = before[block_id]
            for slot, block_id in out.kv_transfers.reloads:
                self.device[block_id] = self.host[slot]
        for s in out.scheduled:
            request = s.request
            hashes = request.block_hashes(BS)
            start, end = request.num_computed_tokens, request.num_computed_tokens + s.num_scheduled_tokens
            block_ids = kv.get_block_ids(request.req_id)
            for i in range(start // BS, (end - 1) // BS + 1):
                full = (i + 1) * BS <= end and i < len(hashes)
                self.device[block_ids[i]] = hashes[i] if full else ("partial", request.req_id, i)


def check_tiers(kv, mirror, contents):
    tier, cached = kv.host_tier, kv.block_pool.cached_blocks
    hashes = tier.hashes()
    slots = [tier.lookup(h) for h in hashes]
    assert len(set(slots)) == len(slots) == tier.num_used_blocks <= tier.num_blocks
    assert all(tier.slot_hash(slot) == h for h, slot in zip(hashes, slots))
    assert not any(tier.is_pinned(slot) for slot in range(tier.num_blocks))
    for h, block in cached.items():  # the indexes say what the blocks hold
        assert contents.device[block.block_id] == h
    for h, slot in zip(hashes, slots):
        assert contents.host[slot] == h
    for h, state in mirror.items():  # the reports say where each hash is
        expected = TIER_DEVICE if h in cached else TIER_HOST if h in tier else TIER_NONE
        assert state == expected, (h, state, expected)
    assert all(h in mirror for h in (*cached, *hashes))


def test_the_tiers_accounting_matches_the_engines_after_every_step():
    rng = random.Random(0)
    changes = Changes()
    # Two running requests need at most 2 x 12 blocks: cached blocks are evicted, nobody is preempted.
    kv = KVCacheManager(num_blocks=27, block_size=BS, on_change=changes, num_host_blocks=10, offload_min_hits=0)
    scheduler = Scheduler(SchedulerConfig(max_active=2, max_num_batched_tokens=16, block_size=BS, num_blocks=27), kv)
    prefixes = [[100 * p + i for i in range(rng.choice((8, 12, 16, 24)))] for p in range(6)]
    mirror, contents = {}, Contents()
    for n in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]
        scheduler.add_request(make_request(f"r{n}", prompt, max_tokens=rng.randrange(1, 9)))
    num_steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        contents.step(out, kv)
        mirror.update(changes.log)
        changes.log.clear()
        sampled = {s.request.req_id: 3000 + num_steps for s in out.scheduled if s.completes_prefill}
        scheduler.update_from_output(out, sampled)
        check_tiers(kv, mirror, contents)
        num_steps += 1
    assert scheduler.num_preemptions == 0
    tier = kv.host_tier
    assert tier.num_reloaded_blocks > 0 and tier.num_offloaded_blocks > tier.num_blocks  # it filled and evicted
    assert kv.prefix_cache_host_hits == tier.num_hit_blocks * BS > 0
