"""RouterActor with deadlines and priorities, as a plain object (no Ray): the placement carries
the projected TTFT, a refusal is logged and counted and places nothing, and the first report
of a token is compared with the projection once."""

from __future__ import annotations

import json

import pytest

from tandem.actors.messages import Placement, PlaceRequest
from tandem.engine.errors import DeadlineUnmetError
from tests.actors.test_router_actor import make_router, progress, run

PROMPT = list(range(64))


def recorded(router):
    calls = []
    router.metrics.observe = lambda name, value, tags=None: calls.append(("observe", name, value, tags))
    router.metrics.inc = lambda name, value=1.0, tags=None: calls.append(("inc", name, value, tags))
    return calls


def test_placement_carries_the_projection_and_a_refusal_places_nothing(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        calls = recorded(router)
        [placed] = router.place_many([(PlaceRequest("r1", PROMPT, 16, 1, priority=-1, ttft_deadline_s=1.0),)])
        with pytest.raises(DeadlineUnmetError) as info:
            await router.place("r2", list(range(100, 164)), 16, 1, 0, 0.03)
        answers = router.place_many([(PlaceRequest("r3", list(range(200, 264)), 16, 1, 0, 0.03),)])
        return router, placed, info.value, answers, calls

    router, placed, refused, answers, calls = run(scenario())
    assert placed == Placement("cuda0", "i1", pytest.approx(64 / 2551 + 16 / 293), pytest.approx(64 / 2551))
    # r1 (more urgent) and its 64 prompt tokens are ahead of r2 on the GPU: (64 + 64) / 2551 s > 30 ms; the CPU's 64 / 73 s more so.
    assert "deadline 30 ms cannot be met" in refused.message and "on cuda0" in refused.message
    assert refused.projected_ttft_s == pytest.approx(128 / 2551)
    assert refused.retry_after_s == pytest.approx(128 / 2551 - 0.03)
    assert isinstance(answers[0], DeadlineUnmetError)
    assert router.router.backend_of("r2") is None and router.router.backend_of("r3") is None
    assert [c for c in calls if c[1] == "tandem_router_deadline_refusals"] == [
        ("inc", "tandem_router_deadline_refusals", 1.0, {"backend": "cuda0"})] * 2
    lines = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [(x["req_id"], x["placed"], x["priority"], x["ttft_deadline_s"]) for x in lines] == [
        ("r1", True, -1, 1.0), ("r2", False, 0, 0.03), ("r3", False, 0, 0.03)]
    assert lines[1]["retry_after_s"] == pytest.approx(128 / 2551 - 0.03)  # the log keeps full precision
    assert lines[0]["per_backend"]["cuda0"]["projected_ttft_s"] == pytest.approx(64 / 2551)


def test_the_first_report_of_a_token_is_compared_with_the_projection_once(tmp_path):
    async def scenario():
        router, gpu, cpu = make_router(tmp_path)
        await router.add_backend(gpu.info("cuda"), gpu)
        await router.add_backend(cpu.info("cpu"), cpu)
        await router.place("r1", PROMPT, 16)
        calls = recorded(router)
        await router.report("cuda0", "i1", [progress("r1", "running", computed=32, output=0, prompt=64)])
        before = list(calls)
        await router.report("cuda0", "i1", [progress("r1", "running", computed=64, output=1, prompt=64)])
        await router.report("cuda0", "i1", [progress("r1", "running", computed=64, output=2, prompt=64)])
        return before, calls

    before, calls = run(scenario())
    errors = [c for c in calls if c[1] in ("tandem_router_ttft_late_seconds", "tandem_router_ttft_early_seconds")]
    assert not [c for c in before if c in errors]
    assert len(errors) == 1 and errors[0][3] == {"backend": "cuda0"} and errors[0][2] >= 0


@pytest.mark.parametrize("bound_s, prefill_ahead, decode_ahead", [(None, 0, 16), (0.0, 64, 32)])
def test_a_backends_starvation_bound_puts_aged_batch_work_ahead_of_urgent_requests(tmp_path, bound_s,
                                                                                    prefill_ahead, decode_ahead):
    async def scenario():
        router, gpu, _ = make_router(tmp_path)
        info = gpu.info("cuda")
        info.max_priority_wait_s, info.max_active = bound_s, 1
        await router.add_backend(info, gpu)
        await router.place("running", list(range(300, 364)), 17, 1, 0)  # takes the one slot
        await router.report("cuda0", "i1", [progress("running", "running", computed=64, output=1, prompt=64,
                                                     max_tokens=17)])
        await router.place("batch", PROMPT, 16, 1, 1)  # queued behind it, less urgent
        return router.place_many([(PlaceRequest("urgent", list(range(100, 164)), 16, 1, priority=0),)])

    [placed] = run(scenario())
    # With a bound of 0 s the queued batch request has aged by the time the urgent one is
    # admitted, so its 64 prompt tokens are ahead and the urgent one waits for both to finish;
    # without a bound it waits for the running request's 16 tokens only.
    assert placed.projected_ttft_s == pytest.approx((prefill_ahead + 64) / 2551 + decode_ahead / 293)
