"""The HTTP client of every bench: send a workload's requests to the API on schedule and time them.

Open loop, as in the design: request i is sent at `start + arrival_s[i]` whether or not earlier
ones have answered, each on its own task and connection, streamed with usage. Per request, on
one clock (`time.perf_counter`, seconds from the run's start): `send_s`, `first_text_s` (the
first chunk carrying text: TTFT is what a client sees, so a first token that is an incomplete
UTF-8 sequence shows one or more steps later), `end_s` (`[DONE]`), the backend and the router's
projected TTFT (response headers), the request id (the routing log's), the usage's prompt,
cached and output tokens, and any error.

`post_streamed` is one request through aiohttp, parsing only what a figure needs: the benches
that push thousands of tokens per second through one client process (serve-load, served-path)
would otherwise measure the client's JSON parsing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from bench.workload import Workload, WorkloadRequest

BACKEND_HEADER = "x-tandem-backend"
PROJECTED_HEADER = "x-tandem-projected-ttft-ms"  # the router's projection of the request's TTFT


@dataclass
class RequestResult:
    index: int
    send_s: float
    req_id: str | None = None
    backend: str | None = None
    status: int = 0
    first_text_s: float | None = None
    end_s: float | None = None
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: the prefix-cache hit
    num_chunks: int = 0
    finish_reason: str | None = None
    projected_ttft_s: float | None = None
    server_s: float | None = None  # the request's time in the server before its answer (Server-Timing's whole)
    server_stages: dict[str, float] | None = None  # that time by stage (Server-Timing), seconds
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_text_s is None else self.first_text_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.send_s

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft_s=self.ttft_s, e2e_s=self.e2e_s)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


def server_timings(header: str | None) -> dict[str, float]:
    """Seconds per metric of a `Server-Timing` header (`name;dur=MS`, comma-separated); metrics
    without a duration are left out."""
    timings = {}
    for metric in (header or "").split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                try:
                    timings[name] = float(value) / 1000
                except ValueError:
                    pass
    return timings


def server_timing_s(header: str | None) -> float | None:
    """Seconds the server held the request (`tandem;dur=MS`; None without one)."""
    return server_timings(header).get("tandem")


def completion_body(model: str, request: WorkloadRequest, sampling: dict[str, Any]) -> dict[str, Any]:
    """The /v1/completions body: token-id prompt, exact length (ignore_eos), streamed with usage."""
    return {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **sampling}


def sampling_for(request: WorkloadRequest, temperature: float) -> dict[str, Any]:
    """Greedy, or seeded sampling (seed = the request's index, so every arm samples alike)."""
    if temperature == 0:
        return {"temperature": 0.0}
    return {"temperature": temperature, "seed": request.index}


CUT_OFF = "cut off"  # the error of a request still unfinished at the run's deadline


async def run_workload(url: str, model: str, workload: Workload, temperature: float = 0.0,
                       timeout_s: float = 1800.0, on_done: Callable[[RequestResult], None] | None = None,
                       transport: Any = None, drain_timeout_s: float | None = None) -> list[RequestResult]:
    """Send every request on schedule; return results in workload order (`transport`: for tests).

    With `drain_timeout_s`, requests still unfinished that long after the last one was due are
    cancelled (the client hangs up, so the server aborts them) and recorded with the error
    `cut off ...` and whatever arrived before: a slow arm cannot hold a bench for minutes."""
    import httpx

    limits = httpx.Limits(max_connections=workload.num_requests + 8, max_keepalive_connections=workload.num_requests + 8)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, transport=transport) as client:
        await client.get("/health")  # one warm connection; also fails fast if the server is down
        start = time.perf_counter()
        results = [RequestResult(index=r.index, send_s=r.arrival_s) for r in workload.requests]
        tasks = [asyncio.create_task(_send_at(client, model, r, start, temperature, on_done, result))
                 for r, result in zip(workload.requests, results)]
        if drain_timeout_s is None:
            await asyncio.gather(*tasks)
            return results
        last_due = max((r.arrival_s for r in workload.requests), default=0.0)
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, start + last_due + drain_timeout_s - time.perf_counter()))
        cut_at = time.perf_counter() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if result.end_s is None and result.error is None:
                result.error = f"{CUT_OFF} at {cut_at:.3f} s, {drain_timeout_s:g} s after the last arrival"
        return results


