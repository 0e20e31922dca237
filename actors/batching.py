"""Actor calls coalesced per event-loop turn: the calls one process makes in the same turn go
out as one Ray call carrying a list, and each caller awaits its own answer.

Every request costs the router one `place` and its backend one `add`, and under a high rate of
short requests it is Ray's cost per call (a task, its arguments deserialized, its reply
serialized, futures chained across threads), not the work itself, that fills those two serial
processes. A server under load runs many requests' handlers in each turn of its event loop,
so the calls of one turn share one actor call, and the more loaded the caller, the larger the
batches; a lone request's call goes out on the next turn, a few microseconds later.

The actor method takes a list of argument tuples and returns a list of the same length whose
items are results or exceptions (returned, not raised, so one request's error is its own). A
caller cancelled before the flush leaves its call out; one cancelled after it leaves the result
unread, and cleaning up after it (an abort) is the caller's business, as with any Ray call. A
batch is sent from an empty context (actors/detached.py), so Ray's cancelling of the request
whose turn flushed it does not cancel the others' calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.actors.detached import detached


class CallBatcher:
    """Coalesces calls of `method` (an actor method handle) made on the running event loop."""

    def __init__(self, method: Any, *leading: Any) -> None:
        self._method = method
        self._leading = leading  # arguments of every call, before the list
        self._pending: list[tuple[tuple, asyncio.Future]] = []

    async def call(self, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            detached(loop.call_soon, self._flush, loop)  # the batch is no one request's
        self._pending.append((args, future))
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = [(args, future) for args, future in self._pending if not future.cancelled()]
        self._pending = []
        if batch:
            loop.create_task(self._send(batch))

    async def _send(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        try:
            results = await self._method.remote(*self._leading, [args for args, _ in batch])
        except asyncio.CancelledError:  # this loop is closing
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the actor is gone: every caller of the batch hears it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


class NoticeBatcher:
    """Coalesces one-way notices made on the running event loop: the notices of one turn go out
    as one `send(batch)`, a list of the notified items (a one-way actor call, say, or a frame),
    which nobody awaits. A send that fails at once (its arguments do not serialize, say) hands
    the batch and the error to `on_error`; what happens to a sent batch is for the receiver to
    say by other means."""

    def __init__(self, send: Any, on_error: Any = None) -> None:
        self._send = send
        self._on_error = on_error
        self._pending: list = []

    def notify(self, item: Any) -> None:
        if not self._pending:
            detached(asyncio.get_running_loop().call_soon, self._flush)
        self._pending.append(item)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            self._send(batch)
        except Exception as exc:
            if self._on_error is None:
                raise
            self._on_error(batch, exc)
