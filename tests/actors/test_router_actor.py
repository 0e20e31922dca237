"""RouterActor as a plain object (no Ray): decisions, cache-query deadline, log, membership.

Backends are fakes whose `.remote()` calls return awaitables, the way Ray object refs do.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.actors.messages import BackendInfo
from tandem.actors.router import RouterActor
from tandem.engine.errors import BackendUnavailableError
from tandem.engine.kv_cache.hashing import hash_request_blocks
from tandem.engine.outputs import RequestProgress

SPEC_RATES = {"cuda0": {"prefill_tok_s": 2551.0, "decode_tok_s": 293.0},
              "cpu0": {"prefill_tok_s": 73.0, "decode_tok_s": 45.0}}


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class FakeBackend:
    """Answers pings only: the router must never ask a backend anything on its decision path."""

    def __init__(self, backend_id: str, num_cached: int = 0, instance_id: str = "i1"):
        self.backend_id, self.instance, self.cached = backend_id, instance_id, num_cached

        async def ping():
            return self.instance

        self.ping = _Method(ping)

    def cached_hashes(self, prompt: list[int]) -> list[int]:
        """The backend's prefix-cache index: the first `num_cached` tokens of `prompt`."""
        return hash_request_blocks(prompt, 16)[: self.cached // 16]

    def info(self, device_kind: str, with_rates: bool = True) -> BackendInfo:
        return BackendInfo(self.backend_id, self.instance, device_kind, device_kind, device_kind, "float32", 1,
                           4, 16, "m", 2048, rates=SPEC_RATES[self.backend_id] if with_rates else None)


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def progress(req_id, status, computed=0, output=0, cached=0, prompt=516, max_tokens=128):
    return RequestProgress(req_id, status, prompt, cached, computed, output, max_tokens)


def make_router(tmp_path, **kwargs) -> tuple[RouterActor, FakeBackend, FakeBackend]:
    router = RouterActor("cost", str(tmp_path / "routing.jsonl"), **kwargs)
    gpu, cpu = FakeBackend("cuda0", num_cached=496), FakeBackend("cpu0", num_cached=496)
    return router, gpu, cpu


def test_spec_worked_example_through_the_actor(tmp_path):
    """Request 7 goes to the GPU (3.027 s < 3.118 s), request 8 to the CPU (3.444 s), as in the design."""

    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        # The design's prompts share a 496-token prefix; the rest is each request's own (identical
        # prompts would rightly be counted as hitting 512 tokens behind one another in flight).
        prompt = [list(range(496)) + [10_000 + i] * 20 for i in range(9)]
        await router.add_backend(gpu.info("cuda"), gpu, gpu.cached_hashes(prompt[0]))
        await router.add_backend(cpu.info("cpu"), cpu, cpu.cached_hashes(prompt[0]))
        for i in range(6):
            assert (await router.place(f"r{i}", prompt[i], 128)).backend_id == "cuda0"
        # Four of them run and have generated 4 tokens each: 4 active, 2 queued (496 cached).
        await router.report("cuda0", "i1", [progress(f"r{i}", "running", computed=516, output=4) for i in range(4)])
        d7 = await router.place("r7", prompt[7], 128)
        await router.report("cuda0", "i1", [progress(f"r{i}", "running", computed=516, output=6) for i in range(4)])
        d8 = await router.place("r8", prompt[8], 128)
        return d7, d8

    d7, d8 = run(scenario())
    assert d7.backend_id == "cuda0"
    assert d7.record["per_backend"]["cuda0"]["score_s"] == pytest.approx(60 / 2551 + 880 / 293, abs=1e-4)
    assert d7.record["per_backend"]["cpu0"]["score_s"] == pytest.approx(20 / 73 + 128 / 45, abs=1e-4)
    assert d8.backend_id == "cpu0"
    assert d8.record["per_backend"]["cuda0"]["score_s"] == pytest.approx(80 / 2551 + 1000 / 293, abs=1e-4)
    lines = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [line["req_id"] for line in lines][-2:] == ["r7", "r8"]
    assert lines[-1]["backend_id"] == "cpu0" and lines[-1]["cache_answers"] == {"cuda0": 496, "cpu0": 496}
    # Each backend's whole rate profile goes into the log once, with the first decision that scores it.
    assert [sorted(line.get("rates", {})) for line in lines] == [["cpu0", "cuda0"]] + [[]] * (len(lines) - 1)
    assert lines[0]["rates"]["cuda0"]["prefill_tok_s"] == 2551


def test_a_log_line_holds_the_decision_record_at_full_precision(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        return await router.place("r0", list(range(100)), 8)

    decision = run(scenario())
    (line,) = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    record = {k: v for k, v in line.items() if k in decision.record}
    assert record.keys() == decision.record.keys()
    for backend_id, score in record.pop("per_backend").items():  # the dict a decision answers is rounded
        assert score == pytest.approx(decision.record["per_backend"][backend_id], abs=1e-6)
        assert score["score_s"] != round(score["score_s"], 6)  # ... the log's is not
    assert record == {k: v for k, v in decision.record.items() if k != "per_backend"}


def test_a_backend_that_rejoins_has_its_rates_logged_again(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        await router.place("r0", list(range(64)), 8)
        await router.place("r1", list(range(100, 164)), 8)
        await router.add_backend(cpu.info("cpu"), cpu)  # re-registered (a restart)
        await router.place("r2", list(range(200, 264)), 8)

    run(scenario())
    lines = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [sorted(line.get("rates", {})) for line in lines] == [["cpu0", "cuda0"], [], ["cpu0"]]


def test_cache_estimates_follow_reported_publications_and_evictions(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        prompt = list(range(516))
        hashes = hash_request_blocks(prompt, 16)
        await router.add_backend(gpu.info("cuda"), gpu)  # empty cache
        await router.add_backend(cpu.info("cpu"), cpu, cpu.cached_hashes(prompt))
        cold = await router.place("r0", prompt, 128)
        # Each request finishes before the next, so only the mirror (not its in-flight prefix) counts.
        await router.report("cuda0", "i1", [progress("r0", "finished")], cache_changes={h: True for h in hashes[:31]})
        warm = await router.place("r1", prompt, 128)
        await router.report("cuda0", "i1", [progress("r1", "finished")], cache_changes={hashes[10]: False})
        evicted = await router.place("r2", prompt, 128)
        return [d.record["per_backend"]["cuda0"]["num_cached_tokens"] for d in (cold, warm, evicted)], cold

    gpu_cached, cold = run(scenario())
    assert gpu_cached == [0, 496, 160]  # a hole at block 10 ends the reusable prefix there
    assert cold.record["per_backend"]["cpu0"]["num_cached_tokens"] == 496


def test_failed_backend_is_dropped_and_stale_reports_are_ignored(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        assert (await router.place("a", list(range(516)), 128)).backend_id == "cuda0"
        assert not await router.backend_failed("cuda0", "some-older-instance")
        assert await router.backend_failed("cuda0", "i1")
        after_failure = await router.place("b", list(range(516)), 128)
        # The restarted backend rejoins with a new instance id and no rates: the router keeps its rates.
        gpu.instance = "i2"
        await router.add_backend(gpu.info("cuda", with_rates=False), gpu)
        assert await router.report("cuda0", "i1", [progress("a", "finished")]) == 0
        rejoined = await router.place("c", list(range(516)), 128)
        return after_failure, rejoined, await router.list_backends()

    after_failure, rejoined, backends = run(scenario())
    assert after_failure.backend_id == "cpu0"
    assert rejoined.backend_id == "cuda0" and rejoined.instance_id == "i2"
    assert set(backends) == {"cuda0", "cpu0"}


def test_no_backend_raises(tmp_path):
    router = RouterActor("cost", None)
    with pytest.raises(BackendUnavailableError):
        run(router.place("r", [1, 2, 3], 4))


def test_health_check_drops_a_dead_backend(tmp_path):
    async def scenario():
        router = RouterActor("cost", None, health_check_period_s=0.05)
        gpu, cpu = FakeBackend("cuda0"), FakeBackend("cpu0")
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)

        async def dead():
            raise RuntimeError("actor died")

        gpu.ping = _Method(dead)
        await asyncio.sleep(0.3)
        return set(await router.list_backends())

    assert run(scenario()) == {"cpu0"}


def test_slow_pings_drop_a_backend_only_in_a_row_and_it_rejoins_when_it_answers(tmp_path):
    """A ping that times out is not a death: a backend stays routable through fewer than
    HEALTH_CHECK_MISSES timeouts in a row, leaves routing at that many, and, being the same live
    instance, is asked to register again once it answers (nothing else would bring it back)."""
    from tandem.actors.router import HEALTH_CHECK_MISSES

    async def scenario():
        router = RouterActor("cost", None, health_check_period_s=0.01)  # pings time out after 2 s
        gpu, cpu = FakeBackend("cuda0"), FakeBackend("cpu0")
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        stalled = asyncio.Event()
        registered = []

        async def slow_ping():
            await stalled.wait()
            return gpu.instance

        async def register(rates):
            registered.append(rates)
            await router.add_backend(gpu.info("cuda"), gpu)

        gpu.ping, gpu.register = _Method(slow_ping), _Method(register)
        await asyncio.sleep(2.0 * (HEALTH_CHECK_MISSES - 1) + 0.5)  # fewer misses than the limit
        kept = set(await router.list_backends())
        await asyncio.sleep(2.5)
        dropped = set(await router.list_backends())
        stalled.set()
        await asyncio.sleep(0.3)
        return kept, dropped, set(await router.list_backends()), registered

    kept, dropped, rejoined, registered = run(scenario())
    assert kept == {"cuda0", "cpu0"}
    assert dropped == {"cpu0"}
    assert rejoined == {"cuda0", "cpu0"} and registered == [SPEC_RATES["cuda0"]]


def pending_gauges(router: RouterActor) -> dict[str, float]:
    """backend -> the last value the router set on its pending-requests gauge."""
    return {dict(tags)["backend"]: value for (name, tags), value in router.metrics._gauges.items()
            if name == "tandem_router_pending_requests"}


def test_forget_and_a_dropped_backend_leave_the_pending_gauges_truthful(tmp_path):
    """A request its caller gave up on leaves the gauge within the export interval, not at the
    next report (an idle backend sends none), and a dropped backend's gauges read 0, not their
    last value."""
    from tandem.actors.router import PENDING_EXPORT_S

    async def settled() -> None:  # the gauges follow the ledger within PENDING_EXPORT_S
        await asyncio.sleep(2 * PENDING_EXPORT_S)

    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        decision = await router.place("r1", list(range(64)), 16)
        await settled()
        routed = pending_gauges(router)[decision.backend_id]
        assert await router.forget("r1") and not await router.forget("r1")
        await settled()
        forgotten = pending_gauges(router)[decision.backend_id]
        victim = (await router.place("r2", list(range(100, 164)), 16)).backend_id
        await settled()
        busy = dict(pending_gauges(router))
        await router.backend_failed(victim, "i1", "test")
        return routed, forgotten, victim, busy, pending_gauges(router), await router.pending_summary()

    routed, forgotten, victim, busy, after_drop, summary = run(scenario())
    survivor = ({"cuda0", "cpu0"} - {victim}).pop()
    assert (routed, forgotten) == (1, 0)
    assert busy[victim] == 1 and after_drop == {victim: 0, survivor: busy[survivor]}
    assert set(summary) == {survivor}


def test_engines_on_one_physical_gpu_share_calibration_and_engines_on_two_do_not(tmp_path):
    """Every actor sees its GPU as cuda:0, so the router groups engines by `shared_device` (node
    and Ray's GPU ids), not by `device`: two engines on GPU 0 share what one step taught, one on
    GPU 1 keeps its own rates."""
    from tandem.actors.messages import StepTiming

    async def scenario():
        router = RouterActor("cost", None, calibration_alpha=0.5)
        for backend_id, gpu in (("cuda0", "0"), ("cuda1", "0"), ("cuda2", "1")):
            backend = FakeBackend(backend_id)
            info = BackendInfo(backend_id, "i1", "cuda:0", "cuda", "cuda", "bfloat16", 1, 4, 16, "m", 2048,
                               rates=SPEC_RATES["cuda0"], shared_device=f"node/cuda:{gpu}")
            await router.add_backend(info, backend)
        await router.report("cuda0", "i1", [], [StepTiming(0, 4, 4, 4 / (0.5 * 293))])  # half the rate
        return await router.rates_in_use()

    rates = run(scenario())
    assert rates["cuda0"]["decode_tok_s"] == rates["cuda1"]["decode_tok_s"] == pytest.approx(0.75 * 293)
    assert rates["cuda2"]["decode_tok_s"] == 293.0


@pytest.mark.parametrize("device_shares", [False, True])
def test_with_device_shares_light_traffic_stays_on_the_busy_engine_of_a_shared_gpu(tmp_path, device_shares):
    """Two engines on one GPU (a decode step of 2 costs about what a step of 1 does), one request
    on cuda0. Scored alone, idle cuda1 looks free; scored by its share of the device, waking it
    halves both engines' speed, so the second request batches on cuda0."""
    rates = {"prefill_tok_s": 2551.0, "decode_tok_s": 293.0, "decode_tok_s_by_batch": {1: 293.0, 2: 580.0}}

    async def scenario():
        router = RouterActor("cost", None, device_shares=device_shares)
        for backend_id in ("cuda0", "cuda1"):
            info = BackendInfo(backend_id, "i1", "cuda:0", "cuda", "cuda", "bfloat16", 1, 4, 16, "m", 2048,
                               rates=rates, shared_device="node/cuda:0")
            await router.add_backend(info, FakeBackend(backend_id))
        first = await router.place("r1", list(range(64)), 16)
        second = await router.place("r2", list(range(100, 164)), 16)
        return first.backend_id, second.backend_id

    assert run(scenario()) == ("cuda0", "cuda0" if device_shares else "cuda1")
