"""What only the engine can check about a request, and the state an admitted request gets.

The sampling settings are the request contract's, checked once by the edge that built the
request (engine/sampling_params.py says where), not again here. What no edge can know is this
engine's: an empty prompt, token ids outside its vocabulary, a prompt over its context, a
request larger than its whole KV cache, a grammar that does not compile for its tokenizer, and
what a sim device cannot emulate. `check` and `new_request` refuse such a request with an
`InvalidRequestError` naming the problem before any of it reaches the scheduler, so nothing
bad ever reaches the step loop.

An admitted request gets its engine-side state here (output processing's `TrackedRequest`):
its incremental detokenizer with its stop strings, and its sampling row with its seeded
generator and its grammar matcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.kv_cache.manager import cdiv
from tandem.engine.output_processor import TrackedRequest
from tandem.engine.request import Request
from tandem.engine.sampler import SamplingRow
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.sim_runner import SimModelRunner
from tandem.engine.structured_output import GrammarCompiler, RequestGrammar


@dataclass(frozen=True)
class RequestLimits:
    """What bounds a request on this engine: its vocabulary, its context and its whole KV cache."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_usable_blocks: int


class Admission:
    def __init__(self, limits: RequestLimits, tokenizer: Any, eos_token_ids: tuple[int, ...],
                 grammar_compiler: GrammarCompiler, device: torch.device, is_sim: bool,
                 tracked: dict[str, TrackedRequest]) -> None:
        self.limits = limits
        self.tokenizer = tokenizer  # the engine's (`LLMEngine.tokenizer`): its detokenizers read it
        self.eos_token_ids = eos_token_ids
        self.grammar_compiler = grammar_compiler
        self.device = device
        self.is_sim = is_sim
        self.tracked = tracked  # output processing's, which drops each entry when its request ends

    def check(self, token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request this engine cannot serve (module doc); the grammar is checked as it
        compiles, in `new_request`."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        limits = self.limits
        vocab = limits.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # C loops: a genexpr cost ~0.2 ms per 1k tokens
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > limits.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{total} tokens, over this model's context length of {limits.max_model_len}")
        num_blocks = cdiv(total, limits.block_size)
        if num_blocks > limits.num_usable_blocks:
            raise InvalidRequestError(
                f"the request needs {num_blocks} KV blocks but the whole cache has "
                f"{limits.num_usable_blocks}; lower max_tokens or the prompt")
        if self.is_sim:
            SimModelRunner.check_request(params.logprobs, params.structured_output is not None)

    def new_request(self, req_id: str, token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None) -> Request:
        """A request and its engine-side state (in `tracked`), not yet in the scheduler."""
        grammar = self._make_grammar(params)
        request = Request(req_id, token_ids, params, self.eos_token_ids, arrival_time)
        self.tracked[req_id] = TrackedRequest(
            IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            SamplingRow(params, self._make_generator(params.seed), grammar=grammar,
                        prompt_token_ids=token_ids if params.repetition_penalty != 1.0 else [], req_id=req_id),
        )
        return request

    def _make_grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """The request's grammar matcher; compile errors are the request's fault (a 400)."""
        if params.structured_output is None:
            return None
        return self.grammar_compiler.make_grammar(params.structured_output)

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)
