"""Placing a request without asking the router, when there is nothing to decide.

With one routable backend (a single-GPU server, or `accelerator-only` beside a CPU backend that
takes nothing), every `place` answers the same, and waiting for it costs each request a Ray
round trip (about 1.5 ms on an idle H200 host, more under load) before its add can start. Each
caller process instead keeps the router's current fixed choice, learnt by a long poll
(`RouterActor.watch_fixed_choice`) that the router answers whenever membership, policy or
cordons change. While there is one, a request goes straight to that backend, and the router
hears of it afterwards in a batched, one-way note (`RouterActor.note_placed_many`), which places
it in the ledger exactly as `place` would have. A retry after a failure always asks the router.

The view lags the router by one message: a request sent in that window goes where the previous
answer said, which is where `place` would have sent it a moment earlier.

Opt-in (`TANDEM_FIXED_CHOICE=1`, read per request by cluster/dispatch.py). Measured on the H200
machine with one GPU backend: with it, a lone request's TTFT through HTTP was +5.4..6.0 ms over
the engine (three runs; +7.6..8.3 before it and the channel admissions of actors/backend.py
landed together; the router's `place` is 1.8..2.5 ms of a request's time in the driver). But
at 1,000 short requests/s from 4 client processes the server completed 863/s and shed 10% of
them (429) where asking the router completed 964/s and shed none, one run each. A likely
cause, not yet measured: without the router's round trip the adds reach the backend actor,
the busiest process, as more and smaller calls. Making it the default needs that settled
first (e.g. by coalescing adds that come faster than the backend takes them).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tandem.actors.batching import NoticeBatcher
from tandem.actors.detached import detached

logger = logging.getLogger("tandem.fixed_choice")


class FixedChoice:
    """One event loop's view of one router's fixed choice, and its notes to that router."""

    _views: dict[tuple[int, Any], FixedChoice] = {}

    def __init__(self, router: Any) -> None:
        self.router = router
        self.choice: tuple[str, str] | None = None  # (backend id, instance id)
        self.notes = NoticeBatcher(router.note_placed_many.remote, on_error=_note_failed)
        self._task = detached(asyncio.get_running_loop().create_task, self._watch())

    @classmethod
    def of(cls, router: Any) -> FixedChoice:
        """The running event loop's view of `router` (started on first use)."""
        key = (id(asyncio.get_running_loop()), getattr(router, "_actor_id", None) or id(router))
        view = cls._views.get(key)
        if view is None or view._task.done():
            view = cls._views[key] = cls(router)
        return view

    def place(self, req_id: str, prompt_token_ids: list[int], max_tokens: int) -> tuple[str, str] | None:
        """(backend id, instance id) if the choice is fixed, after noting the request for the
        router; None if the router must decide (or its answer has not come yet)."""
        choice = self.choice
        if choice is not None:
            self.notes.notify(req_id, prompt_token_ids, max_tokens, 1)
        return choice

    async def _watch(self) -> None:
        version = -1
        try:
            while True:
                version, backend_id, instance_id = await self.router.watch_fixed_choice.remote(version)
                self.choice = (backend_id, instance_id) if backend_id is not None else None
        except asyncio.CancelledError:  # the loop is closing
            self.choice = None
            raise
        except Exception:  # the router is gone: every request asks it, and hears that
            self.choice = None
            logger.debug("watching the router's fixed choice stopped", exc_info=True)


def _note_failed(batch: list[tuple], error: BaseException) -> None:
    """The router could not be told (it is gone: every next request asks it, and hears that)."""
    logger.warning("could not note %d requests to the router: %s", len(batch), error)
