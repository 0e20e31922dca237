"""The small, picklable messages that cross the router's boundary.

`RouteRequest` is what the router needs to know about a new request (no token ids: only
counts, the reusable prefix each backend reports for it, and optionally the chained hashes of
the prompt's full blocks, which the `prefix-affinity` policy and the in-flight prefix
accounting use). `ProgressEvent` is what a
backend reports back. Progress values are absolute counts, never deltas, so a report that
arrives late, twice, or out of order cannot corrupt the ledger: the ledger keeps the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# ProgressEvent kinds.
ADMITTED = "admitted"  # queued -> active (the backend's scheduler took it)
PREFILL = "prefill"  # value = num_computed_tokens of the prompt so far, prefix-cache hits included
GENERATED = "generated"  # value = num_output_tokens so far
FINISHED = "finished"
ABORTED = "aborted"
EVICTED = "evicted"  # a queued request's prefix was evicted; value = reusable tokens left (0: none)

EVENT_KINDS = (ADMITTED, PREFILL, GENERATED, FINISHED, ABORTED, EVICTED)


@dataclass
class RouteRequest:
    """A request to place. `num_cached_tokens` maps backend_id -> reusable prefix tokens;
    a backend missing from the map is assumed to have no reusable prefix. `block_hashes` are
    the chained hashes of the prompt's full blocks of `block_size` tokens (the engine's
    prefix-cache hashes); without them the router neither homes the request by prefix nor
    counts it as in flight. `priority` is vLLM's (lower is more urgent, classes compared by
    value); `ttft_deadline_s`, if set, is the longest time to first token the caller accepts:
    the router places the request only where its projection meets it (routing/deadline.py).
    `arrival_s` is when it arrived on the router's clock (monotonic seconds); the ledger keeps
    it so that projections can tell which queued requests age past a starvation bound.
    `num_host_cached_tokens` maps backend_id -> the tokens right after that reusable prefix
    which the backend's host-memory KV tier holds (routing/cost_model.py, the host tier)."""

    req_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    block_hashes: tuple[int, ...] = ()
    block_size: int = 0
    priority: int = 0
    ttft_deadline_s: float | None = None
    arrival_s: float | None = None
    # backend_id -> tokens after its reusable prefix that its host-memory KV tier holds
    num_host_cached_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ttft_deadline_s is not None and not self.ttft_deadline_s > 0:
            raise ValueError(f"ttft_deadline_s must be > 0 (got {self.ttft_deadline_s})")
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0 (got {self.num_prompt_tokens})")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (got {self.max_tokens})")
        for name, counts in (("num_cached_tokens", self.num_cached_tokens),
                             ("num_host_cached_tokens", self.num_host_cached_tokens)):
            for backend_id, num_cached in counts.items():
                if num_cached < 0:
                    raise ValueError(f"{name}[{backend_id!r}] must be >= 0 (got {num_cached})")
        if self.block_hashes and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 when block_hashes are given (got {self.block_size})")
        if len(self.block_hashes) * self.block_size > self.num_prompt_tokens:
            raise ValueError(
                f"{len(self.block_hashes)} blocks of {self.block_size} tokens exceed the prompt "
                f"({self.num_prompt_tokens} tokens)"
            )

    def num_prefill_tokens_on(self, backend_id: str) -> int:
        """Prompt tokens `backend_id` would have to compute: prompt minus its reusable prefix."""
        num_cached = min(self.num_cached_tokens.get(backend_id, 0), self.num_prompt_tokens)
        return self.num_prompt_tokens - num_cached


@dataclass
class ProgressEvent:
    """One backend report about one request. See the kind constants above for `value`."""

    req_id: str
    kind: str
    value: int = 0

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown ProgressEvent kind {self.kind!r}; expected one of {EVENT_KINDS}")
        if self.value < 0:
            raise ValueError(f"ProgressEvent value must be >= 0 (got {self.value})")


class RunningProgress(NamedTuple):
    """A running request's report as one item: the "admitted", "prefill" (`num_computed_prompt_tokens`)
    and "generated" (`num_output_tokens`) events it stands for, applied at once (and counted as
    three). A busy backend resends every running request's absolute counts with each report."""

    req_id: str
    num_computed_prompt_tokens: int
    num_output_tokens: int
