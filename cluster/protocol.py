"""The OpenAI-compatible HTTP protocol: the request body's JSON, and pydantic models.

Requests are validated here, field by field, so a bad request is answered with a 400 that
names the field (OpenAI's error shape) before it costs a tokenizer call or a routing decision.
Numeric fields are strict about types (`"max_tokens": "5"` is an error, as at OpenAI) but
accept an int where a float is expected, and every one has a range: nothing a client sends
reaches the engine's tensors or `torch.Generator.manual_seed` (which takes [0, 2**64 - 1])
as a value they cannot hold. The ranges and the defaults are not stated here: each field's
bound is its entry in engine/sampling_params.py's `BOUNDS` and its default SamplingParams' own,
so the HTTP edge and a Python caller are held to the same contract. Parsing a body checks each
field against its bound, once; the ingress then checks only the rules between fields
(`SamplingParams.validate_relations`), and the engine only what it alone knows.

Nothing a client sends is silently ignored. Every top-level field is one of: implemented (a
declared field below); accepted and harmless (`HARMLESS_FIELDS`: labels such as `user` or
`metadata` that change nothing about the completion); known but not implemented
(`UNSUPPORTED_FIELDS`: a 400 that names the field, unless the value is the one that asks for
nothing, such as `echo: false` or `service_tier: "auto"`); or unknown, which is refused the
same way (a field a client expects to matter must not be dropped on the floor). An explicit
`null` is the same as leaving a field out, as OpenAI's schema allows for every optional field.

The body is parsed by `parse_json_object`, not by pydantic or a bare `json.loads`, because
the standard parser's failure modes on hostile input are not 400s: nesting 50,000 deep raises
`RecursionError`, a 5,000-digit integer `ValueError`, `NaN` and `Infinity` parse as floats,
and `"\\ud800"` becomes a string no tokenizer can encode. Each is bounded or refused here.

Tandem's extras: `ignore_eos`, `min_tokens`, `top_k` and `seed` on requests (the sampling
settings the engine supports beyond OpenAI's), vLLM's `priority` and Tandem's
`ttft_deadline_ms`, `usage.prompt_tokens_details.cached_tokens`, and a `tandem` object on
responses and chunks naming the backend that served the request and the TTFT the router
projected for it there.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_serializer,
                      model_validator)

from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import BOUNDS, SamplingParams
from tandem.cluster.tools import (
    MAX_TOOLS,
    DeltaToolCall,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolDefinition,
    template_message,
)

MAX_JSON_DEPTH = 32  # the deepest valid request is 4 (body, messages, message, content part)
MAX_NUMBER_DIGITS = 64  # 2**64 - 1 is 20 digits
MAX_SEED = BOUNDS["seed"].high

# JSON strings, matched whole (the unrolled loop: linear in the input whatever it holds), so
# what is left is the document's structure and numbers.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_LONG_NUMBER = re.compile(f"[0-9]{{{MAX_NUMBER_DIGITS + 1},}}")
# Above this many characters of structure a long number is looked for with numpy: the regex
# tries a match at every digit, which a prompt of token ids is mostly made of.
_NUMPY_DIGIT_SCAN_CHARS = 512
# Only a \uD800-\uDFFF escape can put a surrogate into a parsed string (the UTF-8 decoder
# refuses encoded ones), so without one the strings need no walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)


class _BadNumber(ValueError):
    pass


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or `InvalidRequestError` saying what is wrong with it.

    Checks that would cost a Python call per token of a 4 MB body run in C or numpy instead:
    the ingress's event loop serves everyone while it parses."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    _check_structure(text)
    try:
        data = json.loads(text, parse_float=_parse_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc.msg} (line {exc.lineno} "
                                  f"column {exc.colno})") from None
    except _BadNumber as exc:
        raise InvalidRequestError(str(exc)) from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(data)
    return data


def _check_structure(text: str) -> None:
    """Nesting depth and number length, measured on the text with its strings cut out (a
    bracket or digits inside a string are text, not structure)."""
    structure = _JSON_STRING.sub('""', text)
    if _has_long_number(structure):
        raise InvalidRequestError(f"request body has a number of more than {MAX_NUMBER_DIGITS} digits")
    if structure.count("[") + structure.count("{") <= MAX_JSON_DEPTH:
        return  # too few openers to nest that deep (most requests: no numpy call)
    chars = np.frombuffer(structure.encode("utf-8"), dtype=np.uint8)
    steps = np.isin(chars, _OPENERS).astype(np.int32) - np.isin(chars, _CLOSERS).astype(np.int32)
    if steps.size and int(np.cumsum(steps).max()) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")


def _has_long_number(structure: str) -> bool:
    """Whether a run of digits is longer than MAX_NUMBER_DIGITS (outside strings, digits in a row
    are one number's, or its exponent's)."""
    if len(structure) < _NUMPY_DIGIT_SCAN_CHARS:
        return _LONG_NUMBER.search(structure) is not None
    return _longest_digit_run(structure) > MAX_NUMBER_DIGITS


def _longest_digit_run(structure: str) -> int:
    """The longest run of ASCII digits, in one numpy pass: the gaps between non-digits."""
    chars = np.frombuffer(structure.encode("utf-8"), dtype=np.uint8)
    non_digits = np.flatnonzero((chars < ord("0")) | (chars > ord("9")))
    bounds = np.concatenate(([-1], non_digits, [chars.size]))
    return int(np.diff(bounds).max()) - 1


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"request body has a number out of range ({text[:24]})")
    return value


def _no_constant(text: str) -> float:
    raise _BadNumber(f"request body has {text}, which is not JSON")


def _check_strings(data: Any) -> None:
    """Every string and key must be valid Unicode: JSON's `\\ud800` escapes can spell lone
    surrogates, which no tokenizer can encode."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(f"request body has a string that is not valid Unicode "
                                          f"(lone surrogate at character {exc.start})") from None


