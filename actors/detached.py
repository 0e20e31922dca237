"""Ray calls and asyncio tasks that belong to no request.

Ray cancels recursively: cancelling an actor task also cancels the tasks it submitted that
have not finished. Inside an async actor, "the task that submitted a call" is read from a
context variable, so a call belongs to whichever request's context it was made in, and so does
every asyncio task (and `call_soon` callback) started from that context, since those copy it.
Serve cancels a request's task when its client hangs up, and with it went:

- the abort that cleans up after that very request, when it was sent a moment before Serve's
  cancel and had not run yet: the request ran to its last token, holding its blocks;
- a batch of calls flushed in that request's turn (other requests' routes and adds);
- a reader or watcher task the request happened to start first, which serves every later
  request of the process (a channel's `subscribe` stream, the router wire's reader).

`detached(fn, *args)` runs `fn` in an empty context, so what it submits or starts has no
parent request. Everything shared by many requests, or that must outlive the one it cleans up
after, starts this way.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def detached(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a fresh, empty context (e.g. `detached(loop.create_task, coro)`,
    `detached(loop.call_soon, callback)`, `detached(handle.abort.remote, req_id)`)."""
    return contextvars.Context().run(fn, *args)
