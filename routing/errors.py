"""Errors the routing package raises, with messages a user can act on.

`ConfigError` is raised at the file edge (rate profiles, scenarios) and always names the
offending field, e.g. ``backends.0.rates.prefill_tok_s: must be > 0 (got -1)``, so a typo in a
YAML file is a one-line fix. `NoBackendError` is raised when a policy has nowhere to send a
request (no backends, or `cpu-only` without a CPU backend). `DeadlineRefusedError` is the
router's refusal of a request whose TTFT deadline no routable backend meets, whether they are
busy or even an idle one would miss it; it carries the best projection and when to retry, and
pickles with them. It never reaches a client: the router actor translates it, once, into the
caller's error (actors/router.py `deadline_error`: retry later, or never), which the HTTP edge
maps to a status.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A profile or scenario file (or CLI value) is invalid; the message names the field."""


class NoBackendError(RuntimeError):
    """The policy has no eligible backend for this request."""


def format_validation_errors(source: str, errors: list[dict[str, Any]]) -> str:
    """Render pydantic's `ValidationError.errors()` as one line per field path.

    Takes the plain list (not the exception) so this module stays free of pydantic.
    """
    lines = [f"invalid {source}:"]
    for error in errors:
        field = ".".join(str(part) for part in error.get("loc", ())) or "(top level)"
        message = error.get("msg", "invalid value")
        if error.get("type") == "missing":
            message = "required field is missing"
        elif "input" in error and not isinstance(error["input"], (dict, list)):
            message = f"{message} (got {error['input']!r})"
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


class DeadlineRefusedError(RuntimeError):
    """The router refused the request: no routable backend projects a time to first token
    within its deadline.

    `backend_id` is the backend with the best projection, `projected_ttft_s` that projection,
    `retry_after_s` the seconds until its work ahead drains enough to meet the deadline, or
    None when even an idle backend would miss it (the request's own prefill is too long).
    `record` is the router's DecisionRecord (not pickled: the process that raised logs it).
    """

    def __init__(self, req_id: str, backend_id: str, ttft_deadline_s: float, projected_ttft_s: float,
                 retry_after_s: float | None, record: Any = None) -> None:
        self.req_id = req_id
        self.backend_id = backend_id
        self.ttft_deadline_s = ttft_deadline_s
        self.projected_ttft_s = projected_ttft_s
        self.retry_after_s = retry_after_s
        self.record = record
        when = ("even on an idle backend; shorten the prompt or relax the deadline" if retry_after_s is None
                else f"while backends are busy; retry in {retry_after_s:.3f} s")
        super().__init__(
            f"request {req_id}: time to first token deadline {ttft_deadline_s * 1000:.0f} ms cannot be met "
            f"{when} (best projection {projected_ttft_s * 1000:.0f} ms on {backend_id})")

    def __reduce__(self) -> tuple:
        return (type(self), (self.req_id, self.backend_id, self.ttft_deadline_s, self.projected_ttft_s,
                             self.retry_after_s))
