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
What the mirror cannot know yet, the prefixes of requests the router has just sent to a
backend, the pure router counts itself (routing/inflight.py) from the block hashes it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.kv_cache.manager import num_cached_prefix_tokens


class CacheMirror:
    def __init__(self, block_size: int, cached_hashes: Iterable[int] = ()) -> None:
        self.block_size = block_size
        self.cached: set[int] = set(cached_hashes)

    def apply(self, changes: dict[int, bool]) -> None:
        """Published (True) or evicted (False) block hashes, latest state per hash."""
        for block_hash, is_cached in changes.items():
            if is_cached:
                self.cached.add(block_hash)
            else:
                self.cached.discard(block_hash)

    def num_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int) -> int:
        return num_cached_prefix_tokens(block_hashes, num_tokens, self.block_size, self.cached.__contains__)


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_sizes: Iterable[int]) -> dict[int, list[int]]:
    """The prompt's chained block hashes once per distinct block size among the backends."""
    return {bs: hash_request_blocks(prompt_token_ids, bs) for bs in set(block_sizes)}
