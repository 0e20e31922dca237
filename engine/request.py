"""A request's state inside one engine.

One rule drives progress: `num_computed_tokens` catches up with `num_tokens`. A prefix-cache
hit starts it above zero, chunked prefill advances it in steps, a decode step advances it by
one, and preemption by recompute resets it to zero (the outputs so far are kept and simply
become part of what must be recomputed).

With asynchronous scheduling the engine plans step N+1 before step N's sampled token reaches
the host, so a request's next token is first a placeholder (`PLACEHOLDER_TOKEN`): it counts
towards `num_tokens` and `num_output_tokens`, which is all the scheduler reads, while the runner
takes the real id from the device and the engine fills it in when the copy lands. At most one
placeholder is pending, always the last token. Block hashes never cover a placeholder.
"""

from __future__ import annotations

import enum
import time

from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = -1  # a sampled token not yet copied to the host; never a model input


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # Plain member attributes, not properties: every request asks every step.
        self.is_finished = value.startswith("finished")
        self.finish_reason = {"finished_stopped": "stop", "finished_length": "length",
                              "finished_aborted": "abort"}.get(value)


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        # Ids that end the request once min_tokens are out (EOS unless ignored, stop ids).
        self.stop_token_set = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else self.eos_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (both KV tiers); -1 until then
        self.num_host_cached_tokens = 0  # the part of that hit reloaded from the host KV tier
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_pending_tokens = 0  # trailing placeholders (0 or 1)
        self._block_hashes: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_resolved_output_tokens(self) -> int:
        """Output tokens whose ids are known on the host."""
        return len(self.output_token_ids) - self.num_pending_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_computed_prompt_tokens(self) -> int:
        return min(self.num_computed_tokens, self.num_prompt_tokens)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of every full block of the tokens known so far (memoized)."""
        return hash_request_blocks(self.all_token_ids, block_size, self._block_hashes,
                                   len(self.all_token_ids) - self.num_pending_tokens)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_placeholder(self) -> int:
        """Count a token being sampled on the device; returns its index in output_token_ids."""
        self.output_token_ids.append(PLACEHOLDER_TOKEN)
        self.all_token_ids.append(PLACEHOLDER_TOKEN)
        self.num_pending_tokens += 1
        return len(self.output_token_ids) - 1

    def resolve_placeholder(self, index: int, token_id: int) -> None:
        """The sampled id of output `index` has reached the host."""
        self.output_token_ids[index] = token_id
        self.all_token_ids[self.num_prompt_tokens + index] = token_id
        self.num_pending_tokens -= 1

    def truncate_outputs(self, num_outputs: int) -> None:
        """Drop outputs past the first `num_outputs` (placeholders sampled after a stop)."""
        num_dropped = len(self.output_token_ids) - num_outputs
        if num_dropped > 0:
            del self.output_token_ids[num_outputs:]
            del self.all_token_ids[len(self.all_token_ids) - num_dropped:]
            self.num_pending_tokens = max(0, self.num_pending_tokens - num_dropped)

    def stop_status(self, token_id: int, num_outputs: int) -> RequestStatus | None:
        """Token-level stop for output number `num_outputs` (1-based) being `token_id`:
        max_tokens first, then EOS and stop token ids (not before min_tokens)."""
        params = self.sampling_params
        if num_outputs >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if num_outputs < params.min_tokens:
            return None
        if (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None

    def check_stop(self) -> RequestStatus | None:
        """Stop on token-level conditions (EOS, stop token ids, max_tokens). Stop strings need
        text and are checked by the engine after detokenization."""
        params = self.sampling_params
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_output_tokens <= params.min_tokens - 1 or not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None
