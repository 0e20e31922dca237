"""CallBatcher without Ray: calls of one event-loop turn share one actor call, and each caller
gets its own answer, error or cancellation (milliseconds)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.actors.batching import CallBatcher, NoticeBatcher


class FakeMethod:
    """An actor method handle: `.remote(*args)` returns an awaitable of `answer(items)`."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)

        async def reply():
            await asyncio.sleep(0)
            return self.answer(args[-1])
        return reply()


def test_one_turns_calls_share_one_actor_call_and_each_gets_its_answer():
    method = FakeMethod(lambda items: [ValueError(f"bad {x}") if x < 0 else 10 * x for (x,) in items])
    batcher = CallBatcher(method, "ch-1")

    async def main():
        return await asyncio.gather(*(batcher.call(x) for x in (1, -2, 3)), return_exceptions=True)

    results = asyncio.run(main())
    assert method.calls == [("ch-1", [(1,), (-2,), (3,)])]
    assert results[0] == 10 and results[2] == 30
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad -2"


def test_calls_of_later_turns_go_in_later_calls():
    method = FakeMethod(lambda items: [x for (x,) in items])
    batcher = CallBatcher(method)

    async def main():
        first = await batcher.call(1)
        second = await asyncio.gather(batcher.call(2), batcher.call(3))
        return first, second

    assert asyncio.run(main()) == (1, [2, 3])
    assert method.calls == [([(1,)],), ([(2,), (3,)],)]


def test_a_caller_cancelled_before_the_flush_is_left_out():
    method = FakeMethod(lambda items: [x for (x,) in items])
    batcher = CallBatcher(method)

    async def main():
        gone = asyncio.ensure_future(batcher.call(1))
        kept = asyncio.ensure_future(batcher.call(2))
        await asyncio.sleep(0)  # both calls are queued
        gone.cancel()
        return await kept

    assert asyncio.run(main()) == 2
    assert method.calls == [([(2,)],)]


def test_a_failed_actor_call_fails_every_caller_of_the_batch():
    def fail(items):
        raise ConnectionError("actor died")

    batcher = CallBatcher(FakeMethod(fail))

    async def main():
        return await asyncio.gather(batcher.call(1), batcher.call(2), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ConnectionError) for r in results)


def test_answers_in_order_even_when_a_batch_is_big():
    batcher = CallBatcher(FakeMethod(lambda items: [x * x for (x,) in items]))

    async def main():
        return await asyncio.gather(*(batcher.call(x) for x in range(500)))

    assert asyncio.run(main()) == [x * x for x in range(500)]


@pytest.mark.parametrize("n", [1, 7])
def test_each_answer_is_its_own_callers(n):
    batcher = CallBatcher(FakeMethod(lambda items: [f"r{x}" for (x,) in items]))

    async def main():
        return await asyncio.gather(*(batcher.call(x) for x in range(n)))

    assert asyncio.run(main()) == [f"r{x}" for x in range(n)]


def test_notices_of_one_turn_go_out_in_one_call_and_an_unsendable_batch_reaches_on_error():
    sent, failed = [], []

    def send(batch):
        if "unpicklable" in batch:
            raise TypeError("cannot serialize")
        sent.append(batch)

    batcher = NoticeBatcher(send, on_error=lambda batch, exc: failed.append((batch, str(exc))))

    async def main():
        batcher.notify("a")
        batcher.notify("b")
        await asyncio.sleep(0)
        batcher.notify("unpicklable")
        await asyncio.sleep(0)

    asyncio.run(main())
    assert sent == [["a", "b"]]
    assert failed == [(["unpicklable"], "cannot serialize")]
