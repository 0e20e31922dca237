"""The engine core: one `LLMEngine` in its own OS process, so its step loop never shares a GIL
with a Ray actor, and the process that serves its callers' channels.

A backend actor's event loop does control-plane work (Ray calls, reports, restarts) and the
engine does GPU or CPU steps; in one process they take turns on one GIL, and the step loop
waits whenever the serving side runs. Here the engine runs in a child process started with
the 'spawn' context (a fresh interpreter: no copy of the actor's Ray state or threads; the
child inherits the environment, so it sees the same `CUDA_VISIBLE_DEVICES`). Its main thread
is the step loop, plain Python, no asyncio and no Ray: take every queued command, step, post
the step's news to the I/O thread.

A request's data goes straight between its caller and this process: the core serves the
callers' channels itself on the same-node wire (actors/core_io.py runs the socket I/O on its
own thread; actors/fanout.py admits and batches), so a step's tokens leave in one frame
per caller with no hop through the actor. vLLM's engine core talks to its front end the same
way (a local socket, serialized on an output thread).

The core pipe to the backend actor, both ways one `multiprocessing` Pipe carrying the typed
messages of actors/messages.py in their one codec, is the control plane:

- actor -> core: `EngineCoreCall` for the engine's other public methods (`abort` among them)
  and `profile`, `EngineCoreStop`.
- core -> actor: first `EngineCoreReady` (with the wire's address), or `EngineCoreFailed` if
  the engine cannot load; then one `EngineCoreOutputs` per engine step (or per batch of
  commands while idle): the router's progress, the step's timing, the prefix-cache changes,
  the finished requests' timings and the control calls' answers, never the requests' tokens.

The core dies with its actor: it exits when the pipe reaches end-of-file (the actor's process
is gone, however it died: Ctrl-C, SIGTERM, `ray.kill`) or when it is re-parented; its callers
then see their wires close. If the core dies, the actor sees the pipe end and exits too.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any

from tandem.actors.core_io import CoreIO, FrontGone, StepNews
from tandem.actors.fanout import Abort
from tandem.actors.messages import (CallReply, EngineCoreCall, EngineCoreFailed, EngineCoreOutputs,
                                    EngineCoreReady, EngineCoreRequest, EngineCoreStop, Message, StatsTotals,
                                    StepTiming, decode, encode)
from tandem.engine.errors import BackendError

IDLE_POLL_S = 0.05
STATS_INTERVAL_S = 0.5
# Progress (each changed request's absolute counts) goes out at most this often, and whenever
# the engine goes idle: the front reports it to the router every ~20 ms, so draining it more
# often only builds and encodes every running request's progress for the front to overwrite
# before its next report.
PROGRESS_INTERVAL_S = 0.02
MAX_CONSECUTIVE_FAILURES = 3


def sim_timing(engine_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The step time and the host KV tier's reload time of a sim backend, from the profile the
    plan passes with its engine's settings (`sim_profile`, taken out of them: the engine knows no
    profiles); None for either that does not apply."""
    profile = engine_kwargs.pop("sim_profile", None)
    if profile is None:
        return None, None
    from tandem.routing.step_time import sim_profile_from_dict

    model = sim_profile_from_dict(profile).step_time()
    return model.step_s, (model.reload_s if model.host_reload_tok_s is not None else None)


def run_core(conn: Any, backend_id: str, engine_kwargs: dict[str, Any], parent_pid: int) -> None:
    """The child's entry point (a module-level function, so 'spawn' can import it)."""
    import signal

    # Ctrl-C reaches the whole process group; the core leaves when its front does (pipe EOF),
    # never in the middle of a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(conn, backend_id, engine_kwargs, parent_pid)
    except BaseException:
        _send_quietly(conn, EngineCoreFailed(traceback.format_exc()))
        return
    core.serve()


def _send_quietly(conn: Any, message: Message) -> None:
    try:
        conn.send_bytes(encode(message))
    except OSError:  # the front is gone: nobody to tell
        pass


