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

This module is the ingress's routes and its request path; the parts of that path are each in
their own module: the request edge, from an HTTP request to the engine request it asks for
(cluster/request_edge.py); the errors, one class per meaning mapped to HTTP once
(cluster/errors.py); the x-tandem-* headers (cluster/headers.py); and the answer, whole
(cluster/responses.py) or streamed as server-sent events (cluster/streaming.py). A body never
carries internals: an error's detail goes to the server log under the request id that the body
and the `x-tandem-request-id` header also carry.

The ingress holds no model state beyond the tokenizer, which it gets from a backend at start
(the engine's own tokenizer object, so prompts tokenize exactly as `tandem generate` does).
Admission is a bound on requests admitted here and not yet finished: when it is reached the
server answers 429 at once instead of queueing without limit.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run
time to tell a `Request` parameter from a query parameter. And everything the ingress class
uses is defined above it or imported: Serve serializes the class when it is decorated.)
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tandem.actors.metrics import INGRESS_METRICS, Recorder
from tandem.cluster.choices import LogprobsFormatter
from tandem.cluster.dispatch import RoutedRequest
from tandem.cluster.errors import (MAX_ECHOED_CHARS, UNAVAILABLE_RETRY_AFTER_S, MethodNotAllowed, RouteNotFound,
                                   error_response, internal_error)
from tandem.cluster.headers import routed_headers, server_timing
from tandem.cluster.http_server import ReplicaHTTPServer
from tandem.cluster.metrics_route import metrics_response
from tandem.cluster.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tandem.cluster.request_edge import RequestEdge, new_request_id, ttft_deadline_s
from tandem.cluster.responses import full_response
from tandem.cluster.streaming import streaming_response
from tandem.engine.errors import InvalidRequestError, OverloadedError, TandemError

logger = logging.getLogger("tandem.app")

CLIENT_CLOSED_REQUEST = 499  # nginx's code, in the request counter only: no client reads it
CATCH_ALL = "/{path:path}"
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


@api.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    failure = {404: RouteNotFound, 405: MethodNotAllowed}.get(exc.status_code, InvalidRequestError)
    return error_response(failure(f"{request.method} {request.url.path[:MAX_ECHOED_CHARS]}: "
                                  f"{'not found' if exc.status_code == 404 else 'not allowed'}"),
                          new_request_id())


