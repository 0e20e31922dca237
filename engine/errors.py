"""Tandem's request errors: one small hierarchy, one class per meaning.

Every layer raises these (the engine when it refuses a request, the backend actors when they
fail under one, the dispatch and the ingress), so a request's failure keeps its meaning from
where it happened to the client: the ingress maps each class to an HTTP status once
(cluster/errors.py `HTTP_ERRORS`). They live at the bottom layer so that every layer can import
them without importing another. `message` is for the client and never holds internals (a
traceback's last line, a pid, an actor id); `detail`, when set, is for the server log only.
"""

from __future__ import annotations


class TandemError(Exception):
    """A request could not be served, for a reason the server got wrong or cannot say (a 500)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.detail = message, param, code, detail


class InvalidRequestError(TandemError):
    """The request itself is wrong; sending it again unchanged will fail again. The message
    names the offending field."""


class OverloadedError(TandemError):
    """The server is at its limit of pending requests; the request was not queued."""


class BackendUnavailableError(TandemError):
    """No backend can serve the request now (none alive, or the one serving it failed)."""


class BackendError(TandemError):
    """A backend failed while serving a request: its engine failed, its engine core exited, or
    it is shutting down."""


class BackendGoneError(BackendError):
    """The same-node wire to a backend closed under a request (actors/wire.py): the backend's
    process is gone, as a `RayActorError` says on the Ray path, and the request may be routed
    again if it has no tokens yet."""


class DeadlineUnmetError(OverloadedError):
    """No backend can meet the request's time-to-first-token deadline while they are this busy
    (routing/deadline.py): `projected_ttft_s` is the best projection, `retry_after_s` the
    seconds until the work ahead drains enough to meet it. A deadline that even an idle
    backend would miss is the request's own fault, an `InvalidRequestError`."""

    def __init__(self, message: str, projected_ttft_s: float, retry_after_s: float) -> None:
        super().__init__(message, param="ttft_deadline_ms", code="deadline_unmet")
        self.projected_ttft_s, self.retry_after_s = projected_ttft_s, retry_after_s

    def __reduce__(self) -> tuple:
        return (type(self), (self.message, self.projected_ttft_s, self.retry_after_s))
