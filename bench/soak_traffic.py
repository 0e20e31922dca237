"""The soak bench's traffic: the kinds of request it mixes, and one request sent and judged.

Each kind is what a production server meets: plain and streamed completions, `n` choices, a JSON
schema, a forced tool call, prompts near the context limit, clients that hang up mid-stream,
and malformed requests that must get their 4xx. Every request ends in one outcome: `ok` (the
answer asked for), `rejected` (a deserved 4xx), `refused` (429, or 503 / a
`service_unavailable` error event: retryable), `hung_up` (on purpose), `hung` (no byte for
`hang_s`) or `lost` (anything else). Prompts come from a seeded RNG per client.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

TOKEN_IDS = range(3, 250)
WORDS = ("the", "sea", "a", "long", "story", "about", "ships", "and", "rain", "over", "old", "harbour", "light")
# kind -> weight in the mix
KIND_WEIGHTS: dict[str, int] = {
    "completion": 3, "completion_stream": 3, "completion_n": 1, "chat_stream_n": 2, "structured": 1,
    "tool_call": 1, "long_prompt": 1, "hang_up": 2, "malformed": 2,
}
KINDS = tuple(KIND_WEIGHTS)
OUTCOMES = ("ok", "rejected", "refused", "hung_up", "hung", "lost")
REFUSED_STATUSES = (429, 503)
UNAVAILABLE_TYPE = "service_unavailable"  # cluster/errors.py's error type for 503
LONG_PROMPT_MARGIN = 8  # tokens left free below the context besides the output
MAX_HANG_UP_EVENTS = 6
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@dataclass(frozen=True)
class Planned:
    """One request to send: where, what, and what answer it deserves."""

    kind: str
    method: str
    path: str
    body: Any  # a JSON-able object, or raw bytes for a malformed body
    stream: bool = False
    expect_status: int = 200
    num_choices: int = 1
    hang_up_after: int | None = None  # events to read before hanging up
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Record:
    kind: str
    sent_s: float  # since the run started (time.monotonic based)
    end_s: float = 0.0
    status: int = 0
    outcome: str = "lost"
    detail: str | None = None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.sent_s


class Planner:
    """Draws requests of the mix for one client, seeded."""

    def __init__(self, model: str, max_model_len: int, max_tokens: int, seed: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)

    def next(self) -> Planned:
        kind = self.rng.choices(KINDS, weights=[KIND_WEIGHTS[k] for k in KINDS])[0]
        return getattr(self, f"_{kind}")()

    # -- the kinds ------------------------------------------------------------------------------
    def _tokens(self, low: int = 8, high: int = 64) -> list[int]:
        return self.rng.choices(TOKEN_IDS, k=self.rng.randint(low, high))

    def _text(self, low: int = 4, high: int = 16) -> str:
        return " ".join(self.rng.choices(WORDS, k=self.rng.randint(low, high)))

    def _output_len(self) -> int:
        return self.rng.randint(max(1, self.max_tokens // 4), self.max_tokens)

    def _completion_body(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": self._tokens(), "max_tokens": self._output_len(),
                "temperature": self.rng.choice([0.0, 0.8]), "seed": self.rng.randrange(1 << 30), **extra}

    def _chat_body(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": self._text()}],
                "max_tokens": self._output_len(), "temperature": 0.0, **extra}

    def _completion(self) -> Planned:
        return Planned("completion", "POST", "/v1/completions", self._completion_body())

    def _completion_stream(self) -> Planned:
        body = self._completion_body(stream=True, stream_options={"include_usage": True})
        return Planned("completion_stream", "POST", "/v1/completions", body, stream=True)

    def _completion_n(self) -> Planned:
        n = self.rng.randint(2, 4)
        return Planned("completion_n", "POST", "/v1/completions", self._completion_body(n=n, temperature=0.8),
                       num_choices=n)

    def _chat_stream_n(self) -> Planned:
        body = self._chat_body(stream=True, n=2, temperature=0.8, seed=self.rng.randrange(1 << 30))
        return Planned("chat_stream_n", "POST", "/v1/chat/completions", body, stream=True, num_choices=2)

    def _structured(self) -> Planned:
        body = self._chat_body(response_format={"type": "json_schema",
                                                "json_schema": {"name": "person", "schema": PERSON_SCHEMA}})
        return Planned("structured", "POST", "/v1/chat/completions", body)

    def _tool_call(self) -> Planned:
        body = self._chat_body(tools=[WEATHER_TOOL], stream=self.rng.random() < 0.5,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return Planned("tool_call", "POST", "/v1/chat/completions", body, stream=body["stream"])

    def _long_prompt(self) -> Planned:
        max_tokens = self.rng.randint(1, max(1, self.max_tokens // 4))
        prompt_len = self.max_model_len - max_tokens - LONG_PROMPT_MARGIN
        body = {"model": self.model, "prompt": self.rng.choices(TOKEN_IDS, k=prompt_len), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        return Planned("long_prompt", "POST", "/v1/completions", body)

    def _hang_up(self) -> Planned:
        body = self._completion_body(stream=True, max_tokens=self.max_tokens, ignore_eos=True)
        return Planned("hang_up", "POST", "/v1/completions", body, stream=True,
                       hang_up_after=self.rng.randint(0, MAX_HANG_UP_EVENTS))

    def _malformed(self) -> Planned:
        good = self._completion_body()
        cases = [
            (b'{"model": "x", "prompt": [1, 2', 400, {}),  # cut-off JSON
            (json.dumps(good).encode(), 415, {"content-type": "text/plain"}),
            ({**good, "max_tokens": -1}, 400, {}),
            ({**good, "n": 0}, 400, {}),
            ({k: v for k, v in good.items() if k != "model"}, 400, {}),
            ({**good, "model": "no-such-model"}, 404, {}),
            ({**good, "prompt": self.rng.choices(TOKEN_IDS, k=self.max_model_len + 8)}, 400, {}),
            ({**good, "temperature": "hot"}, 400, {}),
        ]
        body, status, headers = self.rng.choice(cases)
        return Planned("malformed", "POST", "/v1/completions", body, expect_status=status, headers=headers)


# -- one request -----------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, planned: Planned, clock: Any) -> Record:
    """Send `planned` and judge its answer; `clock()` is the run's seconds."""
    record = Record(planned.kind, clock())
    try:
        if planned.stream:
            await _streamed(client, planned, record)
        else:
            await _whole(client, planned, record)
    except httpx.TimeoutException as exc:  # connect or read: no byte for hang_s
        record.outcome, record.detail = "hung", f"{type(exc).__name__} (no byte within the hang limit)"
    except httpx.HTTPError as exc:
        record.outcome, record.detail = "lost", f"{type(exc).__name__}: {str(exc)[:200]}"
    except ValueError as exc:  # a body that is not the JSON it should be
        record.outcome, record.detail = "lost", f"bad JSON: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 -- an answer of a shape nobody planned for is a lost request, not the end of the soak
        record.outcome, record.detail = "lost", f"unexpected {type(exc).__name__}: {str(exc)[:200]}"
    record.end_s = clock()
    return record


