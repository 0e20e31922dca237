"""The engine core process behind a real Ray backend actor: streaming over the per-caller
channel (the same-node wire, served by the core itself), aborts, callers cancelled at random
moments, the warm-up's way of loading a backend, and the core's life tied to its actor's (no
orphan after `ray.kill`; a restarted actor starts a fresh core; a killed core closes its
callers' wires and its actor exits). In-process: the core's per-step messages to its actor,
and a failed step."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import random
import socket
import time
from typing import Any

import pytest

from tandem.actors.messages import Admitted
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tests.conftest import is_gone

ENGINE = dict(model="tiny-llama-random", device="cpu", max_active=4, block_size=16)


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def make_backend(ray, name: str, max_restarts: int = 0):
    from tandem.actors.backend import BackendActor

    actor = ray.remote(BackendActor).options(name=name, num_cpus=0, max_concurrency=1000,
                                              max_restarts=max_restarts, max_task_retries=0).remote(name, ENGINE, 1)
    ray.get(actor.ping.remote())  # waits for the core to load
    return actor


@pytest.fixture(scope="module")
def backend(ray_local):
    actor = make_backend(ray_local, "core-test")
    yield actor
    ray_local.kill(actor, no_restart=True)


def wait_until(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


async def read_all(stream) -> list:
    items = [await stream.next()]
    while not getattr(items[-1], "finished", False):
        items.append(await stream.next())
    return items


def test_requests_together_on_a_channel_stream_the_greedy_tokens_of_each_alone(backend):
    from tandem.actors.channel import open_stream

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"p{i}": list(range(20 + 9 * i, 50 + 9 * i)) for i in range(6)}

    async def all_at_once(tag: str):
        streams = [open_stream(backend, f"{tag}-{r}", ids, params, time.time()) for r, ids in prompts.items()]
        return await asyncio.gather(*(read_all(s) for s in streams))

    async def one_by_one():
        return [await read_all(open_stream(backend, f"solo-{r}", ids, params, time.time()))
                for r, ids in prompts.items()]

    by_channel = run(all_at_once("ch"))
    alone = run(one_by_one())
    for a, b in zip(by_channel, alone):
        assert isinstance(a[0], Admitted) and isinstance(b[0], Admitted)
        tokens_a = [t for o in a[1:] for t in o.new_token_ids]
        assert tokens_a == [t for o in b[1:] for t in o.new_token_ids] and len(tokens_a) == 12
        assert a[-1].finish_reason == "length" and all(o.new_token_ids for o in a[1:])


def test_a_rejected_request_fails_its_add_and_the_channel_keeps_serving(backend):
    from tandem.actors.channel import open_stream

    async def both():
        bad = open_stream(backend, "too-long", [1, 2, 3], SamplingParams(max_tokens=5000), time.time())
        with pytest.raises(InvalidRequestError, match="context length"):
            await bad.next()
        good = open_stream(backend, "fine", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), time.time())
        return await read_all(good)

    assert run(both())[-1].finished


def test_abort_ends_a_channel_stream_with_reason_abort(backend):
    """On a loaded machine the tiny model can finish its 900 tokens before the abort reaches the
    core (the abort then says it found nothing and the stream ends at its length): that try is
    made again, and one of three must end aborted."""
    from tandem.actors.channel import open_stream

    async def abort_midway(req_id: str) -> tuple[bool, Any]:
        stream = open_stream(backend, req_id, list(range(70, 90)),
                             SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True), time.time())
        await stream.next()  # Admitted: the request runs
        aborted = await backend.abort.remote(req_id)
        while True:
            out = await stream.next()
            if out.finished:
                return aborted, out

    for attempt in range(3):
        aborted, last = run(abort_midway(f"to-abort-{attempt}"))
        if aborted:
            break
        assert last.finish_reason == "length"  # it finished before the abort came
    assert aborted and last.finish_reason == "abort"


def test_callers_cancelled_at_random_moments_free_everything(ray_local, backend):
    """Each caller gives up after a random delay (during the add, before or after its first
    token, or never); the dispatch layer's close() then aborts it, as the HTTP ingress does.
    Afterwards nothing runs, no block is held, and the backend serves on."""
    from tandem.actors.channel import open_stream

    rng = random.Random(7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def caller(i: int) -> None:
        stream = open_stream(backend, f"rnd-{i}", list(range(5 + i, 40 + i)), params, time.time())
        try:
            await asyncio.wait_for(read_all(stream), timeout=rng.choice([0.0, 0.001, 0.01, 0.05, 0.2, 5.0]))
        except asyncio.TimeoutError:
            backend.abort.remote(f"rnd-{i}")
        finally:
            stream.close()

    async def many():
        await asyncio.gather(*(caller(i) for i in range(48)))

    run(many())

    def idle():
        stats = ray_local.get(backend.stats.remote())
        return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0

    wait_until(idle, "every cancelled request to be freed")

    async def one_more():
        return await read_all(open_stream(backend, "after", [4, 5, 6], params, time.time()))

    assert run(one_more())[-1].finished


def test_run_to_end_loads_a_backend_without_the_router_and_returns_when_all_finished(ray_local, backend):
    """The warm-up's and the benchmarks' way to load a backend: every request has finished when
    it returns, on its own event loop even if the caller has one running."""
    from tandem.actors.channel import run_to_end

    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 to cache

    async def from_a_running_loop():
        run_to_end([(backend, f"load-{i}", prompt, params) for i in range(6)])

    run(from_a_running_loop())
    stats = ray_local.get(backend.stats.remote())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert ray_local.get(backend.num_cached_tokens.remote(prompt + [7])) == 32


def test_the_core_dies_with_its_actor(ray_local):
    actor = make_backend(ray_local, "core-kill")
    pid = ray_local.get(actor.core_pid.remote())
    assert pid != os.getpid() and not is_gone(pid)
    ray_local.kill(actor, no_restart=True)
    wait_until(lambda: is_gone(pid), "the engine core to exit after ray.kill")


def test_a_restarted_actor_starts_a_fresh_core_and_serves(ray_local):
    from tandem.actors.channel import open_stream

    actor = make_backend(ray_local, "core-restart", max_restarts=1)
    old_pid, old_instance = ray_local.get([actor.core_pid.remote(), actor.ping.remote()])
    ray_local.kill(actor, no_restart=False)
    wait_until(lambda: is_gone(old_pid), "the old engine core to exit")

    def restarted():
        try:
            return ray_local.get(actor.ping.remote(), timeout=5) != old_instance
        except Exception:  # still restarting
            return False

    wait_until(restarted, "Ray to restart the backend", timeout_s=120)
    assert ray_local.get(actor.core_pid.remote()) != old_pid

    async def serve():
        return await read_all(open_stream(actor, "after-restart", [7, 8, 9],
                                          SamplingParams(max_tokens=4, temperature=0.0), time.time()))

    assert run(serve())[-1].finished
    ray_local.kill(actor, no_restart=True)


def test_killing_the_core_closes_its_callers_wires_and_its_actor_exits(ray_local):
    """Callers talk to the core directly, so its death reaches them as their wire closing
    (`BackendGoneError`, which the ingress fails over), and the actor exits for Ray to restart
    the pair."""
    import signal

    from tandem.actors.channel import open_stream
    from tandem.engine.errors import BackendGoneError

    actor = make_backend(ray_local, "core-killed")
    pid = ray_local.get(actor.core_pid.remote())

    async def killed_midway():
        stream = open_stream(actor, "doomed", list(range(30, 50)),
                             SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True), time.time())
        assert isinstance(await stream.next(), Admitted)
        await stream.next()  # streaming
        os.kill(pid, signal.SIGKILL)
        while True:
            await stream.next()

    with pytest.raises(BackendGoneError):
        run(killed_midway())

    def actor_gone():
        try:
            ray_local.get(actor.ping.remote(), timeout=5)
            return False
        except ray_local.exceptions.RayActorError:
            return True

    wait_until(actor_gone, "the actor to exit after its core died")


@dataclasses.dataclass
class InProcessCore:
    """An engine core run in this process, one step per `loop_once()`: its pipe's other end
    (`front`, what the actor would hold) and a caller connected to its wire, past the handshake
    (`caller`, plus `token`, which the caller's first frame must start with)."""

    engine_core: Any
    front: Any
    child: Any
    caller: socket.socket
    token: bytes

    @classmethod
    def start(cls) -> InProcessCore:
        from tandem.actors import engine_core as core
        from tandem.actors.messages import EngineCoreReady, decode

        front, child = multiprocessing.Pipe()
        engine_core = core.EngineCore(child, "b", dict(ENGINE), os.getppid())  # in-process: its "front" is ours
        ready = decode(front.recv_bytes())
        assert isinstance(ready, EngineCoreReady)
        path, token = ready.wire_address
        caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        caller.connect(path)
        caller.settimeout(10)
        return cls(engine_core, front, child, caller, token)

    def close(self) -> None:
        self.caller.close()
        self.child.close()
        self.front.close()


def test_the_step_that_empties_the_engine_is_followed_by_an_idle_message_with_its_progress():
    """The front reports to the router at once on an idle message; without it a finished request's
    progress waited for the next step, and a sequential caller's next request was placed while
    the router still counted the last one as load. The request itself comes and goes on a
    channel of the core's own wire; the core pipe carries no tokens."""
    from tandem.actors import wire
    from tandem.actors.messages import ChannelAdds, ChannelOpen, EngineCoreOutputs, EngineCoreRequest, decode

    core = InProcessCore.start()
    engine_core, front, caller, token = core.engine_core, core.front, core.caller, core.token
    caller.sendall(token + wire.frame(ChannelOpen("ch")) + wire.frame(ChannelAdds([EngineCoreRequest(
        "r0", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), time.time())])))
    messages = []
    for _ in range(50):
        engine_core.loop_once()
        while front.poll(0.05):
            messages.append(decode(front.recv_bytes()))
        if messages and messages[-1].step is None and any(m.finished for m in messages):
            break
    last_step = max(i for i, m in enumerate(messages) if m.step is not None)
    assert [f.finish_reason for f in messages[last_step].finished] == ["length"], "the last step finished it"
    idle = messages[last_step + 1]
    assert isinstance(idle, EngineCoreOutputs) and idle.step is None  # sent right after it, not after an idle poll
    statuses = [p.status for m in messages[:last_step + 2] for p in m.progress if p.req_id == "r0"]
    assert statuses[-1] == "finished"
    # The tokens went to the caller: its admission first (with the first token), then the rest.
    stream = caller.makefile("rb")
    items = []
    while not (items and getattr(items[-1], "finished", False)):
        (size,) = wire.HEADER.unpack(stream.read(wire.HEADER.size))
        items.extend(decode(stream.read(size)).items)
    assert isinstance(items[0], Admitted) and items[0].num_prompt_tokens == 4
    assert sum(len(o.new_token_ids) for o in items[0].outputs + items[1:]) == 3
    core.close()


