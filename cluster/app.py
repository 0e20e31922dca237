"""The Ray Serve ingress: an OpenAI-compatible HTTP API in front of the router and backends.

Each request is handled in this order, each step able to answer with an OpenAI-shaped error:
API key (401) -> `Content-Type: application/json` (415) -> the body, read in chunks and cut
off at the size limit (413) -> JSON, bounded in depth and number size, and fields, each
range-checked (400) -> model name (404) -> admission (429) -> tokenize and check the context
(400) -> route and wait for the backend to admit it (400 if the engine rejects it, 503 if no
backend can take it, 429 with the router's projection and a `Retry-After` from it if no backend
can meet the request's TTFT deadline, `ttft_deadline_ms` or the `x-tandem-ttft-deadline-ms`
header, while they are busy) -> respond; the TTFT the router projected is in the
`x-tandem-projected-ttft-ms` header and the `tandem` field. Only then does a streamed response start, so its status code
is still meaningful; the serving backend is named in the `x-tandem-backend` header and in a
`tandem` field of every response and chunk. With a key set, every route but `/health` and
`/metrics` needs it, the API's own description included (`/openapi.json`, and the `/docs` and
`/redoc` pages that read it: FastAPI's are off, these are the ingress's own routes, which check
the key first); unknown routes answer 401 before 404, so they do not reveal which routes exist.

Errors are raised as one exception class per meaning (engine/errors.py's, plus the few only
HTTP has, below) and translated into a status code, an OpenAI error type and, for 429 and 503,
a `Retry-After` once, in `HTTP_ERRORS`. A body never carries internals (tracebacks, pids, actor
ids): an error's `detail` goes to the server log under the request id that the body's
`error.request_id` and the `x-tandem-request-id` header also carry. A request the engine failed
on its own (an output finished with reason "error", engine/llm_engine.py: its grammar, its
sampling or its detokenizing raised, and the other requests went on) is a 500 like any internal
error, or the error event of a stream that already started; the backend's log has the trace
under the same request id. Requiring the JSON content
type matters beyond tidiness: browsers send `text/plain` cross-site without a preflight, so
accepting it would let any web page drive a server that runs without a key.

The ingress holds no model state beyond the tokenizer, which it gets from a backend at start
(the engine's own tokenizer object, so prompts tokenize exactly as `tandem generate` does).
Admission is a bound on requests admitted here and not yet finished: when it is reached the
server answers 429 at once instead of queueing without limit.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run
time to tell a `Request` parameter from a query parameter. And everything the ingress class
uses is defined above it: Serve serializes the class when it is decorated.)
"""

import asyncio
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tandem.cluster.choices import Choice, LogprobsFormatter
from tandem.cluster.dispatch import RoutedRequest
from tandem.cluster.http_server import ReplicaHTTPServer
from tandem.cluster.metrics_route import metrics_response
from tandem.cluster.sse import ChunkTemplate, sse_event
from tandem.engine.errors import (BackendUnavailableError, DeadlineUnmetError, InvalidRequestError, OverloadedError,
                                  TandemError)
from tandem.cluster.tools import OutputPlan, ToolCallStream, delta_tool_calls, plan_output
from tandem.actors.metrics import INGRESS_METRICS, Recorder
from tandem.cluster.protocol import (
    DEFAULTS,
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
    parse_json_object,
)
from tandem.engine.sampling_params import BOUNDS, SamplingParams
from tandem.engine.tokenizer import encode_chat, encode_prompt

logger = logging.getLogger("tandem.app")

BACKEND_HEADER = "x-tandem-backend"
# A request's TTFT deadline, as the body's ttft_deadline_ms says it (the body wins), and the
# TTFT the router projected where it placed the request (docs/routing.md, "Deadlines").
DEADLINE_HEADER = "x-tandem-ttft-deadline-ms"
PROJECTED_TTFT_HEADER = "x-tandem-projected-ttft-ms"
REQUEST_ID_HEADER = "x-tandem-request-id"  # Serve sets its own x-request-id
# Retry-After: a full admission queue drains within about a request's time; a failed backend's
# requests fail over at once, and a restarted backend rejoins in seconds (docs/cluster.md).
OVERLOADED_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 2
MAX_ECHOED_CHARS = 64  # of a client's own value quoted back in an error message
CLIENT_CLOSED_REQUEST = 499  # nginx's code, in the request counter only: no client reads it
CATCH_ALL = "/{path:path}"
# engine/llm_engine.py's FINISH_REASON_ERROR (not imported: the ingress does not load torch).
ENGINE_ERROR_REASON = "error"
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

