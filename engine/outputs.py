"""What the engine streams back: one `RequestOutput` per request per step that produced tokens.

Outputs carry deltas (new token ids and new text since the last output) so a caller can
stream without diffing, plus the running usage so the final output alone is enough for a
non-streaming response.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    usage: Usage
    # Wall-clock timestamps (time.time()) so callers can compute queue time, TTFT and E2E.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output and a later one of the same request as a single delta: a consumer that
        fell behind gets one message where it would have had several."""
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text)


@dataclass
class RequestProgress:
    """One request's state as the router's ledger needs it (sent in batches, absolute counts)."""

    req_id: str
    status: str  # "waiting" | "running" | "preempted" | "finished"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # fraction of blocks in use by requests
    prefix_cache_queries: int  # prompt tokens looked up since start
    prefix_cache_hits: int  # prompt tokens that hit since start
    num_preemptions: int
    # Last step.
    step_time_s: float = 0.0
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    # Totals since start, split by phase: steps with any prefill count as prefill time.
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    requests: list[RequestProgress] = field(default_factory=list)