def test_a_failed_step_fails_its_channel_requests_and_the_core_serves_on():
    """A step that raises fails every request on the channels with the step's error (and frees
    them in the engine); the actor hears `EngineCoreFailed` for its log; the next request is
    served as usual."""
    from tandem.actors import wire
    from tandem.actors.messages import ChannelAdds, ChannelOpen, EngineCoreFailed, EngineCoreRequest, Refusal, decode
    from tandem.engine.errors import BackendError

    core = InProcessCore.start()
    engine_core, front, caller, token = core.engine_core, core.front, core.caller, core.token
    stream = caller.makefile("rb")

    def read_items(until) -> list:
        items: list = []
        while not until(items):
            (size,) = wire.HEADER.unpack(stream.read(wire.HEADER.size))
            items.extend(decode(stream.read(size)).items)
        return items

    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # only an abort ends it soon
    caller.sendall(token + wire.frame(ChannelOpen("ch")) + wire.frame(ChannelAdds(
        [EngineCoreRequest("doomed", [5, 6, 7, 8], params, time.time())])))
    engine_core.loop_once()  # queued and stepped once
    real_step = engine_core.engine.step

    def failing_step():
        engine_core.engine.step = real_step
        raise RuntimeError("boom")

    engine_core.engine.step = failing_step
    with pytest.raises(RuntimeError):
        engine_core.loop_once()
    engine_core.fail_all("Traceback ...\nRuntimeError: boom")  # what serve() does with it
    items = read_items(lambda items: items and isinstance(items[-1], Refusal))
    assert isinstance(items[-1].error, BackendError) and "engine failed: RuntimeError: boom" in str(items[-1].error)
    steps = 0
    while engine_core.engine.has_unfinished_requests():  # the aborts the failure queued, from the I/O thread
        assert steps < 900, "the failed request ran on: its abort never reached the engine"
        engine_core.loop_once()
        steps += 1
    messages = []
    while front.poll(0.2):
        messages.append(decode(front.recv_bytes()))
    assert any(isinstance(m, EngineCoreFailed) for m in messages)

    caller.sendall(wire.frame(ChannelAdds([EngineCoreRequest("next", [5, 6, 7, 8], SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True), time.time())])))
    for _ in range(20):
        engine_core.loop_once()
    items = read_items(lambda items: items and getattr(items[-1], "finished", False))
    assert isinstance(items[0], Admitted) and items[-1].finish_reason == "length"
    core.close()


