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
A backend with a host-memory KV tier reports each hash by the best tier that holds it; the
mirror keeps the two tiers apart and answers a prompt with its device hit and the host-tier run
after it, by routing/tier_mirror.py's rules, which route-sim's mirror follows too. What the
mirror cannot know yet, the prefixes of requests the router has just sent to a backend, the pure
router counts itself (routing/inflight.py) from the block hashes it is given.

A placement asks every backend's mirror, so the router also keeps the mirrors inverted
(`MirrorIndex`: block hash -> bitmask of the backends holding it, one map per tier) and answers
all backends from one walk over the prompt's blocks (`MirrorIndex.answers`). Each `CacheMirror`
keeps its own sets too: they are the reference its per-backend answers give, and what a backend
that leaves takes out of the index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.kv_cache.manager import num_cached_prefix_tokens
from tandem.routing.inflight import bits, clear_bit, leading_runs
from tandem.routing.tier_mirror import ON_DEVICE, ON_HOST, apply_tier_changes, host_run_tokens



class CacheMirror:
    def __init__(self, block_size: int, cached_hashes: Iterable[int] = (), index: MirrorIndex | None = None) -> None:
        self.block_size = block_size
        self.cached: set[int] = set(cached_hashes)  # on the device
        self.host: set[int] = set()  # only in the host tier
        self.index = index  # the router's inverted index this mirror is part of, if any
        self.bit = 0  # this mirror's bit there
        if index is not None:
            self.bit = index.join(self)

    def apply(self, changes: dict[int, int]) -> None:
        """Block hashes by the tier that now holds them (ON_DEVICE, ON_HOST or EVICTED; True and
        False read as ON_DEVICE and EVICTED), latest state per hash."""
        if self.index is not None:
            self.index.apply(self, changes)
        apply_tier_changes(self.cached, self.host, changes)

    def leave(self) -> None:
        """Take this mirror out of its index (its backend left routing)."""
        if self.index is not None:
            self.index.leave(self)
            self.index = None

    def num_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int) -> int:
        return num_cached_prefix_tokens(block_hashes, num_tokens, self.block_size, self.cached.__contains__)

    def num_host_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int, num_cached: int) -> int:
        """Tokens of the run of host-tier blocks right after a device hit of `num_cached` tokens."""
        return host_run_tokens(self.host, block_hashes, num_tokens, self.block_size, num_cached)


class MirrorIndex:
    """Every backend's mirror inverted: block hash -> bitmask of the mirrors holding it, one map
    for the device tier and one for the host tier. Mirrors get a bit when they join (a bit freed
    by a mirror that left is reused) and update the index as they apply their backend's reports."""

    def __init__(self) -> None:
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self._free: list[int] = []  # bit positions freed by mirrors that left
        self._next = 0

    def join(self, mirror: CacheMirror) -> int:
        position = self._free.pop() if self._free else self._next
        if position == self._next:
            self._next += 1
        bit = 1 << position
        for block_hash in mirror.cached:
            self.device[block_hash] = self.device.get(block_hash, 0) | bit
        for block_hash in mirror.host:
            self.host[block_hash] = self.host.get(block_hash, 0) | bit
        return bit

    def leave(self, mirror: CacheMirror) -> None:
        bit = mirror.bit
        for tier, hashes in ((self.device, mirror.cached), (self.host, mirror.host)):
            for block_hash in hashes:
                clear_bit(tier, block_hash, bit)
        self._free.append(bit.bit_length() - 1)

    def apply(self, mirror: CacheMirror, changes: dict[int, int]) -> None:
        """`mirror`'s changes (as `CacheMirror.apply`), before the mirror applies them to its sets."""
        bit, device, host = mirror.bit, self.device, self.host
        for block_hash, tier in changes.items():
            on_device, on_host = tier == ON_DEVICE, tier == ON_HOST
            if on_device != (block_hash in mirror.cached):
                if on_device:
                    device[block_hash] = device.get(block_hash, 0) | bit
                else:
                    clear_bit(device, block_hash, bit)
            if on_host != (block_hash in mirror.host):
                if on_host:
                    host[block_hash] = host.get(block_hash, 0) | bit
                else:
                    clear_bit(host, block_hash, bit)

    def answers(self, block_hashes: Sequence[int], num_tokens: int, block_size: int,
                candidates: int) -> tuple[dict[int, int], dict[int, int]]:
        """For the mirrors in the bitmask `candidates` (all of block size `block_size`), what
        `CacheMirror.num_cached_tokens` and `num_host_cached_tokens` answer, as {bit position:
        tokens} for the nonzero answers only."""
        if block_size < 1:
            return {}, {}
        max_blocks = (num_tokens - 1) // block_size
        runs = leading_runs(self.device, block_hashes, 0, max_blocks, candidates)
        device_hits: dict[int, int] = {}
        for holders, num_blocks in runs:
            for position in bits(holders):
                device_hits[position] = num_blocks * block_size
        host_hits: dict[int, int] = {}
        if self.host:
            # A host run starts where the device run stopped: one walk per distinct device hit.
            missed = candidates
            for holders, _ in runs:
                missed &= ~holders
            for holders, start in ((missed, 0), *((h, n) for h, n in runs)):
                for host_holders, num_blocks in leading_runs(self.host, block_hashes, start, max_blocks, holders):
                    for position in bits(host_holders):
                        host_hits[position] = num_blocks * block_size
        return device_hits, host_hits


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_sizes: Iterable[int]) -> dict[int, list[int]]:
    """The prompt's chained block hashes once per distinct block size among the backends."""
    return {bs: hash_request_blocks(prompt_token_ids, bs) for bs in set(block_sizes)}
