"""The engine core: one `LLMEngine` in its own OS process, so its step loop never shares a GIL.

A backend actor's event loop does serving work (Ray calls, streams, reports) and the engine
does GPU or CPU steps; in one process they take turns on one GIL, and the step loop waits
whenever the serving side runs. Here the engine runs alone in a child process started with
the 'spawn' context (a fresh interpreter: no copy of the actor's Ray state or threads; the
child inherits the environment, so it sees the same `CUDA_VISIBLE_DEVICES`). Its loop is
plain Python, no asyncio and no Ray: take every queued command, step, send outputs.

The wire, both ways, is one `multiprocessing` Pipe carrying pickled plain tuples (measured
cheaper than dataclasses; see `pack_output`):

- front -> core: `(ADD, call_id, req_id, prompt_token_ids, params, arrival_time, detokenize)`,
  `(ABORT, req_id)` (no answer), `(CALL, call_id, name, args)` for the engine's other public
  methods and `profile`, `(STOP,)`.
- core -> front: one `(STEP, replies, outputs, progress, step, cache_changes, stats)` message
  per engine step (or per batch of commands while idle), carrying every request's new tokens
  and text, the router's progress and step timing, and the prefix-cache changes; never one
  message per request. `replies` answers the commands applied since the last message as
  `(call_id, ok, value_or_error)`; an add's value is `(num_prompt_tokens, time queued)`. First
  of all the core sends `(READY, info)`, or `(FAILED, traceback)` if the engine cannot load.

The core dies with its front: it exits when the pipe reaches end-of-file (the front process
is gone, however it died: Ctrl-C, SIGTERM, `ray.kill`) or when it is re-parented; a blocked
send to a dead front fails with a broken pipe and exits as well.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

READY, FAILED, STEP = "ready", "failed", "step"
ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
IDLE_POLL_S = 0.05
STATS_INTERVAL_S = 0.5
# Progress (each changed request's absolute counts) goes out at most this often, and whenever
# the engine goes idle: the front reports it to the router every ~20 ms, so draining it more
# often only builds and pickles every running request's progress on the step loop for the
# front to overwrite before its next report.
PROGRESS_INTERVAL_S = 0.02
MAX_CONSECUTIVE_FAILURES = 3


def pack_output(out: Any) -> tuple:
    """A `RequestOutput` as a plain tuple (pickles in about a third of the time)."""
    u = out.usage
    return (out.req_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason, u.prompt_tokens,
            u.completion_tokens, u.cached_tokens, out.arrival_time, out.first_scheduled_time,
            out.first_token_time, out.finished_time, out.index, out.logprobs)


def unpack_output(t: tuple) -> Any:
    from tandem.engine.outputs import RequestOutput, Usage

    return RequestOutput(t[0], t[1], t[2], t[3], t[4], Usage(t[5], t[6], t[7]), t[8], t[9], t[10], t[11],
                         t[12], t[13])


def merge_packed(outputs: list[tuple]) -> list[tuple]:
    """`merge_outputs` on packed outputs (consecutive ones of one request): one delta per choice,
    in the order of each choice's latest output, without building a `RequestOutput` each."""
    if len(outputs) == 1:
        return outputs
    by_index: dict[int, tuple] = {}
    for t in outputs:
        earlier = by_index.pop(t[12], None)
        if earlier is not None:
            logprobs = earlier[13] if t[13] is None else t[13] if earlier[13] is None else earlier[13] + t[13]
            t = (t[0], earlier[1] + t[1], earlier[2] + t[2], *t[3:13], logprobs)
        by_index[t[12]] = t
    return list(by_index.values())


def pack_progress(p: Any) -> tuple:
    return (p.req_id, p.status, p.num_prompt_tokens, p.num_cached_tokens, p.num_computed_prompt_tokens,
            p.num_output_tokens, p.max_tokens)


def unpack_progress(t: tuple) -> Any:
    from tandem.engine.outputs import RequestProgress

    return RequestProgress(*t)


