"""Prefixes in flight: what the router has sent to a backend counts as (soon) cached there.

A backend reports the block hashes it published only after the step that scheduled their
prefill, and the router's mirror of its prefix cache learns them from that report. A request
routed before then, with the same prefix, saw no hit anywhere, so a burst of one tenant's
requests would spray over every backend, each paying the whole prefill. The router therefore
remembers the prompt blocks of every request it holds on a backend (queued or running) and
treats them as cached there: a queued request's blocks will be published when its prefill is
scheduled, before any later request behind it on that backend is, and a running request's
blocks are pinned in the cache until it finishes. The marks expire with the request (finished,
aborted, forgotten, or its backend removed); by then the backend has reported the blocks and the
mirror holds them for as long as they really stay cached.

Lookups follow the engine's rule: the longest run of leading blocks, capped so the prompt's last
token is always computed. Blocks are reference-counted, since requests share prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def num_cached_prefix_tokens(
    block_hashes: Sequence[int], num_tokens: int, block_size: int, is_cached: Callable[[int], bool]
) -> int:
    """Tokens covered by the longest run of cached leading blocks, capped at `num_tokens - 1`
    (the last token's logits are what the next token is sampled from). The engine applies the
    same rule to its own cache; routing cannot import the engine, hence this copy."""
    if block_size < 1:
        return 0
    max_blocks = (num_tokens - 1) // block_size
    num_hits = 0
    for block_hash in block_hashes[:max_blocks]:
        if not is_cached(block_hash):
            break
        num_hits += 1
    return num_hits * block_size


class InflightPrefixes:
    """The prompt blocks of the requests one backend holds, reference-counted. With an `index`
    (block hash -> bitmask, shared by the router's backends) it also keeps its `bit` set there
    for every block it holds, so the router answers all backends from one walk (`leading_runs`)."""

    def __init__(self, index: dict[int, int] | None = None, bit: int = 0) -> None:
        self.req_to_hashes: dict[str, Sequence[int]] = {}
        self.hash_to_count: dict[int, int] = {}
        self.index = index
        self.bit = bit

    def __len__(self) -> int:
        return len(self.req_to_hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.hash_to_count

    def add(self, req_id: str, block_hashes: Sequence[int]) -> None:
        if req_id in self.req_to_hashes:
            raise ValueError(f"request {req_id!r} is already in flight to this backend")
        if not block_hashes:
            return
        self.req_to_hashes[req_id] = block_hashes
        counts, index, bit = self.hash_to_count, self.index, self.bit
        for block_hash in block_hashes:
            count = counts.get(block_hash, 0)
            counts[block_hash] = count + 1
            if not count and index is not None:
                index[block_hash] = index.get(block_hash, 0) | bit

    def remove(self, req_id: str) -> bool:
        block_hashes = self.req_to_hashes.pop(req_id, None)
        if block_hashes is None:
            return False
        counts, index = self.hash_to_count, self.index
        for block_hash in block_hashes:
            count = counts[block_hash] - 1
            if count:
                counts[block_hash] = count
            else:
                del counts[block_hash]
                if index is not None:
                    clear_bit(index, block_hash, self.bit)
        return True

    def leave_index(self) -> None:
        """Take this backend's blocks out of the shared index (the backend left routing)."""
        if self.index is not None:
            for block_hash in self.hash_to_count:
                clear_bit(self.index, block_hash, self.bit)
            self.index = None

    def num_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int, block_size: int) -> int:
        """Prefix tokens of a new prompt that requests in flight here will have cached."""
        if not self.hash_to_count:
            return 0
        return num_cached_prefix_tokens(block_hashes, num_tokens, block_size, self.__contains__)


def clear_bit(index: dict[int, int], block_hash: int, bit: int) -> None:
    """Take the holder `bit` out of an inverted index's entry for `block_hash` (the entry goes
    when no holder is left)."""
    mask = index.get(block_hash, 0) & ~bit
    if mask:
        index[block_hash] = mask
    else:
        index.pop(block_hash, None)


def leading_runs(index: dict[int, int], block_hashes: Sequence[int], start: int, max_blocks: int,
                 candidates: int) -> list[tuple[int, int]]:
    """`num_cached_prefix_tokens` for many holders at once, from an inverted index (block hash ->
    bitmask of the holders that have it): for the holders in the bitmask `candidates`, the run of
    blocks each holds from block `start` on, stopping before block `max_blocks`. Returns
    `(holders, num_blocks)` pairs, one per run length > 0 (a holder in no pair has a run of 0).
    One walk over the prompt's blocks with bit operations, instead of one walk per holder."""
    runs: list[tuple[int, int]] = []
    alive = candidates
    get = index.get
    end = min(max_blocks, len(block_hashes))
    i = start
    while i < end and alive:
        held = alive & get(block_hashes[i], 0)
        if held != alive:
            if i > start:
                runs.append((alive & ~held, i - start))
            alive = held
        i += 1
    if alive and i > start:
        runs.append((alive, i - start))
    return runs


def bits(mask: int):
    """The positions of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
