"""Per-request sampling and stopping settings, the request contract's bounds, and their check.

`BOUNDS` states every bound of a request field once: what the HTTP schema (cluster/protocol.py)
builds its field types from, and what `SamplingParams.validate` checks. A request is checked
once, by the edge that builds its engine request: the HTTP ingress parses the body against the
schema (each field within its bound, so a 400 names the field before any tokenizing) and then
checks only the rules between fields (`validate_relations`); a Python caller that builds its
own SamplingParams (the driver, cluster/launcher.py, and `tandem generate`, engine/cli.py)
calls `validate`, which checks both. The engine checks only what only it knows: the
vocabulary, the context length and the KV cache's capacity (engine/admission.py). Building a
SamplingParams checks nothing, so the serving path's codec (actors/messages.py) rebuilds one in
each process it crosses without checking it again on the way.

The ranges are OpenAI's where OpenAI has the field and vLLM's for its extras; counts and
token ids stop at the largest int32 because they end up in int32 tensors, and a seed takes
the whole range of `torch.Generator.manual_seed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tandem.engine.errors import InvalidRequestError  # re-exported: callers import it from here too
# At run time, not only for type checkers: the front's codec (actors/messages.py) reads these
# annotations to decode a SamplingParams.
from tandem.engine.structured_output import StructuredOutputParams

MAX_INT32 = 2**31 - 1


@dataclass(frozen=True)
class Bound:
    """What one field may hold: a value of `kind` (int, float or str) within [low, high], either
    end open where `low_open` / `high_open`, unbounded where None; a str's bound is on its length.
    With `max_items`, the field is a list of at most that many such values or, with `keys` too, a
    dict of at most that many, its keys within `keys` and its values within this bound."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    max_items: int | None = None
    keys: Bound | None = None

    def admits(self, value: Any) -> bool:
        """Whether one value (not a list) is of this kind and within the bound."""
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else self.kind):
            return False
        if self.kind is str:
            value = len(value)
        elif self.kind is float and not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, value: Any) -> str | None:
        """What is wrong with a field's value, as the end of a message that starts with its name;
        None when it is within the bound."""
        if self.max_items is None:
            return None if self.admits(value) else f"must be {self}, got {_short(value)}"
        container = dict if self.keys is not None else list
        if not isinstance(value, container):
            return f"must be a {'JSON object' if container is dict else 'list'}, got {type(value).__name__}"
        if len(value) > self.max_items:
            return f"may hold at most {self.max_items} entries, got {len(value)}"
        if self.keys is not None:
            bad_keys = [key for key in value if not self.keys.admits(key)][:1]
            if bad_keys:
                return f"keys must be {self.keys}, got {_short(bad_keys[0])}"
        items = value.values() if container is dict else value
        bad = [item for item in items if not self.admits(item)][:1]
        if not bad:
            return None
        return f"{'values' if container is dict else 'entries'} must be {self}, got {_short(bad[0])}"

    def __str__(self) -> str:
        if self.kind is str:
            if (self.low, self.high) == (1, None):
                return "a non-empty string"
            return f"a string of length {self._interval()}"
        return f"{'an integer' if self.kind is int else 'a number'} {self._interval()}"

    def _interval(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                    f"{_number(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return "of any size"


def _short(value: Any) -> str:
    """A caller's value quoted back, short enough for an error message."""
    text = repr(value)
    return text if len(text) <= 64 else text[:64] + "..."


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


TOKEN_ID = Bound(int, 0, MAX_INT32)

# The request contract's bounds, each stated once, by field name (SamplingParams' names; the
# HTTP schema's where it spells a field differently says so there). A field whose default is
# None (seed, logprobs) may also be None: off.
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(int, 1, MAX_INT32),
    "min_tokens": Bound(int, 0, MAX_INT32),
    "temperature": Bound(float, 0.0, 2.0),
    "top_p": Bound(float, 0.0, 1.0, low_open=True),
    "top_k": Bound(int, -1, MAX_INT32),  # 0 or -1: off
    "min_p": Bound(float, 0.0, 1.0),  # 0: off
    "seed": Bound(int, 0, 2**64 - 1),
    "n": Bound(int, 1, 16),  # choices sampled from one prompt
    "presence_penalty": Bound(float, -2.0, 2.0),
    "frequency_penalty": Bound(float, -2.0, 2.0),
    "repetition_penalty": Bound(float, 0.0, 100.0, low_open=True),  # 1: off
    "logit_bias": Bound(float, -100.0, 100.0, max_items=300, keys=TOKEN_ID),
    "logprobs": Bound(int, 0, 20),  # top logprobs per sampled token
    "priority": Bound(int, -MAX_INT32, MAX_INT32),
    "stop": Bound(str, 1, max_items=16),
    "stop_token_ids": replace(TOKEN_ID, max_items=16),
    # Request fields beside the sampling settings: a prompt's token ids, and Tandem's TTFT
    # deadline (a day at most), which the router reads (routing/deadline.py).
    "prompt_token_ids": TOKEN_ID,
    "ttft_deadline_ms": Bound(float, 0.0, 86_400_000.0, low_open=True),
}


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
    # vLLM's priority: lower is more urgent, 0 by default; classes compared by value.
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
        """The whole contract, for a caller that built these settings itself: each field within
        its bound in `BOUNDS`, then the rules between fields. `InvalidRequestError` names the field."""
        for name in _BOUNDED_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            problem = BOUNDS[name].problem(value)
            if problem is not None:
                raise InvalidRequestError(f"{name} {problem}", param=name)
        self.validate_relations()

    def validate_relations(self) -> None:
        """The rules between fields, which no one field's bound can state: all that is left to
        check once a parser has held each field to its bound (the HTTP schema does)."""
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                      f"({self.max_tokens})", param="min_tokens")
        if self.min_tokens and self.structured_output is not None:
            raise InvalidRequestError("min_tokens cannot be combined with structured output (the grammar "
                                      "decides where the output ends)", param="min_tokens")


_BOUNDED_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name in BOUNDS)
_OPTIONAL_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.default is None)
