"""A backend actor's handle on its engine core process: start it, send it control calls, read
what it sends back, and notice when it dies.

The core (actors/engine_core.py) runs the engine in its own process and serves its callers'
channels itself; this is the actor's side of the core pipe between them, the control plane.
Two threads use it: the actor's event loop sends commands and awaits control calls (`call`),
and one reader thread, started by `start_reading`, receives the core's messages (one
`EngineCoreOutputs` per engine step: progress, timing, cache changes, replies) and hands each
to the actor's `on_message`, then answers the control calls it carries. When the pipe ends (the
core crashed or was killed), `on_exit` runs on the reader thread: the actor exits, so that Ray
restarts the backend with a fresh core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, Callable

from tandem.actors.engine_core import CoreProcess
from tandem.actors.messages import CallReply, EngineCoreCall, EngineCoreReady, Message
from tandem.engine.errors import BackendError

logger = logging.getLogger("tandem.backend")

CORE_START_TIMEOUT_S = 600.0


class CoreClient:
    """Starts the engine core and blocks until it has loaded (`ready` says what it is)."""

    def __init__(self, backend_id: str, engine_kwargs: dict[str, Any]) -> None:
        self.backend_id = backend_id
        self.process = CoreProcess(backend_id, engine_kwargs)
        self.ready: EngineCoreReady = self.process.wait_ready(CORE_START_TIMEOUT_S)
        self.pid = self.process.pid
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()

    def start_reading(self, on_message: Callable[[Message], None], on_exit: Callable[[], None]) -> None:
        """Start the reader thread: every message goes to `on_message` (its exceptions are
        logged, the thread reads on), the end of the pipe to `on_exit`."""
        thread = threading.Thread(target=self._read, args=(on_message, on_exit), daemon=True,
                                  name=f"core-reader-{self.backend_id}")
        thread.start()

    def send(self, message: Message) -> None:
        """Send a command; BackendError if the core is gone (the reader thread fails the rest)."""
        try:
            self.process.send(message)
        except (OSError, ValueError):
            self._calls.pop(getattr(message, "call_id", None), None)
            raise BackendError(f"backend {self.backend_id}: its engine core is not running") from None

    async def call(self, name: str, *args: Any) -> Any:
        """Run the core's `call_<name>(*args)` between two steps and return its result."""
        loop = asyncio.get_running_loop()
        call_id, future = next(self._call_ids), loop.create_future()
        self._calls[call_id] = (loop, future)
        self.send(EngineCoreCall(call_id, name, list(args)))
        return await future

    def answer(self, replies: list[CallReply]) -> None:
        """From the reader thread: resolve the calls these replies answer, one wake-up per loop."""
        by_loop: dict[Any, list] = {}
        for reply in replies:
            waiting = self._calls.pop(reply.call_id, None)
            if waiting is not None:
                loop, future = waiting
                by_loop.setdefault(loop, []).append((future, reply.ok, reply.value))
        for loop, answers in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, answers)

    def fail_calls(self, error: BaseException) -> None:
        """From the reader thread: every call in flight raises `error` (the core is gone)."""
        calls, self._calls = self._calls, {}
        by_loop: dict[Any, list] = {}
        for loop, future in calls.values():
            by_loop.setdefault(loop, []).append((future, False, error))
        for loop, answers in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, answers)

    def exitcode(self) -> int | None:
        return self.process.exitcode()

    def stop(self) -> None:
        self.process.stop()

    def _read(self, on_message: Callable[[Message], None], on_exit: Callable[[], None]) -> None:
        while True:
            try:
                message = self.process.recv()
            except (EOFError, OSError):
                on_exit()
                return
            try:
                on_message(message)
            except Exception:  # the actor's own bookkeeping failed: log it, keep serving
                logger.exception("backend %s: handling the engine core's message failed", self.backend_id)


def _resolve_all(answers: list[tuple[asyncio.Future, bool, Any]]) -> None:
    """On the event loop: answer the calls' futures. A caller cancelled meanwhile (its client
    hung up) has a cancelled future, which is left alone."""
    for future, ok, value in answers:
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
