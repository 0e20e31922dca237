"""The request edge: from an HTTP request to the engine request it asks for, or a refusal.

Each step may refuse the request with an OpenAI-shaped error (cluster/errors.py maps each to
its status), in this order: API key (401) -> `Content-Type: application/json` (415) -> the
body, read in chunks and cut off at the size limit (413) -> JSON, bounded in depth and number
size, and fields, each range-checked (400) -> model name (404); then, once the ingress has
admitted the request, its TTFT deadline (the body's or the header's, 400) and the prompt,
tokenized and checked against the context, and its sampling params (400). What only the engine
can check (its vocabulary, its whole cache) it checks when the request reaches it
(engine/admission.py).

Requiring the JSON content type matters beyond tidiness: browsers send `text/plain` cross-site
without a preflight, so accepting it would let any web page drive a server that runs without a
key. The key is compared in constant time.

Prompts tokenize with the engine's own tokenizer object, which the ingress gets from a backend
at start, so a prompt here is the same tokens as `tandem generate` makes of it.
"""

from __future__ import annotations

import hmac
import math
import uuid
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from tandem.cluster.errors import ModelNotFound, PayloadTooLarge, Unauthorized, UnsupportedMediaType, echo
from tandem.cluster.headers import DEADLINE_HEADER
from tandem.cluster.protocol import DEFAULTS, parse_json_object
from tandem.cluster.tools import OutputPlan, plan_output
from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import BOUNDS, SamplingParams
from tandem.engine.tokenizer import encode_chat, encode_prompt


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_content_type(request: Request) -> None:
    """POST bodies must say they are JSON (`application/json`, optionally `; charset=utf-8`)."""
    value = request.headers.get("content-type", "")
    media_type, _, parameters = value.partition(";")
    if media_type.strip().lower() != "application/json":
        raise UnsupportedMediaType("the request body must be sent with 'Content-Type: application/json'",
                                   code="unsupported_media_type")
    for parameter in parameters.split(";"):
        name, _, charset = parameter.partition("=")
        if name.strip().lower() == "charset" and charset.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise UnsupportedMediaType("the request body must be UTF-8 JSON", code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk and refused as soon as it passes `limit` bytes, so a huge
    body costs no more memory than the limit whatever its declared length."""
    too_large = PayloadTooLarge(f"the request body is over the limit of {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def ttft_deadline_s(request: Request, body: Any) -> float | None:
    """The request's TTFT deadline in seconds: the body's `ttft_deadline_ms`, else the header's."""
    if body.ttft_deadline_ms is not None:
        return body.ttft_deadline_ms / 1000
    value = request.headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    bound = BOUNDS["ttft_deadline_ms"]
    try:
        deadline_ms = float(value)
    except ValueError:
        deadline_ms = math.nan
    if not bound.admits(deadline_ms):
        raise InvalidRequestError(f"{DEADLINE_HEADER} must be milliseconds, {bound}, got {echo(value)}",
                                  param=DEADLINE_HEADER)
    return deadline_ms / 1000


class RequestEdge:
    """One ingress replica's edge: its key, its body limit, its model and its tokenizer."""

    def __init__(self, tokenizer: Any, served_model_name: str, max_model_len: int, api_key: str | None,
                 max_request_bytes: int) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    def check_auth(self, request: Request) -> None:
        key = self.api_key
        if key is None:
            return
        sent = request.headers.get("authorization", "").encode("latin-1")  # as Starlette decoded it
        if not hmac.compare_digest(sent, f"Bearer {key}".encode()):
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise ModelNotFound(f"the model {echo(model)} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    async def parse(self, request: Request, model_cls: type) -> Any:
        """The request's body as `model_cls`, after its key and its content type."""
        self.check_auth(request)
        check_content_type(request)
        data = parse_json_object(await read_body(request, self.max_request_bytes))
        try:
            body = model_cls.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(p) for p in error["loc"]) or None
            message = f"{param}: {error['msg']}" if param else error["msg"]
            raise InvalidRequestError(message, param=param) from None
        self.check_model(body.model)
        return body

    def prepare(self, body: Any, chat: bool) -> tuple[list[int], SamplingParams, OutputPlan]:
        """The engine request a parsed body asks for: its prompt's ids, its sampling params, and
        how its output is read back (tools, structured output)."""
        plan = plan_output(body, getattr(self.tokenizer, "chat_template", None) if chat else None)
        prompt_token_ids = self._tokenize(body, chat, plan.template_tools)
        max_tokens = self._max_tokens(body, chat, len(prompt_token_ids))
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop_list,
                                stop_token_ids=list(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                                min_tokens=body.min_tokens, n=body.n, presence_penalty=body.presence_penalty,
                                frequency_penalty=body.frequency_penalty,
                                repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias_ids(),
                                logprobs=body.num_logprobs, structured_output=plan.structured_output,
                                priority=body.priority)
        params.validate_relations()  # the body held each field to its bound as it parsed
        return prompt_token_ids, params, plan

    def _max_tokens(self, body: Any, chat: bool, num_prompt_tokens: int) -> int:
        """The body's max_tokens, or its default, once the prompt and it fit the context."""
        max_model_len = self.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise InvalidRequestError(f"the prompt is {num_prompt_tokens} tokens; this model's context is "
                                      f"{max_model_len} tokens", param="messages" if chat else "prompt",
                                      code="context_length_exceeded")
        max_tokens = body.max_tokens
        if max_tokens is None:
            # A chat may fill the context; a completion takes SamplingParams' default (OpenAI's too).
            max_tokens = max_model_len - num_prompt_tokens if chat else DEFAULTS.max_tokens
        if num_prompt_tokens + max_tokens > max_model_len:
            raise InvalidRequestError(f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                                      f"is over this model's context of {max_model_len} tokens", param="max_tokens",
                                      code="context_length_exceeded")
        return max_tokens

    def _tokenize(self, body: Any, chat: bool, tools: list[dict[str, Any]] | None = None) -> list[int]:
        if chat:
            return self._encode_chat(body, tools)
        if not body.prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if isinstance(body.prompt, str):
            return encode_prompt(self.tokenizer, body.prompt)
        return list(body.prompt)

    def _encode_chat(self, body: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The messages through the model's chat template, which may refuse them (a template
        can raise on, say, roles out of order): that is the request's fault, a 400."""
        from jinja2 import TemplateError

        try:
            return encode_chat(self.tokenizer, body.template_messages(), tools)
        except TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template refused the messages: {str(exc)[:200]}",
                                      param="messages") from None
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError("the messages could not be rendered with the model's chat template",
                                      param="messages", detail=f"{type(exc).__name__}: {exc}") from None
