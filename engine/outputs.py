"""What the engine streams back: one `RequestOutput` per request per step that produced tokens.

Outputs carry deltas (new token ids and new text since the last output) so a caller can
stream without diffing, plus the running usage so the final output alone is enough for a
non-streaming response.

A request with `n` > 1 streams the outputs of its n choices under its one `req_id`, each
output carrying its choice's `index`. `finish_reason` is set on the last output of a choice;
`finished` on the last output of the request (all its choices done), so every consumer that
waits for `finished` waits for the whole request. The usage is the request's: its prompt once,
the completion tokens of all its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Usage(msgspec.Struct, array_like=True, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache supplied, from either KV tier
    host_cached_tokens: int = 0  # the part of cached_tokens reloaded from the host KV tier

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# One sampled token's logprobs: (its logprob, top token ids, their logprobs), most likely first.
TokenLogprobs = tuple[float, list[int], list[float]]


class RequestOutput(msgspec.Struct, array_like=True, gc=False, tag="out"):
    """One request's news from one step. A msgspec struct, as `RequestProgress`: the engine core
    sends a step's outputs to their callers as they are, one frame per caller, positional on the
    wire (actors/messages.py), with no conversion on either side."""

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
    index: int = 0  # the choice (parallel sampling, n > 1)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output and a later one of the same choice as a single delta: a consumer that
        fell behind gets one message where it would have had several."""
        if later.index != self.index:
            raise ValueError(f"cannot merge outputs of choices {self.index} and {later.index}")
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = later.logprobs if logprobs is None else logprobs + later.logprobs
        return msgspec.structs.replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                                       new_text=self.new_text + later.new_text, logprobs=logprobs)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Consecutive outputs of one request as one delta per choice, in the order of each
    choice's latest output (so the request's `finished` output stays last)."""
    if len(outputs) == 1:
        return outputs
    by_index: dict[int, RequestOutput] = {}
    for out in outputs:
        earlier = by_index.pop(out.index, None)
        by_index[out.index] = out if earlier is None else earlier.merge(out)
    return list(by_index.values())


class RequestProgress(msgspec.Struct, array_like=True, gc=False):
    """One request's state as the router's ledger needs it (sent in batches, absolute counts).
    A msgspec struct, not a dataclass, because a step's message carries one per running request
    to the backend front (actors/messages.py): positional, it encodes without its field names."""

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
    prefix_cache_hits: int  # prompt tokens that hit since start, in either KV tier
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
    # Of those steps' time, the part the step loop spent waiting for the device's sampled ids
    # (the rest is host work: scheduling, launching, outputs); on a sim device, its emulated time.
    device_wait_time_s: float = 0.0
    num_steps: int = 0  # steps whose sampled ids landed, since start
    # The host KV tier (engine/kv_cache/host_tier.py); all 0 without one.
    prefix_cache_host_hits: int = 0  # prompt tokens that hit in the host tier since start
    kv_host_offloaded_blocks: int = 0  # blocks copied device -> host since start
    kv_host_reloaded_blocks: int = 0  # blocks copied host -> device since start
    num_host_used_blocks: int = 0
    num_host_total_blocks: int = 0
    kv_block_bytes: int = 0  # KV bytes of one block (all layers, K and V): what one copy moves
    requests: list[RequestProgress] = field(default_factory=list)
