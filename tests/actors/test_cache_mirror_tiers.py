"""The router's mirror of a backend with a host-memory KV tier: each reported hash lands in the
tier that now holds it, and a prompt's answer is its device hit plus the run of host-tier blocks
right after it, with the engine's cap (the prompt's last token is always computed)."""

from tandem.actors.cache_mirror import CacheMirror
from tandem.routing.tier_mirror import EVICTED, ON_DEVICE, ON_HOST
from tandem.engine.kv_cache.hashing import hash_request_blocks

BLOCK = 4


def prompt(n_tokens: int) -> tuple[list[int], list[int]]:
    tokens = list(range(100, 100 + n_tokens))
    return tokens, hash_request_blocks(tokens, BLOCK)


def test_states_move_a_hash_between_the_tiers():
    mirror = CacheMirror(BLOCK)
    mirror.apply({1: ON_DEVICE, 2: ON_HOST})
    assert (mirror.cached, mirror.host) == ({1}, {2})
    mirror.apply({1: ON_HOST, 2: ON_DEVICE})
    assert (mirror.cached, mirror.host) == ({2}, {1})
    mirror.apply({1: EVICTED, 2: False, 3: True})  # the untiered report's booleans
    assert (mirror.cached, mirror.host) == ({3}, set())


def test_a_prompt_hits_the_device_then_the_host_run_after_it():
    tokens, hashes = prompt(5 * BLOCK + 1)
    mirror = CacheMirror(BLOCK)
    mirror.apply({hashes[0]: ON_DEVICE, hashes[1]: ON_DEVICE, hashes[2]: ON_HOST, hashes[3]: ON_HOST})
    num_cached = mirror.num_cached_tokens(hashes, len(tokens))
    assert num_cached == 2 * BLOCK
    assert mirror.num_host_cached_tokens(hashes, len(tokens), num_cached) == 2 * BLOCK


def test_the_host_run_stops_at_a_gap_and_at_the_last_token():
    tokens, hashes = prompt(4 * BLOCK)  # the last block holds the last token: never a hit
    mirror = CacheMirror(BLOCK)
    mirror.apply({h: ON_HOST for h in hashes})
    assert mirror.num_cached_tokens(hashes, len(tokens)) == 0
    assert mirror.num_host_cached_tokens(hashes, len(tokens), 0) == 3 * BLOCK
    mirror.apply({hashes[1]: EVICTED})
    assert mirror.num_host_cached_tokens(hashes, len(tokens), 0) == BLOCK