def _request_kwargs(planned: Planned) -> dict[str, Any]:
    if isinstance(planned.body, bytes):
        headers = {"content-type": "application/json", **planned.headers}
        return {"content": planned.body, "headers": headers}
    if planned.headers:
        return {"content": json.dumps(planned.body).encode(), "headers": planned.headers}
    return {"json": planned.body}


def _judge_status(planned: Planned, record: Record, status: int, text: str) -> bool:
    """Settles the outcome of an answer that is not the 200 asked for; True if it did."""
    record.status = status
    if status == planned.expect_status == 200:
        return False
    if status == planned.expect_status:
        record.outcome = "rejected"
    elif status in REFUSED_STATUSES:
        record.outcome = "refused"
    else:
        record.outcome, record.detail = "lost", f"HTTP {status} (expected {planned.expect_status}): {text[:200]}"
    return True


async def _whole(client: httpx.AsyncClient, planned: Planned, record: Record) -> None:
    response = await client.request(planned.method, planned.path, **_request_kwargs(planned))
    if _judge_status(planned, record, response.status_code, response.text):
        return
    choices = response.json().get("choices") or []
    if len(choices) != planned.num_choices:
        record.outcome, record.detail = "lost", f"{len(choices)} choices, asked for {planned.num_choices}"
        return
    record.outcome = "ok"


async def _streamed(client: httpx.AsyncClient, planned: Planned, record: Record) -> None:
    async with client.stream(planned.method, planned.path, **_request_kwargs(planned)) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            _judge_status(planned, record, response.status_code, text)
            return
        if _judge_status(planned, record, 200, ""):
            return
        if planned.hang_up_after == 0:
            record.outcome = "hung_up"
            return
        error_outcome = None  # set by an error event, which ends the stream's meaning
        num_events = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                record.outcome = error_outcome or "ok"
                return
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                unavailable = event["error"].get("type") == UNAVAILABLE_TYPE
                error_outcome = "refused" if unavailable else "lost"
                record.detail = f"stream error event: {json.dumps(event['error'])[:200]}"
                continue
            num_events += 1
            if planned.hang_up_after is not None and num_events >= planned.hang_up_after:
                record.outcome = "hung_up"
                return  # leaving the block closes the connection mid-stream
        record.outcome = error_outcome or "lost"
        record.detail = record.detail or "stream ended without [DONE]"


def timeouts(hang_s: float) -> httpx.Timeout:
    """No byte for `hang_s`: connecting, between reads, or writing; no pool wait (a client has its
    own connection)."""
    return httpx.Timeout(connect=hang_s, read=hang_s, write=hang_s, pool=None)


def monotonic_clock(start: float) -> Any:
    return lambda: time.monotonic() - start