class EngineCore:
    """The step loop: everything here runs on the process's main thread, the only one that
    touches the engine. Commands come from `io.inbox` (the core pipe's and the channels'),
    each step's news goes to `io.post`."""

    def __init__(self, conn: Any, backend_id: str, engine_kwargs: dict[str, Any], parent_pid: int) -> None:
        from tandem.engine.config import EngineConfig
        from tandem.engine.llm_engine import LLMEngine

        self.backend_id = backend_id
        self.parent_pid = parent_pid
        start = time.perf_counter()
        engine_kwargs = dict(engine_kwargs)
        step_time, reload_time = sim_timing(engine_kwargs)
        self.engine = LLMEngine(EngineConfig(**engine_kwargs), step_time=step_time, reload_time=reload_time)
        self.added: list[tuple[str, int, float]] = []
        self.refused: list[tuple[str, BaseException]] = []
        self.replies: list[CallReply] = []
        self.running = True
        self.stopped = False  # its actor asked it to stop (rather than going away)
        self.last_stats = 0.0
        self.last_progress = 0.0
        engine, cfg = self.engine, self.engine.config
        # The pipe's first message is this one: the I/O thread starts sending only after it.
        self.io = CoreIO(backend_id, conn)
        conn.send_bytes(encode(EngineCoreReady(
            device=cfg.device if engine.is_sim else str(engine.device), device_kind=engine.device_kind,
            dtype=cfg.weight_quantization or str(engine.dtype).removeprefix("torch."), max_active=cfg.max_active,
            block_size=cfg.block_size, num_kv_tokens=engine.num_kv_tokens, cpu_kernels=cfg.cpu_kernels,
            model_name=engine.model_name, max_model_len=engine.max_model_len,
            max_priority_wait_s=cfg.max_priority_wait_s, tokenizer=engine.tokenizer,
            load_s=time.perf_counter() - start, pid=os.getpid(), wire_address=self.io.address)))

    # -- the loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        failures = 0
        while self.running:
            try:
                self.loop_once()
                failures = 0
            except EOFError:
                break  # the front is gone: so are we
            except Exception:  # a step failed: its requests fail, the engine keeps serving
                failures += 1
                self.fail_all(traceback.format_exc())
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    break
        self.io.close(BackendError(f"backend {self.backend_id} is shutting down") if self.stopped else None)

    def loop_once(self) -> None:
        busy = self.engine.has_unfinished_requests()
        self.take_commands(block=not busy)
        if not self.engine.has_unfinished_requests():
            self.post_step([], None, idle=True)  # answers, and the progress and cache changes of the last step
            return
        num_tokens_before = self.num_tokens_done()
        outputs = self.engine.step()
        self.post_step(outputs, self.step_timing(num_tokens_before, len(outputs)))
        if not self.engine.has_unfinished_requests():
            # Idle now: the finished requests' progress goes out at once, and the idle message
            # makes the front report it at once, so the router does not count them as load
            # when the caller's next request comes (a sequential client would see it spill).
            self.post_step([], None, idle=True, force=True)

    def take_commands(self, block: bool) -> None:
        inbox = self.io.inbox
        try:
            command = inbox.get(timeout=IDLE_POLL_S) if block else inbox.get_nowait()
        except queue.Empty:
            if block and os.getppid() != self.parent_pid:
                raise EOFError("the front process is gone") from None
            return
        while True:
            self.apply(command)
            if not self.running:
                return
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                return

    def apply(self, command: Any) -> None:
        if isinstance(command, list):  # a channel frame's requests
            for request in command:
                self.add(request)
        elif isinstance(command, Abort):
            self.engine.abort_request(command.req_id)
        elif isinstance(command, EngineCoreCall):
            try:
                value = getattr(self, "call_" + command.name)(*command.args)
            except Exception as exc:  # a command's failure is its caller's error, never the loop's
                self.replies.append(CallReply.of(command.call_id, False, exc))
            else:
                self.replies.append(CallReply.of(command.call_id, True, value))
        elif isinstance(command, EngineCoreStop):
            self.running, self.stopped = False, True
        elif isinstance(command, FrontGone):
            raise EOFError("the front process is gone")

    def add(self, request: EngineCoreRequest) -> None:
        """Queue a request; its channel hears the answer with the next step's news."""
        try:
            num_prompt_tokens = self.engine.add_request(request.req_id, request.prompt_token_ids, request.params,
                                                        request.arrival_time)
        except Exception as exc:
            self.refused.append((request.req_id, exc))
        else:
            self.added.append((request.req_id, num_prompt_tokens, time.time()))

    def num_tokens_done(self) -> int:
        st = self.engine.get_stats()
        return st.num_prompt_tokens_total + st.num_generation_tokens_total

    def step_timing(self, num_tokens_before: int, num_outputs: int) -> StepTiming | None:
        """The step that finished in this `engine.step()` call, as the engine timed it; None when
        none did. With asynchronous scheduling a call can launch a step and finish none (the
        first after an idle spell), and a call's wall time is not its step's: the engine's own
        measure is (its share of the wall from launch, or from the previous step's end), and
        the router's calibration must see only finished steps, each with its own time."""
        st = self.engine.get_stats()
        if st.num_prompt_tokens_total + st.num_generation_tokens_total == num_tokens_before:
            return None
        # (prefill tokens, decode tokens, batch size, seconds): the router's online calibration.
        return StepTiming(st.step_prefill_tokens, st.step_decode_tokens, st.step_decode_tokens or num_outputs,
                          st.step_time_s)

    def post_step(self, outputs: list, step: StepTiming | None, idle: bool = False, force: bool = False) -> None:
        """Hand the I/O thread the step's outputs, the adds' fates and the control message
        (`step`: the step that finished, if one did; `idle`: the engine has nothing to run, and
        the message also carries any held progress); nothing when there is nothing to say,
        unless `force`."""
        control = self.control_message(step, idle, force)
        if not (outputs or self.added or self.refused or control):
            return
        added, self.added = self.added, []
        refused, self.refused = self.refused, []
        self.io.post(StepNews(outputs, added, refused, control))

    def control_message(self, step: StepTiming | None, idle: bool, force: bool) -> EngineCoreOutputs | None:
        """The actor's share of a step: timing, progress, cache changes, stats, call replies."""
        engine = self.engine
        now = time.monotonic()
        progress = []
        if idle or now - self.last_progress >= PROGRESS_INTERVAL_S:
            self.last_progress = now
            progress = engine.drain_progress()
        cache_changes = engine.drain_cache_changes()
        stats = None
        if now - self.last_stats >= STATS_INTERVAL_S:
            self.last_stats = now
            stats = StatsTotals.of(engine.get_stats())
        if not (force or progress or cache_changes or self.replies or step or stats):
            return None
        replies, self.replies = self.replies, []
        return EngineCoreOutputs(replies=replies, progress=progress, step=step, cache_changes=cache_changes,
                                 stats=stats)

    def fail_all(self, trace: str) -> None:
        """A failed step: the I/O thread fails every channel request and aborts it (after the
        answers already due), which frees what the engine still holds."""
        added, self.added = self.added, []
        refused, self.refused = self.refused, []
        replies, self.replies = self.replies, []
        self.io.post(StepNews([], added, refused, EngineCoreOutputs(replies=replies)))
        self.io.post_failure(trace)

    # -- calls (CALL name -> call_<name>) ----------------------------------------------------
    def call_abort(self, req_id: str) -> bool:
        return self.engine.abort_request(req_id)

    def call_stats(self) -> Any:
        return self.engine.get_stats()

    def call_num_channel_requests(self) -> int:
        """Requests the channels still hold (not finished, not aborted): zero when idle."""
        return len(self.io.fanout.channel_of)

    def call_set_max_active(self, max_active: int) -> None:
        self.engine.set_max_active(max_active)

    def call_num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        return self.engine.num_cached_tokens(prompt_token_ids)

    def call_cache_snapshot(self) -> list[int]:
        self.engine.drain_cache_changes()  # the snapshot supersedes them
        return self.engine.cached_block_hashes()

    def call_profile(self, max_active: int | None, kwargs: dict[str, Any]) -> tuple[dict[str, Any], StatsTotals]:
        from tandem.engine.profiler import measure_rates

        if self.engine.has_unfinished_requests() or self.io.fanout.channel_of:
            raise BackendError(f"backend {self.backend_id} is serving requests; profile it idle")
        rates = measure_rates(self.engine, max_active or self.engine.config.max_active, **kwargs)
        self.engine.drain_progress()  # profile requests are not served requests
        self.engine.drain_cache_changes()
        return rates, StatsTotals.of(self.engine.get_stats())