def bounded(name: str) -> dict[str, Any]:
    """pydantic's arguments for request field `name` (for a list or dict field, for each of its
    values): strict (no "5" for 5, no true for 1) and within its bound in `BOUNDS`, so a value out
    of range is a 400 naming the field, and the API's schema (/openapi.json) shows the range."""
    bound = BOUNDS[name]
    limits: dict[str, Any] = {"strict": True}
    if bound.low is not None:
        limits["gt" if bound.low_open else "ge"] = bound.low
    if bound.high is not None:
        limits["lt" if bound.high_open else "le"] = bound.high
    return limits


# SamplingParams' defaults are the request's: a field left out (or null) is the default there.
DEFAULTS = SamplingParams()

TokenCount = Annotated[int, Field(**bounded("max_tokens"))]
TokenId = Annotated[int, Field(**bounded("prompt_token_ids"))]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    request_id: str | None = None  # Tandem's: the id under which the server logged the details


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


NumLogprobs = Annotated[int, Field(**bounded("logprobs"))]


def _never(value: Any, body: dict[str, Any]) -> bool:
    return False


def _equals(harmless: Any):
    return lambda value, body: value == harmless


# Known OpenAI and vLLM request fields Tandem does not implement: field -> (is this value the
# one that asks for nothing?, what to tell the client). Any other value is a 400 naming it.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "best_of": (lambda value, body: value == (body.get("n") or 1),
                "best_of is not supported (every sampled choice is returned; use n)"),
    "echo": (_equals(False), "echo is not supported"),
    "suffix": (_equals(""), "suffix (text insertion) is not supported"),
    "audio": (_never, "audio output is not supported"),
    "modalities": (_equals(["text"]), "only the text modality is supported"),
    "prediction": (_never, "predicted outputs are not supported"),
    "web_search_options": (_never, "web search is not supported"),
    "functions": (_never, "the legacy functions field is not supported; use tools"),
    "function_call": (_never, "the legacy function_call field is not supported; use tool_choice"),
    "reasoning_effort": (_never, "reasoning_effort is not supported (the served model does not reason)"),
    "verbosity": (_never, "verbosity is not supported"),
    "service_tier": (lambda value, body: value in ("auto", "default"),
                     "service_tier must be 'auto' or 'default' (there is one tier)"),
    "store": (_equals(False), "Tandem does not store completions (store must be false)"),
    "prompt_logprobs": (_equals(0), "prompt_logprobs is not supported"),
    "use_beam_search": (_equals(False), "beam search is not supported"),
    "length_penalty": (_equals(1.0), "length_penalty (beam search) is not supported"),
    "include_stop_str_in_output": (_equals(False), "include_stop_str_in_output is not supported"),
    "skip_special_tokens": (_equals(True), "special tokens are always skipped"),
    "spaces_between_special_tokens": (_equals(True), "spaces_between_special_tokens is not supported"),
    "truncate_prompt_tokens": (_never, "prompt truncation is not supported"),
    "allowed_token_ids": (_never, "allowed_token_ids is not supported (use logit_bias)"),
    "bad_words": (_equals([]), "bad_words is not supported (use logit_bias)"),
    "guided_grammar": (_never, "guided_grammar is not supported"),
    "add_generation_prompt": (_equals(True), "add_generation_prompt is always true"),
    "continue_final_message": (_equals(False), "continue_final_message is not supported"),
    "chat_template": (_never, "a request's own chat_template is not supported"),
    "chat_template_kwargs": (_never, "chat_template_kwargs is not supported"),
    "documents": (_never, "documents are not supported"),
    "logits_processors": (_never, "logits_processors are not supported"),
    "return_tokens_as_token_ids": (_equals(False), "return_tokens_as_token_ids is not supported"),
}
# Accepted and dropped: labels for the client's own bookkeeping that change nothing about the
# completion.
HARMLESS_FIELDS = frozenset({"metadata", "prompt_cache_key", "safety_identifier"})


