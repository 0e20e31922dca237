"""The HTTP edge's errors: its own refusals, and the one mapping of every error class to HTTP.

Errors are raised as one exception class per meaning, engine/errors.py's (which every layer
raises, so a failure keeps its meaning from where it happened to the client) plus the few only
HTTP has, defined here, each its own class because each has its own status. `HTTP_ERRORS`
translates each class, once, into a status code, an OpenAI error type and, for 429 and 503, a
`Retry-After`; `error_response` and `error_event` are the only two places that apply it, for a
response and for the last event of a stream that already started.

A body never carries internals (tracebacks, pids, actor ids): an error's `detail` goes to the
server log under the request id that the body's `error.request_id` and the
`x-tandem-request-id` header also carry. A request the engine failed on its own (an output
finished with reason "error", engine/output_processor.py: its grammar, its sampling or its
detokenizing raised, and the other requests went on) is a 500 like any internal error
(`check_output`); the backend's log has the trace under the same request id.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi.responses import JSONResponse

from tandem.cluster.headers import PROJECTED_TTFT_HEADER, REQUEST_ID_HEADER
from tandem.cluster.protocol import error_body
from tandem.engine.errors import (BackendUnavailableError, DeadlineUnmetError, InvalidRequestError, OverloadedError,
                                  TandemError)

logger = logging.getLogger("tandem.app")  # the ingress's one logger, whichever of its modules writes

# Retry-After: a full admission queue drains within about a request's time; a failed backend's
# requests fail over at once, and a restarted backend rejoins in seconds (docs/cluster.md).
OVERLOADED_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 2
MAX_ECHOED_CHARS = 64  # of a client's own value quoted back in an error message
# engine/output_processor.py's FINISH_REASON_ERROR (not imported: the ingress does not load torch).
ENGINE_ERROR_REASON = "error"


# The HTTP edge's own refusals: client errors (InvalidRequestError) that only the ingress raises.
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


def internal_error(request_id: str) -> TandemError:
    """What a client learns of a bug: a 500 naming the request id its trace is logged under."""
    return TandemError(f"internal error; the server logged it under request id {request_id}")


def check_output(out: Any, request_id: str) -> None:
    """Raise `TandemError` for an output the engine ended with an error."""
    if out.finish_reason == ENGINE_ERROR_REASON:
        raise TandemError(f"the request failed while generating; the server logged it under request id "
                          f"{request_id}", detail=f"the engine ended choice {out.index} with an error")


def echo(value: str) -> str:
    """A client's value quoted back, short enough for an error message."""
    return repr(value if len(value) <= MAX_ECHOED_CHARS else value[:MAX_ECHOED_CHARS] + "...")
