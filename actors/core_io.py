"""The engine core's I/O thread: the core pipe's reading end and the callers' channels, so the
step loop does no socket work and never waits for a caller.

The step loop (actors/engine_core.py) owns the engine; everything that talks to the outside
world runs here, on one thread with its own asyncio event loop:

- the same-node wire's server (actors/wire.py): each caller process connects once per
  backend, presents the token, opens its channel (`ChannelOpen`) and sends `ChannelAdds`
  frames; the channels' bookkeeping and admissions are actors/fanout.py's;
- the core pipe from the backend actor: control calls, aborts and the stop, queued for the
  step loop as they come; its end-of-file (the actor is gone) stops the step loop;
- once per step, what the step loop posts (`StepNews`): the step's outputs go to their
  channels, one frame per channel, and its control message (progress, timing, cache changes,
  call replies, the finished requests' timings) to the actor over the core pipe.

Commands reach the step loop through one thread-safe queue (`inbox`), in the order they came;
an abort queued after an add is applied after it. The step loop hands steps over through a
queue of its own: a step wakes the I/O thread (`call_soon_threadsafe`, a self-pipe write) only
if no drain is due yet; while one is (the thread is still handling earlier steps), it only
appends, and that drain handles it too. Both threads share the process's GIL, and each wake-up
is a system call across which the busy I/O thread takes the GIL from the step loop, so a step
loop that outruns its I/O thread pays for no wake-ups it does not need; the news are handled
in order either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tandem.actors import wire
from tandem.actors.fanout import Abort, ChannelState, Fanout
from tandem.actors.messages import (ChannelAdds, ChannelOpen, EngineCoreFailed, EngineCoreOutputs,
                                    FinishedRequest, Message, decode, encode)
from tandem.engine.errors import BackendError

logger = logging.getLogger("tandem.backend")

FLUSH_TIMEOUT_S = 2.0


class FrontGone:
    """Queued for the step loop when the core pipe ends: its backend actor is gone."""


@dataclass
class StepNews:
    """What one step (or one batch of commands while idle) leaves for the I/O thread: the
    step's outputs (`RequestOutput`s), the adds applied (req_id, num_prompt_tokens, queued
    time) or refused (req_id, error), and the control message for the actor (None: nothing
    to tell it)."""

    outputs: list = field(default_factory=list)
    added: list = field(default_factory=list)
    refused: list = field(default_factory=list)
    control: EngineCoreOutputs | None = None


class CoreIO:
    """Starts the I/O thread and its wire server; `address` is where callers connect."""

    def __init__(self, backend_id: str, conn: Any) -> None:
        self.backend_id = backend_id
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.fanout = Fanout(backend_id, self.inbox.put)
        self.server = wire.WireServer()
        self.loop = asyncio.new_event_loop()
        self._channels: set[ChannelState] = set()
        self._news: deque[StepNews] = deque()  # posted, not yet handled
        self._drain_due = False  # a `_drain_news` is scheduled and will see what is queued
        self._news_lock = threading.Lock()
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True, name="core-io")
        self._thread.start()
        started.result()  # the server's error, if it could not start

    @property
    def address(self) -> tuple[str, bytes]:
        return self.server.address

    # -- the step loop's side ------------------------------------------------------------------
    def post(self, news: StepNews) -> None:
        """Queue a step's news; wake the I/O thread unless a drain is already due."""
        with self._news_lock:
            self._news.append(news)
            wake, self._drain_due = not self._drain_due, True
        if wake:
            self.loop.call_soon_threadsafe(self._drain_news)

    def post_failure(self, trace: str) -> None:
        """A step failed: fail every channel request (the engine aborts them) and tell the actor."""
        self.loop.call_soon_threadsafe(self._on_failure, trace)

    def close(self, error: BaseException | None) -> None:
        """Stop serving: with `error`, every open request hears it first and what was written
        goes out (the core stops on its actor's request); None: the actor is gone, the sockets
        just close with the process."""
        if error is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shut(error), self.loop).result(FLUSH_TIMEOUT_S)
            except Exception:  # a caller that takes nothing: it hears the wire close instead
                logger.warning("backend %s: channels not flushed before the core stopped", self.backend_id)

    # -- the I/O thread ------------------------------------------------------------------------
    def _run(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start(self._serve_channel))
            self.loop.add_reader(self.conn.fileno(), self._read_pipe)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        self.loop.run_forever()

    def _read_pipe(self) -> None:
        try:
            while True:
                self.inbox.put(decode(self.conn.recv_bytes()))
                if not self.conn.poll(0):
                    return
        except (EOFError, OSError):
            self.loop.remove_reader(self.conn.fileno())
            self.inbox.put(FrontGone())

    def _send(self, message: Message) -> None:
        try:
            self.conn.send_bytes(encode(message))
        except OSError:  # the actor is gone; the pipe's end-of-file stops the step loop
            pass

    def _drain_news(self) -> None:
        """Handle every queued step's news, in order, including what is posted meanwhile."""
        while True:
            with self._news_lock:
                if not self._news:
                    self._drain_due = False
                    return
                news = self._news.popleft()
            self._on_news(news)

    def _on_news(self, news: StepNews) -> None:
        self.fanout.on_step(news.added, news.refused, news.outputs)
        control = news.control
        if control is not None:
            control.finished = [FinishedRequest.of(o) for o in news.outputs if o.finished]
            self._send(control)

    def _on_failure(self, trace: str) -> None:
        last_line = trace.strip().splitlines()[-1]
        req_ids = self.fanout.fail_all(BackendError(f"backend {self.backend_id}: engine failed: {last_line}"))
        for req_id in req_ids:
            self.inbox.put(Abort(req_id))
        self._send(EngineCoreFailed(trace))

    async def _shut(self, error: BaseException) -> None:
        self.fanout.stopping = True
        self.fanout.fail_all(error)
        self.server.close()
        for channel in list(self._channels):
            if channel.writer is not None:
                channel.writer.close()
        await asyncio.gather(*(c.writer.wait_closed() for c in self._channels if c.writer is not None),
                             return_exceptions=True)

    async def _serve_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One caller's channel: its first frame is a `ChannelOpen`, the others `ChannelAdds`.
        The caller closing the socket closes the channel, which aborts its unfinished requests."""
        try:
            opened = await wire.read_frame(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            opened = None
        if not isinstance(opened, ChannelOpen):
            writer.close()
            return
        channel = ChannelState(opened.channel_id, writer)
        self._channels.add(channel)
        try:
            while True:
                adds = await wire.read_frame(reader)
                if not isinstance(adds, ChannelAdds):
                    raise TypeError(f"expected ChannelAdds, got {type(adds).__name__}")
                self.fanout.add(channel, adds.requests)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller is gone
        except Exception:  # a frame that does not decode: this caller's wire is broken
            logger.exception("backend %s: bad frame on channel %s", self.backend_id, opened.channel_id)
        finally:
            self._channels.discard(channel)
            self.fanout.close(channel)
            writer.close()

