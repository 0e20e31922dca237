"""Chained block hashes for prefix caching.

A full block's hash covers its own tokens and its parent's hash, so equal hashes mean equal
whole prefixes, not just equal blocks. Python's hash of a tuple of ints does not depend on
PYTHONHASHSEED, so the same prompt hashes the same in every process: a router can compare
hashes a backend reported without asking it again.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0x7A3D  # parent of the first block; any fixed value works


def hash_block_tokens(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(block_token_ids)))


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, existing: list[int] | None = None, num_tokens: int | None = None
) -> list[int]:
    """Hashes of every full block of the first `num_tokens` (default: all) of `token_ids`. With
    `existing` (hashes already known for the first blocks) that list is extended in place and
    returned, so a growing request only hashes its new blocks."""
    hashes = existing if existing is not None else []
    parent = hashes[-1] if hashes else ROOT_HASH
    end = len(token_ids) if num_tokens is None else num_tokens
    for start in range(len(hashes) * block_size, end - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
