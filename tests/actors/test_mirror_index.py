"""The inverted prefix mirror (`MirrorIndex`) gives every backend the answer its own `CacheMirror`
gives, the reference: device hit and host-tier run, on random reports, prompts, block sizes and
backends joining and leaving; and the router actor's one-walk answers equal its per-backend ones."""

import asyncio
import random

from tandem.actors.cache_mirror import CacheMirror, MirrorIndex
from tandem.routing.tier_mirror import EVICTED, ON_DEVICE, ON_HOST
from tandem.actors.messages import BackendInfo
from tandem.actors.router import RouterActor
from tandem.engine.kv_cache.hashing import hash_request_blocks

BLOCK_SIZES = (4, 8)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that share prefixes of random lengths (a few tenants' prefixes, random suffixes)."""
    stems = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(4)]
    return [rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))] for _ in range(n)]


def random_changes(rng: random.Random, pool: list[int]) -> dict:
    tiers = (ON_DEVICE, ON_HOST, EVICTED, True, False)
    return {rng.choice(pool): rng.choice(tiers) for _ in range(rng.randrange(1, 12))}


def test_index_answers_equal_each_mirrors_own():
    rng = random.Random(7)
    seen = {"device": 0, "host": 0}
    for trial in range(40):
        index = MirrorIndex()
        pool_prompts = prompts(rng, 30)
        pools = {bs: sorted({h for p in pool_prompts for h in hash_request_blocks(p, bs)}) for bs in BLOCK_SIZES}
        mirrors: list[CacheMirror] = []
        for step in range(60):
            action = rng.random()
            if action < 0.1 or not mirrors:
                bs = rng.choice(BLOCK_SIZES)
                initial = rng.sample(pools[bs], min(len(pools[bs]), rng.randrange(0, 6)))
                mirrors.append(CacheMirror(bs, initial, index))
            elif action < 0.15 and len(mirrors) > 1:
                mirrors.pop(rng.randrange(len(mirrors))).leave()
            else:
                mirror = rng.choice(mirrors)
                mirror.apply(random_changes(rng, pools[mirror.block_size]))
            prompt = rng.choice(pool_prompts)
            for bs in BLOCK_SIZES:
                hashes = hash_request_blocks(prompt, bs)
                same_size = [m for m in mirrors if m.block_size == bs]
                candidates = 0
                for m in same_size:
                    candidates |= m.bit
                device, host = index.answers(hashes, len(prompt), bs, candidates)
                seen["device"] += len(device)
                seen["host"] += len(host)
                for m in same_size:
                    position = m.bit.bit_length() - 1
                    num_cached = m.num_cached_tokens(hashes, len(prompt))
                    assert device.get(position, 0) == num_cached, (trial, step)
                    assert host.get(position, 0) == m.num_host_cached_tokens(hashes, len(prompt), num_cached), (trial, step)
        # The index holds exactly what the mirrors hold.
        for tier, sets in ((index.device, lambda m: m.cached), (index.host, lambda m: m.host)):
            expected: dict[int, int] = {}
            for m in mirrors:
                for h in sets(m):
                    expected[h] = expected.get(h, 0) | m.bit
            assert tier == expected
    assert seen["device"] > 100 and seen["host"] > 100, seen  # the workload exercises both tiers


def test_router_actor_answers_equal_its_per_backend_reference():
    rng = random.Random(3)
    rates = {"prefill_tok_s": 1000.0, "decode_tok_s": 100.0}

    async def scenario():
        router = RouterActor("cost", None, health_check_period_s=1e9)
        pool_prompts = prompts(rng, 40)
        live: list[str] = []
        for step in range(300):
            action = rng.random()
            if action < 0.08 or not live:
                backend_id = f"b{rng.randrange(12)}"  # re-registering an id drops its old mirror first
                bs = rng.choice(BLOCK_SIZES)
                info = BackendInfo(backend_id, f"i{step}", "cuda", "cuda", "cuda", "float32", 1, 4, bs, "m", 4096,
                                   rates=rates)
                cached = hash_request_blocks(rng.choice(pool_prompts), bs)[: rng.randrange(0, 5)]
                await router.add_backend(info, handle=None, cached_hashes=cached)
                live = list(router.backends)
            elif action < 0.12 and len(live) > 1:
                router._drop(rng.choice(live), reason="test")
                live = list(router.backends)
            else:
                backend = router.backends[rng.choice(live)]
                pool = [h for p in pool_prompts for h in hash_request_blocks(p, backend.info.block_size)]
                await router.report(backend.info.backend_id, backend.info.instance_id, [], (),
                                    random_changes(rng, pool))
            prompt = rng.choice(pool_prompts)
            hashes = {bs: hash_request_blocks(prompt, bs) for bs in {b.info.block_size for b in router.backends.values()}}
            num_cached, num_host = router._cache_answers(hashes, len(prompt))
            reference = router._num_cached(hashes, len(prompt))
            assert list(num_cached.items()) == list(reference.items())
            assert list(num_host.items()) == list(router._num_host_cached(hashes, len(prompt), reference).items())
        if router._health_task is not None:
            router._health_task.cancel()

    asyncio.run(scenario())
