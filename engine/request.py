"""A request's state inside one engine.

One rule drives progress: `num_computed_tokens` catches up with `num_tokens`. A prefix-cache
hit starts it above zero, chunked prefill advances it in steps, a decode step advances it by
one, and preemption by recompute resets it to zero (the outputs so far are kept and simply
become part of what must be recomputed).
"""

from __future__ import annotations

import enum
import time

from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.sampling_params import SamplingParams


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
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
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
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_computed_prompt_tokens(self) -> int:
        return min(self.num_computed_tokens, self.num_prompt_tokens)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of every full block of the tokens known so far (memoized)."""
        return hash_request_blocks(self.all_token_ids, block_size, self._block_hashes)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

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
