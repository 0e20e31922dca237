"""Deadlines and priorities at the API edge, without a cluster: the body fields, the header,
the 429 a refusal becomes (its Retry-After and projection) and the 400 of a deadline no idle
backend could meet."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tandem.actors.router import deadline_error
from tandem.cluster.errors import error_response
from tandem.cluster.headers import DEADLINE_HEADER, PROJECTED_TTFT_HEADER
from tandem.cluster.protocol import ChatCompletionRequest, CompletionRequest, TandemInfo
from tandem.cluster.request_edge import ttft_deadline_s
from tandem.engine.errors import DeadlineUnmetError, InvalidRequestError
from tandem.routing import DeadlineRefusedError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


class FakeRequest:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


@pytest.mark.parametrize("cls, body", [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)])
def test_priority_and_deadline_fields(cls, body):
    parsed = cls.model_validate({**body, "priority": -3, "ttft_deadline_ms": 250})
    assert (parsed.priority, parsed.ttft_deadline_ms) == (-3, 250)
    plain = cls.model_validate(body)
    assert (plain.priority, plain.ttft_deadline_ms) == (0, None)
    for bad in ({"priority": 0.5}, {"priority": "1"}, {"ttft_deadline_ms": 0}, {"ttft_deadline_ms": -5}):
        with pytest.raises(ValidationError):
            cls.model_validate({**body, **bad})


def test_the_body_wins_over_the_header_and_the_header_is_checked():
    body = CompletionRequest.model_validate({**COMPLETION, "ttft_deadline_ms": 300})
    assert ttft_deadline_s(FakeRequest({DEADLINE_HEADER: "900"}), body) == 0.3
    plain = CompletionRequest.model_validate(COMPLETION)
    assert ttft_deadline_s(FakeRequest({DEADLINE_HEADER: "900"}), plain) == 0.9
    assert ttft_deadline_s(FakeRequest({}), plain) is None
    for bad in ("soon", "0", "-1", "nan", "inf"):
        with pytest.raises(InvalidRequestError) as info:
            ttft_deadline_s(FakeRequest({DEADLINE_HEADER: bad}), plain)
        assert info.value.param == DEADLINE_HEADER


def test_a_refusal_while_busy_is_a_429_with_retry_after_from_the_projection():
    exc = deadline_error(DeadlineRefusedError("r1", "gpu0", 0.2, 1.7345, 1.5345))
    assert isinstance(exc, DeadlineUnmetError)
    response = error_response(exc, "req-1")
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"  # 1.53 s rounded up
    assert response.headers[PROJECTED_TTFT_HEADER] == "1734.5"
    error = json.loads(response.body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "deadline_unmet"
    assert error["param"] == "ttft_deadline_ms"
    assert "deadline 200 ms cannot be met" in error["message"] and "1734 ms on gpu0" in error["message"]


def test_a_short_retry_is_at_least_one_second():
    response = error_response(deadline_error(DeadlineRefusedError("r1", "g", 0.2, 0.2001, 0.0001)), "req-1")
    assert response.headers["retry-after"] == "1"


def test_a_deadline_no_idle_backend_meets_is_a_400():
    exc = deadline_error(DeadlineRefusedError("r1", "cpu0", 0.001, 0.05, None))
    assert isinstance(exc, InvalidRequestError) and exc.code == "deadline_unmeetable"
    response = error_response(exc, "req-1")
    assert response.status_code == 400 and "retry-after" not in response.headers


def test_tandem_info_carries_the_projection():
    assert TandemInfo(backend="b", estimated_s=1.0, projected_ttft_ms=12.5).model_dump()["projected_ttft_ms"] == 12.5


def test_a_failed_answer_says_how_long_the_server_held_it():
    from bench.client import server_timing_s, server_timings
    from tandem.cluster.headers import server_timing

    header = server_timing(10.0, 10.0123)
    assert header == {"server-timing": "tandem;dur=12.30"}
    assert server_timing_s(header["server-timing"]) == pytest.approx(0.0123)
    assert server_timing_s("cache;desc=hit, tandem;dur=0.5") == pytest.approx(0.0005)
    assert server_timing_s(None) is None and server_timing_s("tandem;desc=x") is None
    stages = server_timing(10.0, 10.02, {"route": 0.0015, "prefill": 0.0185})
    assert stages == {"server-timing": "route;dur=1.50, prefill;dur=18.50, tandem;dur=20.00"}
    assert server_timings(stages["server-timing"]) == pytest.approx({"route": 0.0015, "prefill": 0.0185,
                                                                     "tandem": 0.02})