OPENAPI_PATH, DOCS_PATH, REDOC_PATH = "/openapi.json", "/docs", "/redoc"

# FastAPI's own /openapi.json, /docs and /redoc answer without a key: off, and served by the
# ingress's routes of the same paths, which check it (`TandemIngress.openapi_schema`).
api = FastAPI(title="Tandem", description="OpenAI-compatible API of a Tandem cluster",
              openapi_url=None, docs_url=None, redoc_url=None)


@dataclass(frozen=True)
class IngressSettings:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    max_pending_requests: int = 64
    max_request_bytes: int = 4 << 20
    max_route_attempts: int = 3
    # Where each replica serves HTTP itself (cluster/http_server.py); None: behind Serve's proxy.
    http_host: str = "127.0.0.1"
    http_port: int | None = None


# The HTTP edge's own refusals: client errors (InvalidRequestError) that only the ingress raises,
# each its own class because each has its own status.
class Unauthorized(InvalidRequestError):
    """No API key, or the wrong one."""


class RouteNotFound(InvalidRequestError):
    """No such endpoint."""


class MethodNotAllowed(InvalidRequestError):
    """The endpoint exists, but not for this HTTP method."""


class ModelNotFound(InvalidRequestError):
    """The request names a model this server does not serve."""


class PayloadTooLarge(InvalidRequestError):
    """The body is over the size limit."""


class UnsupportedMediaType(InvalidRequestError):
    """A POST body that does not say it is UTF-8 JSON."""


# Every error class -> (HTTP status, OpenAI error type, Retry-After seconds or None); a class
# not listed takes its nearest listed base's entry.
HTTP_ERRORS: dict[type[TandemError], tuple[int, str, int | None]] = {
    InvalidRequestError: (400, "invalid_request_error", None),
    Unauthorized: (401, "invalid_request_error", None),
    RouteNotFound: (404, "not_found_error", None),
    ModelNotFound: (404, "invalid_request_error", None),
    MethodNotAllowed: (405, "invalid_request_error", None),
    PayloadTooLarge: (413, "invalid_request_error", None),
    UnsupportedMediaType: (415, "invalid_request_error", None),
    OverloadedError: (429, "rate_limit_error", OVERLOADED_RETRY_AFTER_S),
    DeadlineUnmetError: (429, "rate_limit_error", None),  # Retry-After from the router's projection
    BackendUnavailableError: (503, "service_unavailable", UNAVAILABLE_RETRY_AFTER_S),
    TandemError: (500, "internal_error", None),
}


def http_error(exc: TandemError) -> tuple[int, str, int | None]:
    return next(HTTP_ERRORS[cls] for cls in type(exc).__mro__ if cls in HTTP_ERRORS)


