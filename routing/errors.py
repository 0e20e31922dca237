"""Errors the routing package raises, with messages a user can act on.

`ConfigError` is raised at the file edge (rate profiles, scenarios) and always names the
offending field, e.g. ``backends.0.rates.prefill_tok_s: must be > 0 (got -1)``, so a typo in a
YAML file is a one-line fix. `NoBackendError` is raised when a policy has nowhere to send a
request (no backends, or `cpu-only` without a CPU backend).
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