def stats_totals(st: Any) -> tuple:
    """The stats the front exports as gauges and counters (see actors/metrics.py)."""
    return (st.num_running, st.num_waiting, st.kv_cache_usage, st.num_free_blocks, st.prefix_cache_queries,
            st.prefix_cache_hits, st.num_prompt_tokens_total, st.num_generation_tokens_total, st.num_preemptions)


class CoreDied(RuntimeError):
    """The engine core process exited (crashed, or was killed) while its front still needed it."""


def run_core(conn: Any, engine_kwargs: dict[str, Any], parent_pid: int) -> None:
    """The child's entry point (a module-level function, so 'spawn' can import it)."""
    import signal

    # Ctrl-C reaches the whole process group; the core leaves when its front does (pipe EOF),
    # never in the middle of a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(conn, engine_kwargs, parent_pid)
    except BaseException:
        _send_quietly(conn, (FAILED, traceback.format_exc()))
        return
    core.serve()


def _send_quietly(conn: Any, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:  # the front is gone: nobody to tell
        pass


class EngineCore:
    """The loop of the child process. Everything here runs on its one thread."""

    def __init__(self, conn: Any, engine_kwargs: dict[str, Any], parent_pid: int) -> None:
        from tandem.engine.config import EngineConfig
        from tandem.engine.llm_engine import LLMEngine

        self.conn = conn
        self.parent_pid = parent_pid
        start = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(**engine_kwargs))
        self.replies: list[tuple] = []
        self.running = True
        self.last_stats = 0.0
        self.last_progress = 0.0
        engine, cfg = self.engine, self.engine.config
        conn.send((READY, dict(
            device=str(engine.device), device_kind=engine.device.type,
            dtype=cfg.weight_quantization or str(engine.dtype).removeprefix("torch."), max_active=cfg.max_active,
            block_size=cfg.block_size, num_kv_tokens=engine.num_kv_tokens, cpu_kernels=cfg.cpu_kernels,
            model_name=engine.model_name, max_model_len=engine.max_model_len,
            tokenizer=engine.tokenizer, load_s=time.perf_counter() - start, pid=os.getpid())))

    # -- the loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        failures = 0
        while self.running:
            try:
                self.loop_once()
                failures = 0
            except (EOFError, BrokenPipeError, ConnectionResetError):
                return  # the front is gone: so are we
            except Exception:  # a step failed: the front fails the requests, the engine keeps serving
                failures += 1
                self.fail_all(traceback.format_exc())
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    return

    def loop_once(self) -> None:
        busy = self.engine.has_unfinished_requests()
        self.take_commands(block=not busy)
        if not self.engine.has_unfinished_requests():
            self.send_step([], None)  # replies, and the progress and cache changes of the last step
            return
        start = time.perf_counter()
        outputs = self.engine.step()
        self.send_step(outputs, time.perf_counter() - start)
        if not self.engine.has_unfinished_requests():
            # Idle now: the finished requests' progress goes out at once, and the idle message
            # makes the front report it at once, so the router does not count them as load
            # when the caller's next request comes (a sequential client would see it spill).
            self.send_step([], None, force=True)

    def take_commands(self, block: bool) -> None:
        conn = self.conn
        if not conn.poll(IDLE_POLL_S if block else 0):
            if block and os.getppid() != self.parent_pid:
                raise EOFError("the front process is gone")
            return
        while True:
            self.apply(conn.recv())
            if not self.running or not conn.poll(0):
                return

    def apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == ABORT:
            self.engine.abort_request(command[1])
        elif kind == ADD:
            _, call_id, req_id, prompt_token_ids, params, arrival_time, detokenize = command
            self.answer(call_id, lambda: (self.engine.add_request(req_id, prompt_token_ids, params, arrival_time,
                                                                  detokenize), time.time()))
        elif kind == CALL:
            _, call_id, name, args = command
            self.answer(call_id, lambda: getattr(self, "call_" + name)(*args))
        elif kind == STOP:
            self.running = False

    def answer(self, call_id: int, fn: Any) -> None:
        """Run one command; its result or exception goes back in the next message. A command's
        failure is its caller's error, never the loop's."""
        try:
            self.replies.append((call_id, True, fn()))
        except Exception as exc:
            self.replies.append((call_id, False, exc))

    def send_step(self, outputs: list, elapsed: float | None, force: bool = False) -> None:
        """One message with the step's outputs (`elapsed` None: an idle message, which also
        carries any held progress); nothing when there is nothing to say, unless `force`."""
        engine = self.engine
        step = None
        if elapsed is not None:
            st = engine.get_stats()
            # (prefill tokens, decode tokens, batch size, seconds): the router's online calibration.
            step = (st.step_prefill_tokens, st.step_decode_tokens, st.step_decode_tokens or len(outputs), elapsed)
        now = time.monotonic()
        progress = []
        if elapsed is None or now - self.last_progress >= PROGRESS_INTERVAL_S:
            self.last_progress = now
            progress = [pack_progress(p) for p in engine.drain_progress()]
        cache_changes = engine.drain_cache_changes()
        stats = None
        if now - self.last_stats >= STATS_INTERVAL_S:
            self.last_stats = now
            stats = stats_totals(engine.get_stats())
        if not (force or outputs or progress or cache_changes or self.replies or step or stats):
            return
        replies, self.replies = self.replies, []
        self.conn.send((STEP, replies, [pack_output(o) for o in outputs], progress, step, cache_changes, stats))

    def fail_all(self, trace: str) -> None:
        """A failed step: the front fails every stream and aborts its request (in order, after
        this message), which frees what the engine still holds."""
        replies, self.replies = self.replies, []
        self.conn.send((STEP, replies, [], [], None, {}, None))
        self.conn.send((FAILED, trace))

    # -- calls (CALL name -> call_<name>) ----------------------------------------------------
    def call_abort(self, req_id: str) -> bool:
        return self.engine.abort_request(req_id)

    def call_stats(self) -> Any:
        return self.engine.get_stats()

    def call_set_max_active(self, max_active: int) -> None:
        self.engine.set_max_active(max_active)

    def call_num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        return self.engine.num_cached_tokens(prompt_token_ids)

    def call_cache_snapshot(self) -> list[int]:
        self.engine.drain_cache_changes()  # the snapshot supersedes them
        return self.engine.cached_block_hashes()

    def call_profile(self, max_active: int | None, kwargs: dict[str, Any]) -> tuple[dict[str, Any], tuple]:
        from tandem.engine.profiler import measure_rates

        rates = measure_rates(self.engine, max_active or self.engine.config.max_active, **kwargs)
        self.engine.drain_progress()  # profile requests are not served requests
        self.engine.drain_cache_changes()
        return rates, stats_totals(self.engine.get_stats())


