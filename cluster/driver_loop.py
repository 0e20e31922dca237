"""The event loop behind the Python driver's `Tandem.generate`, and its clean end.

`generate` is a plain iterator over an async stream, so the stream runs on an event loop of
its own, in a daemon thread. Some tasks on that loop outlive every request: the reader of each
backend's channel (actors/channel.py) and of the router's same-node wire (actors/wire.py)
serve all later requests of the process. Stopping the loop with them still pending leaves them
to the garbage collector, which at interpreter exit prints "Task was destroyed but it is
pending!" for each, and their sockets are never closed. `close()` cancels every task still on
the loop and waits for them (each reader closes its socket and fails its requests as it ends),
then stops the thread and closes the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CLOSE_TIMEOUT_S = 10.0


class DriverLoop:
    """An event loop running in a thread of its own: `run(coro)` from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tandem-driver", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed() or not self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result, run on the loop; this thread waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Cancel what still runs on the loop, let it finish, then stop and close the loop."""
        if self.closed:
            return
        try:
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(timeout_s)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            pass  # a task that ignores its cancel: stop the loop anyway
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_the_rest(rounds: int = 3) -> None:
    """Cancel every other task and wait for them; again for any their cleanup started."""
    current = asyncio.current_task()
    for _ in range(rounds):
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        if not tasks:
            break
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