class CoreProcess:
    """The front's handle on its engine core: start it, talk to it, stop it.

    `send` may be called from any thread (a lock keeps messages whole); `recv` from one reader
    thread only. The child is a daemon process: if the front exits normally, multiprocessing
    terminates it; if the front is killed, the child sees the pipe's end-of-file and exits.
    """

    def __init__(self, backend_id: str, engine_kwargs: dict[str, Any]) -> None:
        import multiprocessing
        import threading

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=run_core, args=(child_conn, backend_id, engine_kwargs, os.getpid()),
                                    name=f"engine-core-{backend_id}", daemon=True)
        with _no_main_reimport():
            self._process.start()
        child_conn.close()  # ours is the only other end: the child's EOF is our death, and ours its
        self._send_lock = threading.Lock()
        self.pid = self._process.pid

    def wait_ready(self, timeout_s: float) -> EngineCoreReady:
        """Block until the engine has loaded; returns what it told about itself."""
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                raise BackendError(f"engine core exited with code {self._process.exitcode} while loading")
            if time.monotonic() > deadline:
                self.kill()
                raise BackendError(f"engine core did not load within {timeout_s:.0f} s")
        message = self.recv()
        if not isinstance(message, EngineCoreReady):
            self.kill()
            raise BackendError(f"engine core failed to start:\n{getattr(message, 'traceback', message)}")
        return message

    def send(self, message: Message) -> None:
        data = encode(message)
        with self._send_lock:
            self._conn.send_bytes(data)

    def recv(self) -> Message:
        return decode(self._conn.recv_bytes())

    def exitcode(self) -> int | None:
        self._process.join(timeout=1.0)
        return self._process.exitcode

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the core to exit after its current step; kill it if it does not."""
        try:
            self.send(EngineCoreStop())
        except (OSError, ValueError):
            pass
        self._process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._conn.close()


class _no_main_reimport:
    """'spawn' re-imports the parent's `__main__` in the child, which in a Ray worker is Ray's
    worker script (slow, and nothing the core needs): hide it while the child starts."""

    def __enter__(self) -> None:
        import sys

        self.main = sys.modules["__main__"]
        self.saved = {k: getattr(self.main, k) for k in ("__file__", "__spec__") if hasattr(self.main, k)}
        self.main.__spec__ = None
        if hasattr(self.main, "__file__"):
            del self.main.__file__

    def __exit__(self, *exc: Any) -> None:
        for key, value in self.saved.items():
            setattr(self.main, key, value)
