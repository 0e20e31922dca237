"""The Ray Serve ingress: an OpenAI-compatible HTTP API in front of the router and backends.

Each request is handled in this order, each step able to answer with an OpenAI-shaped error:
size (413) -> API key (401) -> JSON and fields (400) -> model name (404) -> admission (429) ->
tokenize and check the context (400) -> route and wait for the backend to admit it (400 if the
engine rejects it, 503 if no backend can take it) -> respond. Only then does a streamed
response start, so its status code is still meaningful; the serving backend is named in the
`x-tandem-backend` header and in a `tandem` field of every response and chunk.

The ingress holds no model state beyond the tokenizer, which it gets from a backend at start
(the engine's own tokenizer object, so prompts tokenize exactly as `tandem generate` does).
Admission is a bound on requests admitted here and not yet finished: when it is reached the
server answers 429 at once instead of queueing without limit.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run
time to tell a `Request` parameter from a query parameter. And everything the ingress class
uses is defined above it: Serve serializes the class when it is decorated.)
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.cluster.dispatch import RequestFailed, RequestStream
from tandem.actors.metrics import INGRESS_METRICS, Recorder
from tandem.cluster.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TandemInfo,
    UsageInfo,
    error_body,
)
from tandem.cluster.tokenize import encode_chat, encode_prompt

logger = logging.getLogger("tandem.app")

BACKEND_HEADER = "x-tandem-backend"
REQUEST_ID_HEADER = "x-tandem-request-id"  # Serve sets its own x-request-id
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

api = FastAPI(title="Tandem", description="OpenAI-compatible API of a Tandem cluster")


@dataclass(frozen=True)
class IngressSettings:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    max_pending_requests: int = 64
    max_request_bytes: int = 4 << 20
    max_route_attempts: int = 3


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.error_type, self.param, self.code = (
            status_code, message, error_type, param, code)

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> "ApiError":
        return cls(failure.status_code, failure.message, failure.error_type, failure.param, failure.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.error_type, self.param, self.code),
                            status_code=self.status_code, headers=headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), error_type), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                        status_code=500)


@dataclass
class _ChunkMaker:
    stream: RequestStream
    model: str
    created: int
    chat: bool
    info: Any

    def make(self, delta: Any, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            chunk: Any = ChatCompletionChunk(id=self.stream.req_id, created=self.created, model=self.model,
                                             choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
                                             tandem=self.info(self.stream))
        else:
            chunk = CompletionResponse(id=self.stream.req_id, created=self.created, model=self.model,
                                       choices=[CompletionChoice(text=delta, finish_reason=finish_reason)],
                                       tandem=self.info(self.stream))
        return chunk.model_dump()

    def usage(self, usage: UsageInfo) -> dict[str, Any]:
        if self.chat:
            chunk: Any = ChatCompletionChunk(id=self.stream.req_id, created=self.created, model=self.model,
                                             choices=[], usage=usage, tandem=self.info(self.stream))
        else:
            chunk = CompletionResponse(id=self.stream.req_id, created=self.created, model=self.model,
                                       choices=[], usage=usage, tandem=self.info(self.stream))
        return chunk.model_dump()


class _OnceClosedStreamingResponse(StreamingResponse):
    """Runs `cleanup` exactly once when the response ends, however it ends.

    A generator's `finally` alone is not enough: if the client is gone before the first byte,
    Starlette never starts the body generator, and its cleanup would never run.
    """

    def __init__(self, content: Any, cleanup: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cleanup, self._cleanup = self._cleanup, None
            if cleanup is not None:
                await cleanup()


def _headers(stream: RequestStream) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: stream.req_id}
    if stream.backend_id:
        headers[BACKEND_HEADER] = stream.backend_id
    return headers


def _delta(text: str, chat: bool) -> Any:
    return DeltaMessage(content=text) if chat else text


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@serve.deployment(name="TandemIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(api)
class TandemIngress:
    def __init__(self, router: Any, tokenizer: Any, settings: IngressSettings) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.settings = settings
        self.num_pending = 0
        self.metrics = Recorder(INGRESS_METRICS)

    # -- endpoints ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            infos = await asyncio.wait_for(self.router.backend_infos.remote(), timeout=5.0)
        except Exception as exc:  # the router itself is unreachable
            return JSONResponse({"status": "unavailable", "error": f"router unreachable: {exc}"}, 503)
        body = {"status": "ok" if infos else "unavailable", "model": self.settings.served_model_name,
                "num_pending": self.num_pending,
                "backends": {bid: {"device": i.device, "instance_id": i.instance_id} for bid, i in infos.items()}}
        return JSONResponse(body, status_code=200 if infos else 503)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(ModelList(data=[ModelCard(id=self.settings.served_model_name)]).model_dump())

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, ChatCompletionRequest, chat=True)

    # -- the request path --------------------------------------------------------------------
    async def _handle(self, request: Request, model_cls: type, chat: bool) -> Response:
        arrival_time = time.time()
        endpoint = request.url.path
        try:
            body = await self._parse(request, model_cls)
            prompt_token_ids, params = self._prepare(body, chat)
        except ApiError as exc:
            self._count(endpoint, exc.status_code)
            return exc.response()
        self.num_pending += 1
        self.metrics.set("tandem_http_pending_requests", self.num_pending)
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = RequestStream(self.router, req_id, prompt_token_ids, params, arrival_time,
                               self.settings.max_route_attempts)
        handed_over = False
        try:
            await stream.open()
            if body.stream:
                handed_over = True
                response = self._streaming_response(stream, body, chat)
            else:
                response = await self._full_response(stream, body, chat)
            self._count(endpoint, 200)
            return response
        except RequestFailed as exc:
            self._count(endpoint, exc.status_code)
            return ApiError.from_failure(exc).response(_headers(stream))
        finally:
            if not handed_over:
                await stream.close()
                self._release()

    async def _parse(self, request: Request, model_cls: type) -> Any:
        raw = await request.body()
        if len(raw) > self.settings.max_request_bytes:
            raise ApiError(413, f"request body is {len(raw)} bytes, over the limit of "
                           f"{self.settings.max_request_bytes}", "invalid_request_error", code="request_too_large")
        self._check_auth(request)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_request_error") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(p) for p in error["loc"]) or None
            message = f"{param}: {error['msg']}" if param else error["msg"]
            raise ApiError(400, message, "invalid_request_error", param=param) from None
        if body.model != self.settings.served_model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.settings.served_model_name!r}", "invalid_request_error",
                           param="model", code="model_not_found")
        if self.num_pending >= self.settings.max_pending_requests:
            raise ApiError(429, f"the server is at its limit of {self.settings.max_pending_requests} pending "
                           "requests; retry shortly", "rate_limit_error", code="too_many_pending_requests")
        return body

    def _check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {key}":
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", code="invalid_api_key")

    def _prepare(self, body: Any, chat: bool) -> tuple[list[int], Any]:
        from tandem.engine.sampling_params import InvalidRequestError, SamplingParams

        prompt_token_ids = self._tokenize(body, chat)
        max_model_len = self.settings.max_model_len
        if len(prompt_token_ids) >= max_model_len:
            raise ApiError(400, f"the prompt is {len(prompt_token_ids)} tokens; this model's context is "
                           f"{max_model_len} tokens", "invalid_request_error",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - len(prompt_token_ids) if chat else DEFAULT_COMPLETION_MAX_TOKENS
        if len(prompt_token_ids) + max_tokens > max_model_len:
            raise ApiError(400, f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({max_tokens}) "
                           f"is over this model's context of {max_model_len} tokens", "invalid_request_error",
                           param="max_tokens", code="context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                    top_k=body.top_k, seed=body.seed, stop=body.stop_list,
                                    ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), "invalid_request_error") from None
        return prompt_token_ids, params

    def _tokenize(self, body: Any, chat: bool) -> list[int]:
        if chat:
            return encode_chat(self.tokenizer, body.template_messages())
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise ApiError(400, "prompt must not be empty", "invalid_request_error", param="prompt")
            return encode_prompt(self.tokenizer, body.prompt)
        if not body.prompt:
            raise ApiError(400, "prompt must not be empty", "invalid_request_error", param="prompt")
        return list(body.prompt)

    def _release(self) -> None:
        self.num_pending -= 1
        self.metrics.set("tandem_http_pending_requests", self.num_pending)

    def _count(self, endpoint: str, status: int) -> None:
        self.metrics.inc("tandem_http_requests", tags={"endpoint": endpoint, "status": str(status)})

    # -- responses ---------------------------------------------------------------------------
    def _info(self, stream: RequestStream) -> TandemInfo:
        return TandemInfo(backend=stream.backend_id, estimated_s=round(stream.decision.estimated_s, 6))

    async def _full_response(self, stream: RequestStream, body: Any, chat: bool) -> JSONResponse:
        pieces, final = [], None
        async for out in stream.outputs():
            pieces.append(out.new_text)
            final = out
        usage = UsageInfo.of(final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens)
        text, reason = "".join(pieces), final.finish_reason
        if chat:
            response: Any = ChatCompletionResponse(
                id=stream.req_id, model=body.model, usage=usage, tandem=self._info(stream),
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)])
        else:
            response = CompletionResponse(
                id=stream.req_id, model=body.model, usage=usage, tandem=self._info(stream),
                choices=[CompletionChoice(text=text, finish_reason=reason)])
        return JSONResponse(response.model_dump(), headers=_headers(stream))

    def _streaming_response(self, stream: RequestStream, body: Any, chat: bool) -> StreamingResponse:
        async def cleanup() -> None:
            await stream.close()
            self._release()

        return _OnceClosedStreamingResponse(self._sse(stream, body, chat), cleanup, media_type="text/event-stream",
                                            headers={**_headers(stream), "cache-control": "no-cache"})

    async def _sse(self, stream: RequestStream, body: Any, chat: bool) -> AsyncIterator[str]:
        """Chunks as server-sent events; a failure mid-stream becomes an error event, then [DONE]."""
        created = int(time.time())
        chunk = _ChunkMaker(stream, body.model, created, chat, self._info)
        try:
            if chat:
                yield _sse(chunk.make(DeltaMessage(role="assistant", content=""), None))
            final = None
            try:
                async for out in stream.outputs():
                    final = out
                    if out.new_text or out.finished:
                        yield _sse(chunk.make(_delta(out.new_text, chat), out.finish_reason))
                if body.include_usage and final is not None:
                    u = final.usage
                    yield _sse(chunk.usage(UsageInfo.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens)))
            except RequestFailed as exc:
                yield _sse(error_body(exc.message, exc.error_type, exc.param, exc.code))
            yield "data: [DONE]\n\n"
        finally:
            await stream.close()  # at once, not when the response object is torn down


def build_app(router: Any, tokenizer: Any, settings: IngressSettings, access_log: bool = True) -> Any:
    """The Serve application, ready for `serve.run`."""
    deployment = TandemIngress
    if not access_log:
        deployment = deployment.options(logging_config={"enable_access_log": False})
    return deployment.bind(router, tokenizer, settings)


__all__ = ["BACKEND_HEADER", "REQUEST_ID_HEADER", "ApiError", "IngressSettings", "TandemIngress", "build_app"]