def error_response(exc: TandemError, request_id: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one translation of an error into an HTTP answer; its detail goes to the log only."""
    status, error_type, retry_after_s = http_error(exc)
    _log_failure(exc, request_id, status)
    headers = {REQUEST_ID_HEADER: request_id, **(headers or {})}
    if isinstance(exc, DeadlineUnmetError):
        # Retry-After is whole seconds: round the router's drain time up, so a retry is not early.
        retry_after_s = max(1, math.ceil(exc.retry_after_s))
        headers[PROJECTED_TTFT_HEADER] = f"{exc.projected_ttft_s * 1000:.1f}"
    if retry_after_s is not None:
        headers["retry-after"] = str(retry_after_s)
    body = error_body(exc.message, error_type, exc.param, exc.code, request_id)
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(exc: TandemError, request_id: str) -> dict[str, Any]:
    """The same error as the last event of a stream that already started."""
    status, error_type, _ = http_error(exc)
    _log_failure(exc, request_id, status)
    return error_body(exc.message, error_type, exc.param, exc.code, request_id)


def _log_failure(exc: TandemError, request_id: str, status: int) -> None:
    if status >= 500 or exc.detail:
        logger.warning("request %s: %d %s: %s%s", request_id, status, type(exc).__name__, exc.message,
                       f" ({exc.detail})" if exc.detail else "")
    else:
        logger.info("request %s: %d %s: %s", request_id, status, type(exc).__name__, exc.message)


def _internal(request_id: str) -> TandemError:
    return TandemError(f"internal error; the server logged it under request id {request_id}")


def _check_output(out: Any, request_id: str) -> None:
    """Raise `TandemError` for an output the engine ended with an error."""
    if out.finish_reason == ENGINE_ERROR_REASON:
        raise TandemError(f"the request failed while generating; the server logged it under request id "
                          f"{request_id}", detail=f"the engine ended choice {out.index} with an error")


def _echo(value: str) -> str:
    """A client's value quoted back, short enough for an error message."""
    return repr(value if len(value) <= MAX_ECHOED_CHARS else value[:MAX_ECHOED_CHARS] + "...")


def _new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@api.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    failure = {404: RouteNotFound, 405: MethodNotAllowed}.get(exc.status_code, InvalidRequestError)
    return error_response(failure(f"{request.method} {request.url.path[:MAX_ECHOED_CHARS]}: "
                                  f"{'not found' if exc.status_code == 404 else 'not allowed'}"),
                          _new_request_id())


@api.exception_handler(Exception)
async def _unhandled_exception(request: Request, exc: Exception) -> JSONResponse:
    request_id = _new_request_id()
    logger.error("request %s: unhandled error on %s", request_id, request.url.path, exc_info=exc)
    return error_response(_internal(request_id), request_id)


class _DisconnectAsMessage:
    """ASGI middleware: Serve's `receive` raises `TaskCancelledError` once the proxy cancels a
    request whose client hung up; ASGI spells that an `http.disconnect` message, which Starlette
    handles as what it is (a streamed response stops, a body read raises `ClientDisconnect`)
    instead of logging an unhandled error for every client that went away."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def receive_or_disconnect() -> dict[str, Any]:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


api.add_middleware(_DisconnectAsMessage)


def _root_path(request: Request) -> str:
    """The application's route prefix as the client sees it ("" at the root)."""
    return request.scope.get("root_path", "").rstrip("/")


def _route_path(scope: Any) -> str:
    """The path as the app's routes see it: without the application's route prefix."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


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


@dataclass
class _ChunkMaker:
    """A stream's chunks as OpenAI shapes them: `make` a choice's chunk, with no `usage` key
    (OpenAI sends usage only in the chunk `usage` makes, the last, when the request's
    stream_options.include_usage asks for it); a chat delta carries only its fields (DeltaMessage)."""

    stream: RoutedRequest
    model: str
    created: int
    chat: bool
    info: Any

    def make(self, delta: Any, finish_reason: str | None, index: int = 0, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            choice: Any = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
            chunk: Any = ChatCompletionChunk(id=self.stream.req_id, created=self.created, model=self.model,
                                             choices=[choice], tandem=self.info(self.stream))
        else:
            choice = CompletionChoice(index=index, text=delta, finish_reason=finish_reason, logprobs=logprobs)
            chunk = CompletionResponse(id=self.stream.req_id, created=self.created, model=self.model,
                                       choices=[choice], tandem=self.info(self.stream))
        return chunk.model_dump(exclude={"usage"})

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


def _headers(stream: RoutedRequest) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: stream.req_id}
    if stream.backend_id:
        headers[BACKEND_HEADER] = stream.backend_id
        headers[PROJECTED_TTFT_HEADER] = f"{stream.decision.projected_ttft_s * 1000:.1f}"
    return headers


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
        raise InvalidRequestError(f"{DEADLINE_HEADER} must be milliseconds, {bound}, got {_echo(value)}",
                                  param=DEADLINE_HEADER)
    return deadline_ms / 1000


def _delta(text: str, chat: bool) -> Any:
    return DeltaMessage(content=text) if chat else text


def _tool_delta(tool_stream: ToolCallStream, out: Any) -> tuple[DeltaMessage | None, str | None]:
    """What a chat stream that reads tool calls sends for one engine output: content as it
    becomes safe to send, the calls (and the reason) with the last one; None for nothing yet."""
    content = tool_stream.feed(out.new_text)
    if out.finish_reason is None:  # this choice goes on (`finished` is the whole request's)
        return (DeltaMessage(content=content) if content else None), None
    rest, calls, reason = tool_stream.finish(out.finish_reason)
    text = content + (rest or "")
    return DeltaMessage(content=text or None, tool_calls=delta_tool_calls(calls) if calls else None), reason


_sse = sse_event


def _with_known_paths(cls: type) -> type:
    """Record the paths the class's routes serve, read from the app before Serve's ingress
    rebuilds it, so the catch-all route can tell a wrong method (405) from no route (404)."""
    cls.known_paths = frozenset(route.path for route in api.routes if getattr(route, "path", CATCH_ALL) != CATCH_ALL)
    return cls


@serve.deployment(name="TandemIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(api)
@_with_known_paths
class TandemIngress:
    def __init__(self, router: Any, tokenizer: Any, settings: IngressSettings) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.settings = settings
        self.num_pending = 0
        self.metrics = Recorder(INGRESS_METRICS)
        self.logprobs = LogprobsFormatter(tokenizer)
        self.replica_id = serve.get_replica_context().replica_id.unique_id  # /health names which one answered
        self.http_server = None
        if settings.http_port is not None:
            self.http_server = ReplicaHTTPServer(self._asgi, settings.http_host, settings.http_port, self._servable)

    def _servable(self) -> bool:
        """Whether Serve has finished initialising this replica: until then its routes cannot
        reach this object (FastAPI's class-based routes look it up in the replica context)."""
        return serve.get_replica_context().servable_object is self

    async def _asgi(self, scope: Any, receive: Any, send: Any) -> None:
        """This replica's app as its own HTTP server calls it (Serve's ASGI entry point)."""
        await self(scope, receive, send)

    # -- endpoints ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            infos = await asyncio.wait_for(self.router.backend_infos.remote(), timeout=5.0)
        except Exception:  # the router itself is unreachable
            logger.warning("health: the router is unreachable", exc_info=True)
            return JSONResponse({"status": "unavailable", "error": "the router is unreachable"}, 503,
                                headers={"retry-after": str(UNAVAILABLE_RETRY_AFTER_S)})
        body = {"status": "ok" if infos else "unavailable", "model": self.settings.served_model_name,
                "num_pending": self.num_pending, "ingress_replica": self.replica_id,
                "backends": {bid: {"device": i.device, "instance_id": i.instance_id} for bid, i in infos.items()}}
        headers = None if infos else {"retry-after": str(UNAVAILABLE_RETRY_AFTER_S)}
        return JSONResponse(body, status_code=200 if infos else 503, headers=headers)

    @api.get("/metrics")
    async def prometheus_metrics(self) -> Response:
        """Prometheus text of this node's metrics port, open like /health (cluster/metrics_route.py)."""
        return await metrics_response()

    # -- the API's description: FastAPI's, behind the key like every route but the two above ----
    @api.get(OPENAPI_PATH, include_in_schema=False)
    async def openapi_schema(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except TandemError as exc:
            return error_response(exc, _new_request_id())
        schema = request.app.openapi()
        root_path = _root_path(request)
        if root_path and request.app.root_path_in_servers:  # as FastAPI's own route: under a route prefix
            if root_path not in {server.get("url") for server in schema.get("servers", [])}:
                schema = {**schema, "servers": [{"url": root_path}, *schema.get("servers", [])]}
        return JSONResponse(schema)

    @api.get(DOCS_PATH, include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except TandemError as exc:
            return error_response(exc, _new_request_id())
        return get_swagger_ui_html(openapi_url=_root_path(request) + OPENAPI_PATH,
                                   title=f"{request.app.title} - Swagger UI")

    @api.get(REDOC_PATH, include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except TandemError as exc:
            return error_response(exc, _new_request_id())
        return get_redoc_html(openapi_url=_root_path(request) + OPENAPI_PATH, title=f"{request.app.title} - ReDoc")

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except TandemError as exc:
            return error_response(exc, _new_request_id())
        return JSONResponse(ModelList(data=[ModelCard(id=self.settings.served_model_name, max_model_len=self.settings.max_model_len)]).model_dump())

    @api.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Response:
        """One model (`client.models.retrieve`): the served one, or OpenAI's 404 for any other."""
        try:
            self._check_auth(request)
            if model_id != self.settings.served_model_name:
                raise ModelNotFound(f"the model {_echo(model_id)} does not exist; this server serves "
                                    f"{self.settings.served_model_name!r}", param="model", code="model_not_found")
        except TandemError as exc:
            return error_response(exc, _new_request_id())
        return JSONResponse(ModelCard(id=model_id, max_model_len=self.settings.max_model_len).model_dump())

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
        req_id = _new_request_id("chatcmpl" if chat else "cmpl")
        stream: RoutedRequest | None = None
        admitted = handed_over = False
        try:
            body = await self._parse(request, model_cls)
            self._admit()
            admitted = True
            deadline_s = ttft_deadline_s(request, body)
            prompt_token_ids, params, plan = self._prepare(body, chat)
            stream = RoutedRequest(self.router, req_id, prompt_token_ids, params, arrival_time,
                                   self.settings.max_route_attempts, deadline_s)
            await stream.open()
            self._observe_stages(stream)
            if body.stream:
                response = self._streaming_response(stream, body, chat, plan)
                handed_over = True
            else:
                response = await self._full_response(stream, body, chat, plan)
            self._count(endpoint, 200)
            return response
        except TandemError as exc:
            return self._failed(exc, req_id, endpoint, stream)
        except ClientDisconnect:  # gone while sending the body: nobody to answer
            self._count(endpoint, CLIENT_CLOSED_REQUEST)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception:  # a bug: the client gets a 500 with the request id, the log the trace
            logger.exception("request %s: unhandled error", req_id)
            return self._failed(_internal(req_id), req_id, endpoint, stream)
        finally:
            if not handed_over:
                if stream is not None:
                    await stream.close()
                if admitted:
                    self._release()

    def _failed(self, exc: TandemError, req_id: str, endpoint: str, stream: RoutedRequest | None) -> Response:
        response = error_response(exc, req_id, _headers(stream) if stream is not None else None)
        self._count(endpoint, response.status_code)
        return response

    async def _parse(self, request: Request, model_cls: type) -> Any:
        self._check_auth(request)
        check_content_type(request)
        data = parse_json_object(await read_body(request, self.settings.max_request_bytes))
        try:
            body = model_cls.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(p) for p in error["loc"]) or None
            message = f"{param}: {error['msg']}" if param else error["msg"]
            raise InvalidRequestError(message, param=param) from None
        if body.model != self.settings.served_model_name:
            raise ModelNotFound(f"the model {_echo(body.model)} does not exist; this server serves "
                                f"{self.settings.served_model_name!r}", param="model", code="model_not_found")
        return body

    def _admit(self) -> None:
        if self.num_pending >= self.settings.max_pending_requests:
            raise OverloadedError(f"the server is at its limit of {self.settings.max_pending_requests} pending "
                                  "requests; retry shortly", code="too_many_pending_requests")
        self.num_pending += 1
        self.metrics.set("tandem_http_pending_requests", self.num_pending)

    def _check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        sent = request.headers.get("authorization", "").encode("latin-1")  # as Starlette decoded it
        if not hmac.compare_digest(sent, f"Bearer {key}".encode()):
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")

    def _prepare(self, body: Any, chat: bool) -> tuple[list[int], Any, OutputPlan]:
        plan = plan_output(body, getattr(self.tokenizer, "chat_template", None) if chat else None)
        prompt_token_ids = self._tokenize(body, chat, plan.template_tools)
        max_model_len = self.settings.max_model_len
        if len(prompt_token_ids) >= max_model_len:
            raise InvalidRequestError(f"the prompt is {len(prompt_token_ids)} tokens; this model's context is "
                                      f"{max_model_len} tokens", param="messages" if chat else "prompt",
                                      code="context_length_exceeded")
        max_tokens = body.max_tokens
        if max_tokens is None:
            # A chat may fill the context; a completion takes SamplingParams' default (OpenAI's too).
            max_tokens = max_model_len - len(prompt_token_ids) if chat else DEFAULTS.max_tokens
        if len(prompt_token_ids) + max_tokens > max_model_len:
            raise InvalidRequestError(f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({max_tokens}) "
                                      f"is over this model's context of {max_model_len} tokens", param="max_tokens",
                                      code="context_length_exceeded")
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

    def _observe_stages(self, stream: RoutedRequest) -> None:
        for stage, seconds in stream.admission_stages().items():
            self.metrics.observe("tandem_http_stage_seconds", seconds, tags={"stage": stage})
            self.metrics.inc("tandem_http_stage_time_seconds", seconds, tags={"stage": stage})

    def _release(self) -> None:
        self.num_pending -= 1
        self.metrics.set("tandem_http_pending_requests", self.num_pending)

    def _count(self, endpoint: str, status: int) -> None:
        self.metrics.inc("tandem_http_requests", tags={"endpoint": endpoint, "status": str(status)})

    # -- responses ---------------------------------------------------------------------------
    def _info(self, stream: RoutedRequest) -> TandemInfo:
        decision = stream.decision
        return TandemInfo(backend=stream.backend_id, estimated_s=round(decision.estimated_s, 6),
                          projected_ttft_ms=round(decision.projected_ttft_s * 1000, 3))

    async def _full_response(self, stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan) -> JSONResponse:
        choices: dict[int, Choice] = {}
        final = None
        async for out in stream.outputs():
            _check_output(out, stream.req_id)
            choices.setdefault(out.index, Choice()).add(out)
            final = out
        usage = UsageInfo.of(final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens)
        wants_logprobs = body.num_logprobs is not None
        if chat:
            chat_choices = []
            for index, c in sorted(choices.items()):
                content, tool_calls, reason = plan.read(c.text, c.finish_reason)
                logprobs = self.logprobs.chat(c.token_ids, c.logprobs) if wants_logprobs else None
                chat_choices.append(ChatChoice(index=index, message=AssistantMessage(content=content,
                                                                                     tool_calls=tool_calls),
                                               finish_reason=reason, logprobs=logprobs))
            response: Any = ChatCompletionResponse(id=stream.req_id, model=body.model, usage=usage,
                                                   tandem=self._info(stream), choices=chat_choices)
        else:
            response = CompletionResponse(
                id=stream.req_id, model=body.model, usage=usage, tandem=self._info(stream),
                choices=[CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason,
                                          logprobs=self.logprobs.completion(c.token_ids, c.logprobs, 0)
                                          if wants_logprobs else None)
                         for index, c in sorted(choices.items())])
        return JSONResponse(response.model_dump(), headers=_headers(stream))

    def _streaming_response(self, stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan) -> StreamingResponse:
        async def cleanup() -> None:
            await stream.close()
            self._release()

        return _OnceClosedStreamingResponse(self._sse(stream, body, chat, plan), cleanup, media_type="text/event-stream",
                                            headers={**_headers(stream), "cache-control": "no-cache"})

    async def _sse(self, stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan) -> AsyncIterator[str]:
        """Chunks as server-sent events; a failure mid-stream becomes an error event, then [DONE]."""
        created = int(time.time())
        chunk = _ChunkMaker(stream, body.model, created, chat, self._info)
        tool_streams = {i: plan.tool_stream() for i in range(body.n)} if chat else {}
        text_offsets = [0] * body.n
        templates: dict[int, ChunkTemplate] = {}

        def text_event(index: int, text: str, reason: str | None) -> str:
            """A chunk of text only, from this choice's template (the same bytes as `chunk.make`);
            a chat choice's last chunk with no text left has an empty delta, as OpenAI's."""
            if chat and not text:
                return _sse(chunk.make(DeltaMessage(), reason, index))
            template = templates.get(index)
            if template is None:
                template = templates[index] = ChunkTemplate(lambda t, r: chunk.make(_delta(t, chat), r, index))
            return template.event(text, reason)

        try:
            if chat:
                for index in range(body.n):
                    yield _sse(chunk.make(DeltaMessage(role="assistant", content=""), None, index))
            final = None
            try:
                async for out in stream.outputs():
                    _check_output(out, stream.req_id)
                    final = out
                    logprobs = self._chunk_logprobs(out, body, chat, text_offsets) if out.logprobs else None
                    tool_stream = tool_streams.get(out.index)
                    if tool_stream is not None:
                        delta, reason = _tool_delta(tool_stream, out)
                        if delta is not None or logprobs is not None:
                            yield _sse(chunk.make(delta or DeltaMessage(), reason, out.index, logprobs))
                    elif logprobs is not None:
                        yield _sse(chunk.make(_delta(out.new_text, chat), out.finish_reason, out.index, logprobs))
                    elif out.new_text or out.finish_reason:
                        yield text_event(out.index, out.new_text, out.finish_reason)
                if body.include_usage and final is not None:
                    u = final.usage
                    yield _sse(chunk.usage(UsageInfo.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens)))
            except TandemError as exc:
                yield _sse(error_event(exc, stream.req_id))
            except Exception:  # a bug: the stream ends with an error event, the log has the trace
                logger.exception("request %s: unhandled error mid-stream", stream.req_id)
                yield _sse(error_event(_internal(stream.req_id), stream.req_id))
            yield "data: [DONE]\n\n"
        finally:
            await stream.close()  # at once, not when the response object is torn down


    def _chunk_logprobs(self, out: Any, body: Any, chat: bool, text_offsets: list[int]) -> Any:
        """One streamed output's logprobs; completions' text offsets continue per choice."""
        if body.num_logprobs is None:
            return None
        if chat:
            return self.logprobs.chat(out.new_token_ids, out.logprobs)
        logprobs = self.logprobs.completion(out.new_token_ids, out.logprobs, text_offsets[out.index])
        text_offsets[out.index] += sum(len(token) for token in logprobs.tokens)
        return logprobs

    # -- everything else (keep this route the last one of the class) -------------------------
    @api.api_route(CATCH_ALL, methods=ALL_METHODS, include_in_schema=False)
    async def unknown_route(self, request: Request) -> Response:
        """Any other method or path: 401 first when a key is set, so an unauthenticated client
        cannot tell which routes exist; then 405 for a known path, else 404."""
        try:
            self._check_auth(request)
            path = _route_path(request.scope)
            if path in self.known_paths:
                raise MethodNotAllowed(f"{request.method} is not allowed on {path}")
            raise RouteNotFound(f"no such route: {request.method} {path[:MAX_ECHOED_CHARS]}")
        except TandemError as exc:
            return error_response(exc, _new_request_id())

def build_app(router: Any, tokenizer: Any, settings: IngressSettings, access_log: bool = True,
              num_replicas: int = 1, on_this_node: bool = False) -> Any:
    """The Serve application, ready for `serve.run` (`num_replicas` ingress replicas, each
    holding `settings.max_pending_requests` of the limit; `on_this_node`: placed on the node
    that calls this, as replicas serving this machine's port must be)."""
    deployment = TandemIngress.options(num_replicas=num_replicas)
    if on_this_node:
        import ray

        node = f"node:{ray.util.get_node_ip_address()}"
        deployment = deployment.options(ray_actor_options={"num_cpus": 0, "resources": {node: 0.001}})
    if not access_log:
        deployment = deployment.options(logging_config={"enable_access_log": False})
    return deployment.bind(router, tokenizer, settings)


__all__ = ["BACKEND_HEADER", "HTTP_ERRORS", "REQUEST_ID_HEADER", "IngressSettings", "TandemIngress", "build_app"]