@api.exception_handler(Exception)
async def _unhandled_exception(request: Request, exc: Exception) -> JSONResponse:
    request_id = new_request_id()
    logger.error("request %s: unhandled error on %s", request_id, request.url.path, exc_info=exc)
    return error_response(internal_error(request_id), request_id)


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
        self.settings = settings
        self.edge = RequestEdge(tokenizer, settings.served_model_name, settings.max_model_len, settings.api_key,
                                settings.max_request_bytes)
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
            self.edge.check_auth(request)
        except TandemError as exc:
            return error_response(exc, new_request_id())
        schema = request.app.openapi()
        root_path = _root_path(request)
        if root_path and request.app.root_path_in_servers:  # as FastAPI's own route: under a route prefix
            if root_path not in {server.get("url") for server in schema.get("servers", [])}:
                schema = {**schema, "servers": [{"url": root_path}, *schema.get("servers", [])]}
        return JSONResponse(schema)

    @api.get(DOCS_PATH, include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        try:
            self.edge.check_auth(request)
        except TandemError as exc:
            return error_response(exc, new_request_id())
        return get_swagger_ui_html(openapi_url=_root_path(request) + OPENAPI_PATH,
                                   title=f"{request.app.title} - Swagger UI")

    @api.get(REDOC_PATH, include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        try:
            self.edge.check_auth(request)
        except TandemError as exc:
            return error_response(exc, new_request_id())
        return get_redoc_html(openapi_url=_root_path(request) + OPENAPI_PATH, title=f"{request.app.title} - ReDoc")

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.edge.check_auth(request)
        except TandemError as exc:
            return error_response(exc, new_request_id())
        return JSONResponse(ModelList(data=[ModelCard(id=self.settings.served_model_name, max_model_len=self.settings.max_model_len)]).model_dump())

    @api.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str) -> Response:
        """One model (`client.models.retrieve`): the served one, or OpenAI's 404 for any other."""
        try:
            self.edge.check_auth(request)
            self.edge.check_model(model_id)
        except TandemError as exc:
            return error_response(exc, new_request_id())
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
        req_id = new_request_id("chatcmpl" if chat else "cmpl")
        stream: RoutedRequest | None = None
        admitted = handed_over = False
        try:
            body = await self.edge.parse(request, model_cls)
            self._admit()
            admitted = True
            deadline_s = ttft_deadline_s(request, body)
            prompt_token_ids, params, plan = self.edge.prepare(body, chat)
            stream = RoutedRequest(self.router, req_id, prompt_token_ids, params, arrival_time,
                                   self.settings.max_route_attempts, deadline_s)
            await stream.open()
            self._observe_stages(stream)
            if body.stream:
                response = streaming_response(stream, body, chat, plan, self.logprobs, self._release)
                handed_over = True
            else:
                response = await full_response(stream, body, chat, plan, self.logprobs)
            self._count(endpoint, 200)
            return response
        except TandemError as exc:
            return self._failed(exc, req_id, endpoint, stream, arrival_time)
        except ClientDisconnect:  # gone while sending the body: nobody to answer
            self._count(endpoint, CLIENT_CLOSED_REQUEST)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception:  # a bug: the client gets a 500 with the request id, the log the trace
            logger.exception("request %s: unhandled error", req_id)
            return self._failed(internal_error(req_id), req_id, endpoint, stream, arrival_time)
        finally:
            if not handed_over:
                if stream is not None:
                    await stream.close()
                if admitted:
                    self._release()

    def _failed(self, exc: TandemError, req_id: str, endpoint: str, stream: RoutedRequest | None,
                received_s: float) -> Response:
        headers = {**(routed_headers(stream) if stream is not None else {}), **server_timing(received_s, time.time())}
        response = error_response(exc, req_id, headers)
        self._count(endpoint, response.status_code)
        return response

    def _admit(self) -> None:
        if self.num_pending >= self.settings.max_pending_requests:
            raise OverloadedError(f"the server is at its limit of {self.settings.max_pending_requests} pending "
                                  "requests; retry shortly", code="too_many_pending_requests")
        self.num_pending += 1
        self.metrics.set("tandem_http_pending_requests", self.num_pending)

    def _observe_stages(self, stream: RoutedRequest) -> None:
        for stage, seconds in stream.admission_stages().items():
            self.metrics.observe("tandem_http_stage_seconds", seconds, tags={"stage": stage})
            self.metrics.inc("tandem_http_stage_time_seconds", seconds, tags={"stage": stage})

    def _release(self) -> None:
        self.num_pending -= 1
        self.metrics.set("tandem_http_pending_requests", self.num_pending)

    def _count(self, endpoint: str, status: int) -> None:
        self.metrics.inc("tandem_http_requests", tags={"endpoint": endpoint, "status": str(status)})

    # -- everything else (keep this route the last one of the class) -------------------------
    @api.api_route(CATCH_ALL, methods=ALL_METHODS, include_in_schema=False)
    async def unknown_route(self, request: Request) -> Response:
        """Any other method or path: 401 first when a key is set, so an unauthenticated client
        cannot tell which routes exist; then 405 for a known path, else 404."""
        try:
            self.edge.check_auth(request)
            path = _route_path(request.scope)
            if path in self.known_paths:
                raise MethodNotAllowed(f"{request.method} is not allowed on {path}")
            raise RouteNotFound(f"no such route: {request.method} {path[:MAX_ECHOED_CHARS]}")
        except TandemError as exc:
            return error_response(exc, new_request_id())


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


__all__ = ["IngressSettings", "TandemIngress", "build_app"]
