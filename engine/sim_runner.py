"""The `sim` device's model runner: the forward pass replaced by the time it takes on a real device.

Everything else of the engine runs for real: the scheduler, the paged KV cache's block pool and
prefix cache, chunked prefill, preemption, stop handling and the detokenizer. Only the model is
gone: a step "runs" for what the device's profile says a step of its shape takes, and samples
pseudo-random token ids. That makes an engine that behaves, to everything around it (the
backend actor, the router, the HTTP server, a client), like one on the profiled device, at the
cost of the host's bookkeeping alone, so 16 to 64 of them fit on one small machine
(NVIDIA Dynamo's Mocker and llm-d's simulator emulate engines for the same reason; both
reimplement the scheduler and cache, which this keeps).

Timing. `step_time(num_prefill_tokens, num_decode_seqs, num_context_tokens)` (the caller's timing
model: routing/step_time.py, the same one route-sim uses) gives a step's duration. The emulated
device runs one step at a time: a step launched while the previous one still "runs" starts when
that one ends, and its sampled ids are ready `step_time` after its start. `StepHandle.tokens`
sleeps until then. So the host's own work (scheduling, detokenizing, sending outputs) overlaps
a step as it does beside a GPU with asynchronous scheduling, and a host too slow to keep up shows
as steps that start late, as it would on the device.

Host KV tier. With one (engine/kv_cache/host_tier.py) a step's reloads add `reload_time(reloaded
tokens)` to its duration (the profile's host-to-device rate: routing/step_time.py); offloads
cost nothing, as a device's copies out overlap its compute. Without a reload rate a sim engine
runs without a host tier.

Tokens. Each sampled id is a hash of the request's seed (its `seed`, else its prompt) and the
output position, drawn from the tokenizer's ordinary ids (never EOS or another special id), so
a request's output is the same on every run and every backend, its length is its `max_tokens`
unless a stop string matches, and it goes through the real detokenizer. Sampling settings other
than that are not emulated; logprobs and structured outputs are refused when the request is
added (`check_request`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.config import DEFAULT_BLOCK_SIZE
from tandem.engine.errors import InvalidRequestError
from tandem.engine.kv_cache.host_tier import KVTransfers
from tandem.engine.scheduler import SchedulerOutput

SIM_DEVICE = "sim"
_MASK64 = (1 << 64) - 1

StepTime = Callable[[int, int, int], float]
ReloadTime = Callable[[int], float]  # seconds to reload this many tokens from the host KV tier


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(seed: int | None, prompt_token_ids: Sequence[int]) -> int:
    """The base of a request's pseudo-random ids: its seed, else a hash of its prompt (so equal
    prompts give equal outputs, as greedy decoding would)."""
    if seed is not None:
        return _mix64(seed)
    return _mix64(hash(tuple(prompt_token_ids)) & _MASK64)


@dataclass
class TokenSpace:
    """The ids a sim step may sample: [0, vocab_size) without the special ones."""

    vocab_size: int
    excluded: frozenset[int]

    def token(self, base: int, position: int) -> int:
        x = base ^ (position * 0x9E3779B97F4A7C15 & _MASK64)
        while True:
            x = _mix64(x)
            token = x % self.vocab_size
            if token not in self.excluded:
                return token


def sim_token_space(loaded: Any) -> TokenSpace:
    """The ids a model's tokenizer can decode, less its special ones (a `LoadedModel`)."""
    vocab_size = loaded.sampling_vocab_size or loaded.model_config.vocab_size
    special = set(getattr(loaded.tokenizer, "all_special_ids", ()) or ())
    return TokenSpace(vocab_size, frozenset({*special, *loaded.model_config.eos_token_ids}))


@dataclass
class _Sampler:
    """What the engine reads of a runner's sampler: rows that failed on their own (never, here)
    and the tests' fault hook (not called: nothing is sampled)."""

    failures: list = field(default_factory=list)
    fault_injector: Callable[[str, str | None], None] | None = None


class SimStepHandle:
    """A sim step's ids, ready at `ready_at` (time.perf_counter)."""

    def __init__(self, token_ids: list[int], ready_at: float) -> None:
        self._token_ids = token_ids
        self.ready_at = ready_at

    def tokens(self) -> list[int]:
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self._token_ids

    def logprobs(self) -> dict[int, tuple]:
        return {}


class SimModelRunner:
    def __init__(self, step_time: StepTime, tokens: TokenSpace, reload_time: ReloadTime | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_host_blocks: int = 0) -> None:
        self.step_time = step_time
        self.reload_time = reload_time
        self.num_host_blocks = num_host_blocks if reload_time is not None else 0  # the emulated host tier
        self.block_size = block_size
        self.token_space = tokens
        self.sampler = _Sampler()
        self.device_free_at = 0.0  # perf_counter() when the emulated device finishes its last step
        self._seed_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> its base

    @staticmethod
    def check_request(logprobs: int | None, has_grammar: bool) -> None:
        if logprobs is not None:
            raise InvalidRequestError("logprobs are not emulated on a sim device (it samples no distribution)")
        if has_grammar:
            raise InvalidRequestError("structured outputs are not emulated on a sim device (its tokens are "
                                      "pseudo-random)")

    def launch(self, sched: SchedulerOutput, kv_manager: object, rows: dict) -> SimStepHandle:
        """The step's ids, ready once the emulated device has run it after the steps before."""
        start = max(time.perf_counter(), self.device_free_at)
        self.device_free_at = start + self.step_time(*step_shape(sched)) + self._reload_s(sched.kv_transfers)
        space = self.token_space
        token_ids = []
        for s in sched.scheduled:
            if not s.completes_prefill:
                continue
            request = s.request
            base = self._seed_of.get(request)
            if base is None:
                base = self._seed_of[request] = request_seed(request.sampling_params.seed, request.prompt_token_ids)
            token_ids.append(space.token(base, request.num_output_tokens))
        return SimStepHandle(token_ids, self.device_free_at)

    def apply_kv_transfers(self, transfers: KVTransfers | None) -> None:
        """Copies between the KV tiers alone (a step whose requests all left it): they keep the
        emulated device busy for their reloads."""
        reload_s = self._reload_s(transfers)
        if reload_s:
            self.device_free_at = max(time.perf_counter(), self.device_free_at) + reload_s

    def _reload_s(self, transfers: KVTransfers | None) -> float:
        if transfers is None or not transfers.reloads or self.reload_time is None:
            return 0.0
        return self.reload_time(len(transfers.reloads) * self.block_size)


def step_shape(sched: SchedulerOutput) -> tuple[int, int, int]:
    """(prefill tokens, decoding sequences, their context tokens) of a scheduled step, before it
    runs: a decoding sequence attends to every token computed so far and the one it feeds."""
    num_decode = num_context = 0
    num_prefill = 0
    for s in sched.scheduled:
        request = s.request
        if s.num_scheduled_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens:
            num_decode += 1
            num_context += request.num_computed_tokens + 1
        else:
            num_prefill += s.num_scheduled_tokens
    return num_prefill, num_decode, num_context
