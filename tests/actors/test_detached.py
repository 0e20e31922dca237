"""Ray cancels what a cancelled request submitted; what is detached from it survives.

Serve cancels a request's actor task when its client hangs up, and Ray cancels with it the
calls that task made. Real actors: a caller actor (standing in for an HTTP ingress) makes a
call to a slow actor in one of three ways, then the driver cancels the caller's request while
the slow call runs. The plain call is cancelled (the premise), a `detached` call and a
`CallBatcher` batch (shared by many requests, so no one request's) run to the end.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.actors.batching import CallBatcher
from tandem.actors.detached import detached

pytestmark = pytest.mark.slow

WORK_S = 1.5


def actor_classes():
    """Defined in a function so that Ray ships them by value (workers cannot import a test module)."""

    class Slow:
        def __init__(self) -> None:
            self.events: dict[str, str] = {}

        async def work(self, tag: str) -> None:
            self.events[tag] = "started"
            try:
                await asyncio.sleep(WORK_S)
            except asyncio.CancelledError:
                self.events[tag] = "cancelled"
                raise
            self.events[tag] = "done"

        async def many(self, tag: str, items: list) -> list:
            await self.work(tag)
            return items

        def seen(self) -> dict[str, str]:
            return dict(self.events)


    class Caller:
        def __init__(self, slow) -> None:
            self.slow = slow
            self.batcher = CallBatcher(slow.many, "batched")

        async def request(self, how: str) -> None:
            if how == "plain":
                self.slow.work.remote("plain")
            elif how == "detached":
                detached(self.slow.work.remote, "detached")
            else:
                asyncio.ensure_future(self.batcher.call(1))
            await asyncio.sleep(60)  # a long stream, until the client hangs up

    return Slow, Caller


def wait_until(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_calls_detached_from_a_cancelled_request_run_to_the_end(ray_local):
    ray = ray_local
    Slow, Caller = actor_classes()
    slow = ray.remote(Slow).options(num_cpus=0).remote()
    caller = ray.remote(Caller).options(num_cpus=0, max_concurrency=100).remote(slow)
    hows = ("plain", "detached", "batched")
    requests = [caller.request.remote(how) for how in hows]
    wait_until(lambda: len(ray.get(slow.seen.remote())) == len(hows))  # every call is running
    for ref in requests:
        ray.cancel(ref)
    outcome = wait_until(lambda: (s := ray.get(slow.seen.remote())) and "started" not in s.values() and s)
    assert outcome == {"plain": "cancelled", "detached": "done", "batched": "done"}