def test_step_timing_is_the_finished_steps_own_time_and_none_when_no_step_finished():
    """With asynchronous scheduling the first call after an idle spell launches a step and
    finishes none: no timing for calibration then (a stale step's tokens over a launch's few
    microseconds read as a device many times faster); afterwards each finished step's own time."""
    from tandem.actors.engine_core import EngineCore
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    core = EngineCore.__new__(EngineCore)
    core.engine = LLMEngine(EngineConfig(model="tiny-llama-random", device="sim", max_active=4, num_kv_blocks=64),
                            step_time=lambda p, d, c: 0.02)
    assert core.engine.async_scheduling
    core.engine.add_request("a", list(range(3, 35)), SamplingParams(max_tokens=3, ignore_eos=True))
    timings = []
    while core.engine.has_unfinished_requests():
        before = core.num_tokens_done()
        outputs = core.engine.step()
        timings.append(core.step_timing(before, len(outputs)))
    assert timings[0] is None  # launched the prefill, finished nothing
    finished = [t for t in timings if t is not None]
    assert [(t.prefill_tokens, t.decode_tokens) for t in finished] == [(32, 0), (0, 1), (0, 1)]
    assert all(t.elapsed_s >= 0.01 for t in finished)  # about its 20 ms step, never a launch's microseconds


