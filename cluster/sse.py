"""Server-sent events for a stream's text chunks, from a template instead of a model per token.

A streamed response sends one chunk per step per request: at a few hundred streams that is tens
of thousands of chunks a second, all built in the one ingress process. Building each as the
pydantic chunk model, dumping it to a dict and encoding the dict costs ~20-30 us; only the text
and the finish reason change from one chunk of a stream to the next (the id, model, created,
index and the `tandem` object do not). So `ChunkTemplate` renders the stream's chunk once
through the reference path with two sentinel values, cuts the JSON around them, and afterwards
encodes just the two values into the gaps: the same bytes as the reference path (a test checks
it), at the cost of two `json.dumps` of short values.

Chunks that carry more than text (logprobs, tool calls, the role of a chat's first chunk,
usage) keep the reference path, and so does a chat's last chunk with no text left, whose delta
is empty rather than an empty string's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_TEXT = "\x00tandem-text\x00"
_REASON = "\x00tandem-reason\x00"


def sse_event(payload: dict[str, Any]) -> str:
    """The reference encoding of one event."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ChunkTemplate:
    """`event(text, finish_reason)` == `sse_event(make(text, finish_reason))` for one stream.

    `make` is the reference chunk builder for this stream (text and finish reason in, the
    chunk's dict out). If the rendered template does not hold each sentinel exactly once (a
    builder that transforms its input), `event` falls back to `make`."""

    def __init__(self, make: Callable[[str, str | None], dict[str, Any]]) -> None:
        self._make = make
        doc = json.dumps(make(_TEXT, _REASON), separators=(",", ":"))
        text_at, reason_at = _find_once(doc, json.dumps(_TEXT)), _find_once(doc, json.dumps(_REASON))
        self._parts: tuple[str, str, str] | None = None
        self._text_first = True
        if text_at is None or reason_at is None:
            return
        text_len, reason_len = len(json.dumps(_TEXT)), len(json.dumps(_REASON))
        if text_at < reason_at:
            self._parts = (doc[:text_at], doc[text_at + text_len:reason_at], doc[reason_at + reason_len:])
        else:
            self._text_first = False
            self._parts = (doc[:reason_at], doc[reason_at + reason_len:text_at], doc[text_at + text_len:])

    @property
    def is_fast(self) -> bool:
        return self._parts is not None

    def event(self, text: str, finish_reason: str | None) -> str:
        parts = self._parts
        if parts is None:
            return sse_event(self._make(text, finish_reason))
        first, second = (text, finish_reason) if self._text_first else (finish_reason, text)
        return f"data: {parts[0]}{json.dumps(first)}{parts[1]}{json.dumps(second)}{parts[2]}\n\n"


def _find_once(doc: str, needle: str) -> int | None:
    at = doc.find(needle)
    if at < 0 or doc.find(needle, at + 1) >= 0:
        return None
    return at
