"""The router's copy of each backend's prefix-cache index.

The cost model needs, per backend, how many tokens of a new prompt that backend could reuse.
Asking every backend on the decision path would put a round trip (and the slowest backend)
in front of every decision. Instead each backend reports which block hashes it published or
evicted, in the same batched fire-and-forget message that carries its progress, and the
router answers from this mirror with the engine's own rule (chained hashes, hit capped at
prompt length - 1). Chained hashes are Python tuple hashes of ints, which do not depend on
PYTHONHASHSEED, so router and backends compute the same values in different processes.
The mirror lags its backend by at most one report interval (~20 ms); the answer is an
estimate either way, frozen at routing time, and a later eviction is reported separately.
A backend with a host-memory KV tier reports each hash by the best tier that holds it (1: its
device, 2: only its host memory, 0: neither); the mirror keeps the two sets apart, and answers a
prompt with its device hit and the run of host-tier blocks right after it, which is what the
engine reloads instead of computing (routing/cost_model.py prices each). What the mirror cannot know yet, the prefixes of requests the router has just sent to a
backend, the pure router counts itself (routing/inflight.py) from the block hashes it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.kv_cache.manager import num_cached_prefix_tokens


# A block hash's state in a backend's report: the best tier that holds it.
EVICTED, ON_DEVICE, ON_HOST = 0, 1, 2


class CacheMirror:
    def __init__(self, block_size: int, cached_hashes: Iterable[int] = ()) -> None:
        self.block_size = block_size
        self.cached: set[int] = set(cached_hashes)  # on the device
        self.host: set[int] = set()  # only in the host tier

    def apply(self, changes: dict[int, int]) -> None:
        """Block hashes by the tier that now holds them (ON_DEVICE, ON_HOST or EVICTED; True and
        False read as ON_DEVICE and EVICTED), latest state per hash."""
        for block_hash, tier in changes.items():
            if tier == ON_DEVICE:
                self.cached.add(block_hash)
                self.host.discard(block_hash)
            elif tier == ON_HOST:
                self.cached.discard(block_hash)
                self.host.add(block_hash)
            else:
                self.cached.discard(block_hash)
                self.host.discard(block_hash)

    def num_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int) -> int:
        return num_cached_prefix_tokens(block_hashes, num_tokens, self.block_size, self.cached.__contains__)

    def num_host_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int, num_cached: int) -> int:
        """Tokens of the run of host-tier blocks right after a device hit of `num_cached` tokens
        (same cap as a device hit: the prompt's last token is always computed)."""
        if not self.host:
            return 0
        first = num_cached // self.block_size
        end = num_cached_prefix_tokens(block_hashes[first:], num_tokens - num_cached, self.block_size,
                                       self.host.__contains__)
        return end


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_sizes: Iterable[int]) -> dict[int, list[int]]:
    """The prompt's chained block hashes once per distinct block size among the backends."""
    return {bs: hash_request_blocks(prompt_token_ids, bs) for bs in set(block_sizes)}
