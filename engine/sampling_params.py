"""Per-request sampling and stopping settings, and their one check.

`validate` is the one check of the settings, called where a request enters: the HTTP ingress
and the Python driver before a request is routed (the edge), and `LLMEngine.add_request` for
a caller of the engine itself (the engine core is one), so every entry point rejects the same
bad input with the same message. Building a SamplingParams checks nothing, so the serving
path's codec (actors/messages.py) rebuilds one in each process it crosses without checking it
again on the way. Ranges
are OpenAI's where OpenAI has the field (penalties in [-2, 2], logit bias in [-100, 100] for
at most 300 tokens, up to 20 top logprobs) and vLLM's for its extras (`repetition_penalty` > 0,
1 is off; `min_p` in [0, 1]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.engine.errors import InvalidRequestError  # re-exported: callers import it from here too
# At run time, not only for type checkers: the front's codec (actors/messages.py) reads these
# annotations to decode a SamplingParams.
from tandem.engine.structured_output import StructuredOutputParams

# The request contract's limits, defined here once: the HTTP schema (cluster/protocol.py) uses
# the same ones, so the edge and a direct Python caller are refused alike.
MAX_LOGPROBS = 20  # top logprobs per token, OpenAI's limit
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
MAX_N = 16  # choices per request (parallel sampling)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # choices sampled from one prompt (parallel sampling)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top logprobs per sampled token; None: no logprobs at all
    structured_output: StructuredOutputParams | None = None  # a grammar the output must follow
    # vLLM's priority: lower is more urgent, 0 by default; any int, classes compared by value.
    # The scheduler admits waiting requests in (priority, arrival) order (engine/scheduler.py).
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens > 0,
             f"max_tokens must be a positive integer, got {self.max_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature!r}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= -1,
             f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n!r}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (0.0 < self.repetition_penalty < math.inf,
             f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty!r}"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"),
            (all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
             "logit_bias must map token ids to biases in [-100, 100]"),
            (isinstance(self.priority, int) and not isinstance(self.priority, bool),
             f"priority must be an integer (lower is more urgent), got {self.priority!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
