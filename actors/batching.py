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
unread, and cleaning up after it (an abort) is the caller's business, as with any Ray call.

With `streaming=True` the method is an actor generator instead, yielding lists of
`(index, result_or_exception)` as answers become ready, so an early answer is not held back by
the batch's slowest one: a backend's `add_many` answers each request when the engine admits it,
and in a burst some are admitted steps before others.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CallBatcher:
    """Coalesces calls of `method` (an actor method handle) made on the running event loop."""

    def __init__(self, method: Any, *leading: Any, streaming: bool = False) -> None:
        self._method = method
        self._leading = leading  # arguments of every call, before the list
        self._streaming = streaming
        self._pending: list[tuple[tuple, asyncio.Future]] = []

    async def call(self, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush, loop)
        self._pending.append((args, future))
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = [(args, future) for args, future in self._pending if not future.cancelled()]
        self._pending = []
        if batch:
            loop.create_task(self._send(batch))

    async def _send(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        futures = [future for _, future in batch]
        items = [args for args, _ in batch]
        try:
            if self._streaming:
                gen = self._method.options(num_returns="streaming").remote(*self._leading, items)
                async for ref in gen:
                    for index, result in await ref:
                        _answer(futures[index], result)
                error: Exception = RuntimeError("the batched call ended without answering")
            else:
                for future, result in zip(futures, await self._method.remote(*self._leading, items)):
                    _answer(future, result)
                return
        except asyncio.CancelledError:  # this loop is closing
            for future in futures:
                future.cancel()
            raise
        except Exception as exc:  # the actor is gone: every caller still waiting hears it
            error = exc
        for future in futures:
            if not future.done():
                future.set_exception(error)


def _answer(future: asyncio.Future, result: Any) -> None:
    if future.done():  # its caller was cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
