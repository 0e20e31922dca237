"""A mirror of one backend's prefix-cache index by KV tier: the block hashes its device holds, and
those only its host-memory tier holds.

A backend reports each changed hash by the best tier that holds it now (`ON_DEVICE`, `ON_HOST`,
`EVICTED`; a backend without a host tier reports True and False, which read as `ON_DEVICE` and
`EVICTED`). A prompt's answer is its device hit, then the run of host-tier blocks right after it,
which is what the engine reloads instead of computing (routing/cost_model.py prices each). The
live router's mirror (actors/cache_mirror.py) and route-sim's (routing/simulator.py) both keep
their tiers with `apply_tier_changes` and answer the host run with `host_run_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.routing.inflight import num_cached_prefix_tokens

EVICTED, ON_DEVICE, ON_HOST = 0, 1, 2


def apply_tier_changes(device: set[int], host: set[int], changes: dict[int, int]) -> None:
    """Move each changed hash into the set of the tier that now holds it (latest state per hash)."""
    for block_hash, tier in changes.items():
        if tier == ON_DEVICE:
            device.add(block_hash)
            host.discard(block_hash)
        elif tier == ON_HOST:
            device.discard(block_hash)
            host.add(block_hash)
        else:
            device.discard(block_hash)
            host.discard(block_hash)


def host_run_tokens(host: set[int], block_hashes: Sequence[int], num_tokens: int, block_size: int,
                    num_cached: int) -> int:
    """Tokens of the run of host-tier blocks right after a device hit of `num_cached` tokens,
    capped as a device hit is (the prompt's last token is always computed)."""
    if not host:
        return 0
    first = num_cached // block_size
    return num_cached_prefix_tokens(block_hashes[first:], num_tokens - num_cached, block_size, host.__contains__)


class TierMirror:
    """One backend's cached block hashes, by tier."""

    def __init__(self) -> None:
        self.device: set[int] = set()
        self.host: set[int] = set()  # only in the host tier

    def apply(self, changes: dict[int, int]) -> None:
        apply_tier_changes(self.device, self.host, changes)

    def num_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int, block_size: int) -> int:
        return num_cached_prefix_tokens(block_hashes, num_tokens, block_size, self.device.__contains__)

    def num_host_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int, block_size: int,
                               num_cached: int) -> int:
        return host_run_tokens(self.host, block_hashes, num_tokens, block_size, num_cached)