def screen_fields(model_cls: type[BaseModel], data: Any) -> Any:
    """The body with nulls and harmless labels dropped; `InvalidRequestError` naming the first field
    Tandem would otherwise ignore. Raised directly, not as a pydantic error, so the 400 carries
    the field as its `param`."""
    if not isinstance(data, dict):
        return data
    fields = model_cls.model_fields
    screened = {}
    for key, value in data.items():
        field_info = fields.get(key)
        if field_info is not None:
            if value is not None or field_info.is_required():  # null: as if left out
                screened[key] = value
        elif value is None or key in HARMLESS_FIELDS:
            continue
        elif key in UNSUPPORTED_FIELDS:
            harmless, reason = UNSUPPORTED_FIELDS[key]
            if not harmless(value, data):
                raise InvalidRequestError(f"{key}: {reason}", param=key, code="unsupported_field")
        else:
            raise InvalidRequestError(f"{_short(key)}: unknown field; Tandem refuses fields it does not implement "
                                      "rather than ignore them", param=_short(key), code="unsupported_field")
    return screened


def _short(key: str) -> str:
    return key if len(key) <= 64 else key[:64] + "..."


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: TokenCount | None = None  # None: the ingress's default, which depends on the endpoint
    temperature: float = Field(default=DEFAULTS.temperature, **bounded("temperature"))
    top_p: float = Field(default=DEFAULTS.top_p, **bounded("top_p"))
    n: int = Field(default=DEFAULTS.n, **bounded("n"))
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None  # held to BOUNDS["stop"] by `_check`
    seed: int | None = Field(default=DEFAULTS.seed, **bounded("seed"))
    presence_penalty: float = Field(default=DEFAULTS.presence_penalty, **bounded("presence_penalty"))
    frequency_penalty: float = Field(default=DEFAULTS.frequency_penalty, **bounded("frequency_penalty"))
    # Token ids (JSON's keys are strings, read by `logit_bias_ids`) -> biases.
    logit_bias: dict[StrictStr, Annotated[float, Field(**bounded("logit_bias"))]] | None = Field(
        default=None, max_length=BOUNDS["logit_bias"].max_items)
    user: StrictStr | None = None
    # Tandem extras (vLLM spells them the same way).
    top_k: int = Field(default=DEFAULTS.top_k, **bounded("top_k"))
    min_p: float = Field(default=DEFAULTS.min_p, **bounded("min_p"))
    repetition_penalty: float = Field(default=DEFAULTS.repetition_penalty, **bounded("repetition_penalty"))
    min_tokens: int = Field(default=DEFAULTS.min_tokens, **bounded("min_tokens"))
    ignore_eos: StrictBool = DEFAULTS.ignore_eos
    stop_token_ids: list[Annotated[int, Field(**bounded("stop_token_ids"))]] | None = Field(
        default=None, max_length=BOUNDS["stop_token_ids"].max_items)
    # Structured outputs (OpenAI's response_format, vLLM's guided_*), read by cluster/tools.py.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1)
    # Scheduling (docs/routing.md, "Deadlines and priorities"): vLLM's priority (lower is more
    # urgent, classes compared by value) and Tandem's TTFT deadline (the header
    # x-tandem-ttft-deadline-ms says the same; the body wins where both are given).
    priority: int = Field(default=DEFAULTS.priority, **bounded("priority"))
    ttft_deadline_ms: float | None = Field(default=None, **bounded("ttft_deadline_ms"))

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        return screen_fields(cls, data)

    @model_validator(mode="after")
    def _check(self) -> _SamplingRequest:
        problem = BOUNDS["stop"].problem(self.stop_list)
        if problem is not None:
            raise ValueError(f"stop {problem}")
        if self.logit_bias is not None:
            self.logit_bias_ids()  # keys checked here, so a bad one is a 400 at the edge
        return self

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` with its keys (token ids as JSON strings) as ints."""
        if not self.logit_bias:
            return {}
        token_id = BOUNDS["logit_bias"].keys
        bias = {}
        for key, value in self.logit_bias.items():
            # Decimal digits, no more than the largest id has (int() of 5,000 digits is slow).
            if not (key.isascii() and key.isdigit() and len(key) <= len(str(token_id.high))
                    and token_id.admits(int(key))):
                raise ValueError(f"logit_bias keys must be token ids ({token_id}), got {_short(key)!r}")
            bias[int(key)] = value
        return bias

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per sampled token, or None when logprobs are off."""
        return None


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    logprobs: NumLogprobs | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            self.prompt = self.prompt[0]
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # accepted; a forced call is always one call

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them (developer is OpenAI's new name for system;
        tool calls and results as cluster/tools.py writes them)."""
        return [template_message("system" if m.role == "developer" else m.role, m.text(), m.tool_calls,
                                 m.tool_call_id, m.name) for m in self.messages]


# -- responses -------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TandemInfo(BaseModel):
    """Tandem's `tandem` field; what is unknown is left out rather than sent as null."""

    backend: str
    estimated_s: float | None = None
    projected_ttft_ms: float | None = None  # the router's projected TTFT where it placed the request
    # of usage's cached_tokens, those reloaded from the backend's host KV tier (where usage is sent)
    host_cached_tokens: int | None = None

    @model_serializer(mode="wrap")
    def _without_unknowns(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the top `logprobs` tokens and the sampled one
    text_offset: list[int]  # of each token's text in the choice's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    tandem: TandemInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    tandem: TandemInfo | None = None


class DeltaMessage(BaseModel):
    """What one stream chunk adds to a choice's message. Only the fields it carries are sent,
    as OpenAI sends them: the role in a choice's first chunk, content as it comes, the tool
    calls at the end, and `{}` for a last chunk with nothing left to add; a client that reads
    `"role": null` or `"tool_calls": null` in every delta may take them for values."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _carried_fields_only(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    tandem: TandemInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    max_model_len: int | None = None  # as vLLM's card: the context a prompt and its output share


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None,
               request_id: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code,
                                           request_id=request_id)).model_dump()
