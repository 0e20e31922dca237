"""A backend front's detokenization and stop strings: the text of its requests' outputs, made
outside the engine core.

The engine core's step loop is the busiest thread of a busy GPU backend, and turning each
request's new token into text (and looking for stop strings in it) is per-request Python on
every step. So a backend's front asks its core for token ids only (`add_request(...,
detokenize=False)`) and fills in the text here, in its reader thread, from the same
`IncrementalDetokenizer` the engine would have used: the text is the same, chunk for chunk. A
stop string found here ends the request's stream at once (finish reason "stop", its text cut
before the stop string, as the engine does) and is returned so the front aborts the request in
the core; whatever the core still sends for it (a token or two already under way, then the
abort's last output) is dropped. Requests with several choices (`n > 1`) keep their text in
the engine, which aborts one choice without the others; their outputs pass through untouched.

Opt-in, with `TANDEM_FRONT_DETOKENIZE=1`. The engine makes the text by default because, with
this on, the client-disconnect test (tests/cluster/test_serve_failures.py) fails intermittently
under load (an aborted request's blocks not freed in time) for a reason not yet found, and the
saving is small where detokenizing is a table lookup per token (byte-level tokenizers); the
measurement is in docs/benchmarks/served-path-h200.md, "Detokenization out of the engine core".
"""

from __future__ import annotations

import os
import time
from typing import Any

from tandem.engine.detokenizer import ByteTable, IncrementalDetokenizer

FRONT_DETOKENIZE_ENV = "TANDEM_FRONT_DETOKENIZE"


def front_detokenizes() -> bool:
    return os.environ.get(FRONT_DETOKENIZE_ENV, "0") == "1"


class OutputText:
    """The text of one front's requests. `track` runs on the front's event loop, `apply` on its
    reader thread; each only adds or removes whole dict entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        ByteTable.of(tokenizer)  # built once (~0.1 s for a large vocabulary), not on a first request
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._stopped: set[str] = set()  # ended here by a stop string; the core's last words are dropped

    def track(self, req_id: str, prompt_token_ids: list[int], params: Any) -> bool:
        """Take over the text of a request about to be added; returns the engine's `detokenize`
        flag for it (False when this front makes its text)."""
        if params.n > 1:
            return True
        self._detokenizers[req_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        return False

    def forget(self, req_id: str) -> None:
        """The request will send no outputs (its add was refused)."""
        self._detokenizers.pop(req_id, None)

    def clear(self) -> None:
        self._detokenizers.clear()
        self._stopped.clear()

    def apply(self, outputs: list[tuple]) -> tuple[list[tuple], list[str]]:
        """The core's packed outputs (actors/engine_core.py) with their text, and the ids of the
        requests a stop string has just ended, which the caller aborts in the core."""
        detokenizers, stopped = self._detokenizers, self._stopped
        result: list[tuple] = []
        ended: list[str] = []
        for t in outputs:
            req_id = t[0]
            if req_id in stopped:
                if t[3]:  # the core's last output of a request that ended here
                    stopped.discard(req_id)
                continue
            detokenizer = detokenizers.get(req_id)
            if detokenizer is None:  # its text came from the engine
                result.append(t)
                continue
            finished = t[3]
            if detokenizer.add_tokens(t[1]):  # a stop string: the stream ends here
                del detokenizers[req_id]
                if not finished:
                    stopped.add(req_id)
                    ended.append(req_id)
                result.append((req_id, t[1], detokenizer.take_new_text(True), True, "stop", *t[5:11],
                               t[11] or time.time(), *t[12:]))
                continue
            if finished:
                del detokenizers[req_id]
            result.append((req_id, t[1], detokenizer.take_new_text(finished), *t[3:]))
        return result, ended
