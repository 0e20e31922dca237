"""The OpenAI-compatible HTTP protocol, as pydantic models.

Requests are validated here, field by field, so a bad request is answered with a 400 that
names the field (OpenAI's error shape) before it costs a tokenizer call or a routing decision.
Numeric fields are strict about types (`"max_tokens": "5"` is an error, as at OpenAI) but
accept an int where a float is expected. Unknown fields are ignored, as most OpenAI-compatible
servers do, so newer clients keep working.

Tandem's extras: `ignore_eos`, `min_tokens`, `top_k` and `seed` on requests (the sampling
settings the engine supports beyond OpenAI's), `usage.prompt_tokens_details.cached_tokens`, and
a `tandem` object on responses and chunks naming the backend that served the request.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_STOP_SEQUENCES = 16


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    n: StrictInt = Field(default=1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, strict=True)
    user: StrictStr | None = None
    # Tandem extras (vLLM spells them the same way).
    top_k: StrictInt = Field(default=0, ge=-1)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> _SamplingRequest:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
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
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
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
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
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


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code)).model_dump()
