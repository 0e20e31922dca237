"""The engine's request error, in a module of its own so that every module that validates a
request (sampling_params.py, structured_output.py) can raise it without importing another."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never serve; the message names the offending field."""