def test_steps_posted_faster_than_the_io_thread_handles_them_share_wake_ups_and_keep_their_order():
    """The step loop wakes the I/O thread only when no drain is due: steps posted while it is
    still busy with earlier ones are handled by that drain, in order, and a failure posted
    after them is told after them."""
    from tandem.actors.core_io import CoreIO, StepNews
    from tandem.actors.messages import EngineCoreFailed, EngineCoreOutputs, decode

    front, core_end = multiprocessing.Pipe()
    io = CoreIO("b", core_end)
    wakes = []
    call_soon_threadsafe = io.loop.call_soon_threadsafe
    io.loop.call_soon_threadsafe = lambda callback, *args: (wakes.append(callback), call_soon_threadsafe(callback, *args))
    on_news = io._on_news

    def slow(news):  # an I/O thread busier than the step loop, as under load
        time.sleep(0.002)
        on_news(news)

    io._on_news = slow
    for i in range(50):
        io.post(StepNews(control=EngineCoreOutputs(cache_changes={i: 1})))
    io.post_failure("Traceback\nRuntimeError: the step failed")
    told = [decode(front.recv_bytes()) for _ in range(51)]
    assert [next(iter(m.cache_changes)) for m in told[:50]] == list(range(50))
    assert isinstance(told[50], EngineCoreFailed)
    assert len(wakes) < 10  # one per drain that found nothing due, not one per step
