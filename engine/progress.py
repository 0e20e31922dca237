"""Progress bars that stay readable in a log file.

The first start converts a GGUF (transformers' "Converting and de-quantizing GGUF tensors"
and "Loading weights" bars) or downloads a model from the hub (huggingface_hub's bars), all
tqdm bars writing to `sys.stderr`. On a terminal they redraw one line. Written to a file or a
pipe, which is where a Ray backend actor's stderr always goes (Ray forwards its lines to the
console of `tandem serve`), tqdm still writes its redraws: a carriage return before each
status, and cursor movement (`ESC[A`) for bars below the first, so a log holds one long line
of overwritten statuses and escape codes.

`plain_progress()` is the fix, wrapped around the code that shows such bars: when `sys.stderr`
is not a terminal, it stands in for it with `PlainLines`, which writes each bar's status as a
line of its own, at most one every `interval_s` (the first and the last always), with no
carriage returns, no escape sequences and no bar drawing (`|█████▌    |`, which says nothing
the percentage does not): `Loading weights: 100% 272/272 [00:00<00:00, 21757.43it/s]`. On a
terminal it changes nothing.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

# A CSI escape sequence (cursor movement, colours, erase): ESC [ parameters intermediates final.
_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_BREAKS = re.compile(r"(\r|\n)")
# tqdm's bar between the percentage and the counts: `|`, blocks (unicode, or ascii's digits and
# `#`) and spaces, `|`.
_BAR = re.compile(r"(\d%)\|[ #0-9\u2588-\u258f]*\|")
DEFAULT_INTERVAL_S = 5.0


class PlainLines(io.TextIOBase):
    """A text stream in front of `stream` that turns tqdm's redraws into plain lines.

    Text between carriage returns or newlines is a status; a status ended by a newline (a log
    line, a bar's final state) is written at once, one ended by a carriage return (a redraw)
    only if `interval_s` passed since the last line written, else kept until the next; a blank
    status (a bar clearing itself) writes the one kept. `finish()` writes what is still kept.
    """

    def __init__(self, stream: TextIO, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._partial = ""  # text since the last carriage return or newline
        self._kept: str | None = None  # the latest redraw not written yet
        self._last_line: str | None = None
        self._last_time: float | None = None

    @property
    def encoding(self) -> str | None:  # tqdm draws unicode blocks if the stream's encoding allows
        return getattr(self._stream, "encoding", None)

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            for piece in _BREAKS.split(_CSI.sub("", text)):
                if piece == "\n":
                    self._status(self._partial, final=True)
                    self._partial = ""
                elif piece == "\r":
                    self._status(self._partial, final=False)
                    self._partial = ""
                else:
                    self._partial += piece
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def finish(self) -> None:
        """Write the kept redraw and any unterminated text."""
        with self._lock:
            if self._partial.strip():
                self._status(self._partial, final=True)
            self._partial = ""
            self._write_kept()
            self._stream.flush()

    def _status(self, text: str, final: bool) -> None:
        text = _BAR.sub(r"\1", text).rstrip()
        if not text:  # a bar cleared itself, or a blank line
            self._write_kept()
            return
        now = self._clock()
        if final or self._last_time is None or now - self._last_time >= self._interval_s:
            self._kept = None
            self._write_line(text, now)
        else:
            self._kept = text

    def _write_kept(self) -> None:
        if self._kept is not None:
            text, self._kept = self._kept, None
            self._write_line(text, self._clock())

    def _write_line(self, text: str, now: float) -> None:
        self._last_time = now
        if text != self._last_line:  # a bar closing repeats its last redraw
            self._stream.write(text + "\n")
        self._last_line = text


def _is_terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def plain_progress(interval_s: float = DEFAULT_INTERVAL_S) -> Iterator[None]:
    """Within this block, progress bars written to `sys.stderr` come out as plain lines when it
    is not a terminal (see the module's docstring); on a terminal, nothing changes."""
    stream = sys.stderr
    if stream is None or _is_terminal(stream):
        yield
        return
    plain = PlainLines(stream, interval_s)
    try:
        with contextlib.redirect_stderr(plain):
            yield
    finally:
        plain.finish()
