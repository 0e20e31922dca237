"""Deadlines and priorities through HTTP against the session's real cluster (two CPU backends,
SmolLM2, equal rates of 200 prefill and 15 decode tokens/s, 2 slots each): the projection on
every response, the routing log's record of class and deadline, a 400 for a deadline no idle
backend meets, and a 429 (the openai client's RateLimitError) with Retry-After while every
backend's slots are taken."""

from __future__ import annotations

import contextlib

import openai
import pytest
import ray

from bench.client import server_timing_s
from tests.cluster.conftest import MODEL, TIMEOUT_S, backends_idle, wait_for

pytestmark = pytest.mark.slow


def test_a_response_carries_the_projection_it_was_placed_with(http, routing_log):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is", "max_tokens": 2,
                                                   "priority": 1, "ttft_deadline_ms": 60_000})
    assert response.status_code == 200, response.text
    body = response.json()
    header_ms = float(response.headers["x-tandem-projected-ttft-ms"])
    assert header_ms > 0 and header_ms == pytest.approx(body["tandem"]["projected_ttft_ms"], abs=0.05)
    line = next(x for x in routing_log() if x["req_id"] == body["id"])
    assert (line["priority"], line["ttft_deadline_s"], line["placed"]) == (1, 60.0, True)
    assert line["per_backend"][line["backend_id"]]["projected_ttft_s"] * 1000 == pytest.approx(header_ms, abs=0.05)


def test_a_deadline_no_idle_backend_meets_is_a_400(http):
    # Even one token of prefill at 200 tokens/s takes 5 ms.
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is", "max_tokens": 2},
                         headers={"x-tandem-ttft-deadline-ms": "0.5"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "deadline_unmeetable" and "cannot be met even on an idle backend" in error["message"]


def test_busy_backends_refuse_a_tight_deadline_with_429_and_retry_after(tandem, http, openai_client):
    with contextlib.ExitStack() as stack:
        # Three long requests per backend: two in its slots and one queued, so a new request on
        # either waits for a slot, seconds of decode at 15 tokens/s.
        for i in range(6):
            stack.enter_context(http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": f"Count to a hundred, take {i}:", "max_tokens": 200, "ignore_eos": True,
                "stream": True}))

        def every_backend_full():
            summary = ray.get(tandem.router.pending_summary.remote(), timeout=TIMEOUT_S)
            return all(s["num_active"] + s["num_queued"] >= 2 for s in summary.values())

        wait_for(every_backend_full, what="both backends' slots taken")
        with pytest.raises(openai.RateLimitError) as info:
            openai_client.completions.create(model=MODEL, prompt="Quick:", max_tokens=2,
                                             extra_body={"ttft_deadline_ms": 2000})
        response = info.value.response
        assert int(response.headers["retry-after"]) >= 1
        # how long the server held the refusal, for a client to tell its own part from the server's
        server_s = server_timing_s(response.headers["server-timing"])
        assert server_s is not None and 0 <= server_s < 10
        assert float(response.headers["x-tandem-projected-ttft-ms"]) > 2000
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "deadline_unmet"
        assert "deadline 2000 ms cannot be met while backends are busy" in error["message"]
    wait_for(lambda: backends_idle(tandem), what="the long requests aborted")