async def _send_at(client: Any, model: str, request: WorkloadRequest, start: float, temperature: float,
                   on_done: Callable[[RequestResult], None] | None, result: RequestResult) -> RequestResult:
    delay = start + request.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    result.send_s = time.perf_counter() - start
    try:
        await stream_completion(client, completion_body(model, request, sampling_for(request, temperature)), start,
                                result)
    except Exception as exc:  # recorded per request: one failure must not hide the others' timings
        result.error = f"{type(exc).__name__}: {exc}"
    if on_done is not None:
        on_done(result)
    return result


async def stream_completion(client: Any, body: dict[str, Any], start: float, result: RequestResult) -> None:
    """POST `body` to /v1/completions on an httpx client and read the stream into `result` (times
    from `start`, a `time.perf_counter()` value). A refusal ends at its answer, with its error."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result.status = response.status_code
        result.backend = response.headers.get(BACKEND_HEADER)
        projected = response.headers.get(PROJECTED_HEADER)
        result.projected_ttft_s = None if projected is None else float(projected) / 1000
        stages = server_timings(response.headers.get("server-timing"))
        result.server_s, result.server_stages = stages.pop("tandem", None), {k: round(v, 6) for k, v in stages.items()}
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            result.end_s, result.error = time.perf_counter() - start, f"HTTP {response.status_code}: {text}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.end_s = time.perf_counter() - start
                return
            _apply_chunk(json.loads(data), time.perf_counter() - start, result)
    if result.error is None:
        result.error = "stream ended without [DONE]"


def _apply_chunk(chunk: dict[str, Any], now_s: float, result: RequestResult) -> None:
    if "error" in chunk:
        result.error = f"error event: {chunk['error'].get('message')}"
        return
    result.num_chunks += 1
    result.req_id = result.req_id or chunk.get("id")
    for choice in chunk.get("choices") or []:
        if choice.get("text") and result.first_text_s is None:
            result.first_text_s = now_s
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
            if result.first_text_s is None:  # no text at all until the end: TTFT is the end
                result.first_text_s = now_s
    usage = chunk.get("usage")
    if usage:
        result.num_output_tokens = int(usage.get("completion_tokens", 0))
        result.num_prompt_tokens = int(usage.get("prompt_tokens", 0))
        result.num_cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def is_plain_text_chunk(line: bytes) -> bool:
    """Whether an SSE `data:` line is a text chunk with nothing else to read: no usage (or a null
    one) and no error. Generated text cannot hold either key: its quotes are escaped."""
    return b'"usage":null' in line or (b'"usage"' not in line and b'"error"' not in line)


async def post_streamed(session: Any, url: str, body: dict[str, Any],
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One streamed completion on an aiohttp session: `sent` (time.time()), and in seconds from it
    `headers` (the answer's status and headers), `first_event` (the first chunk with choices),
    `ttft` (the first with text, else `first_event`) and `e2e` (the end or the failure); `status` (0 without an answer), `tokens` (usage's
    completion_tokens), `error` (None if it succeeded; a 429 is a refusal, not an error) and
    `server_timing` (the answer's `Server-Timing` metrics, seconds by name). Chunks after the first text are parsed only when they name a usage or an error (the usage
    chunk, error events, and servers that put `"usage":null` in every chunk); plain text chunks,
    which leave both keys out as OpenAI's do, are skipped unparsed. A quote inside a JSON string
    is escaped, so generated text cannot fake either key."""
    record: dict[str, Any] = {"sent": time.time(), "first_event": None, "ttft": None, "e2e": None, "status": 0,
                              "tokens": 0, "error": None, "headers": None, "server_timing": {}}
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers or {}) as response:
            record["status"] = response.status
            record["headers"] = time.perf_counter() - start
            record["server_timing"] = server_timings(response.headers.get("server-timing"))
            if response.status != 200:
                text = (await response.text())[:300]
                record["error"] = None if response.status == 429 else f"HTTP {response.status}: {text}"
            else:
                done = False
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        done = True
                        break
                    if record["ttft"] is not None and is_plain_text_chunk(line):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["error"] = f"stream error: {json.dumps(event['error'])[:300]}"
                        continue
                    if event.get("usage"):
                        record["tokens"] = event["usage"].get("completion_tokens", 0)
                    choices = event.get("choices") or []
                    if choices and record["ttft"] is None:
                        now = time.perf_counter() - start
                        record["first_event"] = record["first_event"] or now
                        if any(c.get("text") for c in choices):
                            record["ttft"] = now
                if not done and record["error"] is None:
                    record["error"] = "stream ended without [DONE]"
                record["ttft"] = record["ttft"] or record["first_event"]  # a stream whose text was all empty
    except Exception as exc:  # aiohttp.ClientError, a timeout, a malformed event: this request failed
        record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    record["e2e"] = time.perf_counter() - start
    return record
