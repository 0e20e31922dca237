"""The OpenAI-compatible HTTP protocol: the request body's JSON, and pydantic models.

Requests are validated here, field by field, so a bad request is answered with a 400 that
names the field (OpenAI's error shape) before it costs a tokenizer call or a routing decision.
Numeric fields are strict about types (`"max_tokens": "5"` is an error, as at OpenAI) but
accept an int where a float is expected, and every one has a range: nothing a client sends
reaches the engine's tensors or `torch.Generator.manual_seed` (which takes [0, 2**64 - 1])
as a value they cannot hold. Unknown fields are ignored, as most OpenAI-compatible servers do,
so newer clients keep working.

The body is parsed by `parse_json_object`, not by pydantic or a bare `json.loads`, because
the standard parser's failure modes on hostile input are not 400s: nesting 50,000 deep raises
`RecursionError`, a 5,000-digit integer `ValueError`, `NaN` and `Infinity` parse as floats,
and `"\\ud800"` becomes a string no tokenizer can encode. Each is bounded or refused here.

Tandem's extras: `ignore_eos`, `min_tokens`, `top_k` and `seed` on requests (the sampling
settings the engine supports beyond OpenAI's), `usage.prompt_tokens_details.cached_tokens`, and
a `tandem` object on responses and chunks naming the backend that served the request.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from tandem.cluster.dispatch import InvalidRequest

MAX_STOP_SEQUENCES = 16
MAX_JSON_DEPTH = 32  # the deepest valid request is 4 (body, messages, message, content part)
MAX_NUMBER_DIGITS = 64  # 2**64 - 1 is 20 digits
MAX_INT32 = 2**31 - 1  # token counts and ids: they end up in int32/int64 tensors
MAX_SEED = 2**64 - 1

# JSON strings, matched whole (the unrolled loop: linear in the input whatever it holds), so
# what is left is the document's structure and numbers.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_LONG_NUMBER = re.compile(f"[0-9]{{{MAX_NUMBER_DIGITS + 1},}}")
# Only a \uD800-\uDFFF escape can put a surrogate into a parsed string (the UTF-8 decoder
# refuses encoded ones), so without one the strings need no walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)


class _BadNumber(ValueError):
    pass


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or `InvalidRequest` saying what is wrong with it.

    Checks that would cost a Python call per token of a 4 MB body run in C or numpy instead:
    the ingress's event loop serves everyone while it parses."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    _check_structure(text)
    try:
        data = json.loads(text, parse_float=_parse_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.msg} (line {exc.lineno} "
                             f"column {exc.colno})") from None
    except _BadNumber as exc:
        raise InvalidRequest(str(exc)) from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(data)
    return data


def _check_structure(text: str) -> None:
    """Nesting depth and number length, measured on the text with its strings cut out (a
    bracket or digits inside a string are text, not structure)."""
    structure = _JSON_STRING.sub('""', text)
    if _LONG_NUMBER.search(structure):
        raise InvalidRequest(f"request body has a number of more than {MAX_NUMBER_DIGITS} digits")
    chars = np.frombuffer(structure.encode("utf-8"), dtype=np.uint8)
    steps = np.isin(chars, _OPENERS).astype(np.int32) - np.isin(chars, _CLOSERS).astype(np.int32)
    if steps.size and int(np.cumsum(steps).max()) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")


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
                raise InvalidRequest(f"request body has a string that is not valid Unicode "
                                     f"(lone surrogate at character {exc.start})") from None


TokenCount = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]


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


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: TokenCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    n: StrictInt = Field(default=1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True)
    user: StrictStr | None = None
    # Tandem extras (vLLM spells them the same way).
    top_k: StrictInt = Field(default=0, ge=-1, le=MAX_INT32)
    min_tokens: StrictInt = Field(default=0, ge=0, le=MAX_INT32)
    ignore_eos: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> _SamplingRequest:
        stops = self.stop_list
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise ValueError(f"stop must be at most {MAX_STOP_SEQUENCES} non-empty strings")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (use 0)")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            self.prompt = self.prompt[0]
        if self.echo or self.logprobs is not None or self.suffix is not None:
            raise ValueError("echo, logprobs and suffix are not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

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

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat templates expect them (developer is OpenAI's new name for system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


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
    backend: str
    estimated_s: float | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
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
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None,
               request_id: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code,
                                           request_id=request_id)).model_dump()