class CoreProcess:
    """The front's handle on its engine core: start it, talk to it, stop it.

    `send` may be called from any thread (a lock keeps messages whole); `recv` from one reader
    thread only. The child is a daemon process: if the front exits normally, multiprocessing
    terminates it; if the front is killed, the child sees the pipe's end-of-file and exits.
    """

    def __init__(self, engine_kwargs: dict[str, Any], name: str = "engine-core") -> None:
        import multiprocessing
        import threading

        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=run_core, args=(child_conn, engine_kwargs, os.getpid()), name=name,
                                    daemon=True)
        with _no_main_reimport():
            self._process.start()
        child_conn.close()  # ours is the only other end: the child's EOF is our death, and ours its
        self._send_lock = threading.Lock()
        self.pid = self._process.pid

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Block until the engine has loaded; returns what it told about itself."""
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                raise CoreDied(f"engine core exited with code {self._process.exitcode} while loading")
            if time.monotonic() > deadline:
                self.kill()
                raise CoreDied(f"engine core did not load within {timeout_s:.0f} s")
        kind, payload = self._conn.recv()
        if kind != READY:
            self.kill()
            raise CoreDied(f"engine core failed to start:\n{payload}")
        return payload

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def recv(self) -> tuple:
        return self._conn.recv()

    def exitcode(self) -> int | None:
        self._process.join(timeout=1.0)
        return self._process.exitcode

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the core to exit after its current step; kill it if it does not."""
        try:
            self.send((STOP,))
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
