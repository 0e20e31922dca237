"""The HTTP API against a real cluster: OpenAI-client parity with `tandem generate`, routing
across two backends, metrics on the scrape endpoint, the driver API and API keys."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.conftest import MODEL, TIMEOUT_S, backends_idle, wait_for

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference():
    """Greedy text from `tandem generate` (the in-process engine), for plain and chat prompts."""
    from tandem.engine.cli import generate
    from tandem.engine.config import EngineConfig
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    config = EngineConfig(model=MODEL, num_threads=1)
    return {"plain": generate(PROMPT, params, config)["text"],
            "chat": generate(QUESTION, params, config, chat=True)["text"]}


def test_health_and_models(http, tandem):
    import ray

    health = http.get("/health")
    assert health.status_code == 200 and set(health.json()["backends"]) == {"cpu0", "cpu1"}
    [card] = http.get("/v1/models").json()["data"]
    context = next(iter(ray.get(tandem.router.backend_infos.remote()).values())).max_model_len
    assert (card["id"], card["max_model_len"]) == (MODEL, context)  # vLLM's card carries the context too
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == context


def test_reference_is_sensible(reference):
    assert "Paris" in reference["plain"] and "Paris" in reference["chat"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_openai_completions_match_tandem_generate(openai_client, reference, stream):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(openai_client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    else:
        response = openai_client.completions.create(**kwargs)
        text = response.choices[0].text
        assert response.usage.completion_tokens == MAX_TOKENS or response.choices[0].finish_reason == "stop"
        assert response.model_extra["tandem"]["backend"] in ("cpu0", "cpu1")
    assert text == reference["plain"]


def block_size(tandem) -> int:
    import ray

    infos = ray.get([b.info.remote() for b in tandem.refresh_backends().values()], timeout=TIMEOUT_S)
    assert len({info.block_size for info in infos}) == 1, infos
    return infos[0].block_size


def full_prefix_hit(num_prompt_tokens: int, block_size: int) -> int:
    """Cached tokens of a prompt its backend has seen whole: every full block short of the last
    token, which is always computed (engine/kv_cache/manager.py)."""
    return (num_prompt_tokens - 1) // block_size * block_size


def until_a_backend_repeats(send, num_backends: int = 2) -> list[tuple[str, int, int]]:
    """(backend, prompt tokens, cached tokens) of `send()`'s calls, one at a time, until a backend
    serves the same prompt a second time: with two backends, the third call at the latest."""
    served = []
    for _ in range(num_backends + 1):
        served.append(send())
        if served[-1][0] in {backend for backend, _, _ in served[:-1]}:
            return served
    raise AssertionError(f"no backend served the prompt twice in {len(served)} calls: {served}")


def check_cached_tokens(served: list[tuple[str, int, int]], block_size: int) -> None:
    """Each call's cached tokens are whole blocks within the prompt; the call on a backend that
    has served this prompt before in the test hits every one of its full blocks."""
    num_prompt_tokens = {p for _, p, _ in served}
    assert len(num_prompt_tokens) == 1, served
    full = full_prefix_hit(num_prompt_tokens.pop(), block_size)
    assert full > 0, f"the prompt must span more than a {block_size}-token block: {served}"
    for i, (backend, _, cached) in enumerate(served):
        if backend in {b for b, _, _ in served[:i]}:
            assert cached == full, served
        else:  # first on this backend here: earlier tests may have left part or all of it cached
            assert cached % block_size == 0 and 0 <= cached <= full, served


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_openai_chat_matches_tandem_generate(tandem, openai_client, reference, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        response = openai_client.chat.completions.create(**kwargs)
        assert response.choices[0].message.role == "assistant"
        assert response.choices[0].message.content == reference["chat"]
        return

    def send() -> tuple[str, int, int]:
        raw = openai_client.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, **kwargs)
        chunks = list(raw.parse())
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]
        usage = chunks[-1].usage
        return raw.headers["x-tandem-backend"], usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    check_cached_tokens(until_a_backend_repeats(send), block_size(tandem))


def test_repeated_prompt_reports_cached_tokens(tandem, http):
    body = {"model": MODEL, "prompt": "Tell me a story. " * 8, "max_tokens": 2, "temperature": 0}

    def send() -> tuple[str, int, int]:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return r.headers["x-tandem-backend"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    check_cached_tokens(until_a_backend_repeats(send), block_size(tandem))


def test_requests_split_across_backends_agree_with_routing_log(tandem, routing_log):
    prompts = [f"Write one word about the number {i}." for i in range(6)]

    def call(prompt: str, stream: bool):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
        with httpx.Client(base_url=tandem.url, timeout=TIMEOUT_S) as client:
            if not stream:
                r = client.post("/v1/completions", json=body)
                return r.headers["x-tandem-backend"], r.json()["id"], r.json()["tandem"]["backend"]
            with client.stream("POST", "/v1/completions", json=body) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
                return r.headers["x-tandem-backend"], events[0]["id"], events[-1]["tandem"]["backend"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(call, prompts, [i % 2 == 1 for i in range(len(prompts))]))
    logged = {line["req_id"]: line["backend_id"] for line in routing_log()}
    for header, req_id, in_body in results:
        assert header == in_body == logged[req_id]
    assert {header for header, _, _ in results} == {"cpu0", "cpu1"}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_an_answer_says_where_its_time_to_admission_went(tandem, stream):
    """`Server-Timing` on a served answer: the admission's stages (cluster/dispatch.py
    `admission_stages`), none negative, adding up to the whole (`tandem`) within the rounding."""
    from bench.client import server_timings

    body = {"model": MODEL, "prompt": "Timing", "max_tokens": 2, "temperature": 0, "stream": stream}
    with httpx.Client(base_url=tandem.url, timeout=TIMEOUT_S) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.read()
            timings = server_timings(r.headers["server-timing"])
    whole = timings.pop("tandem")
    assert {"prepare", "route"} <= set(timings) and ("prefill" in timings or "admit" in timings)
    assert all(seconds >= 0 for seconds in timings.values())
    assert sum(timings.values()) == pytest.approx(whole, abs=0.00001 * (len(timings) + 1))


def test_metrics_on_the_scrape_endpoint(tandem):
    wanted = ["ray_tandem_backend_generation_tokens_total", "ray_tandem_backend_prompt_tokens_total",
              "ray_tandem_backend_ttft_seconds_bucket", "ray_tandem_backend_e2e_seconds_bucket",
              "ray_tandem_backend_queue_time_seconds_bucket", "ray_tandem_backend_step_time_seconds_bucket",
              "ray_tandem_backend_running_requests", "ray_tandem_backend_kv_cache_usage",
              "ray_tandem_backend_prefix_cache_queries_total", "ray_tandem_router_decisions_total",
              "ray_tandem_router_estimated_cost_seconds", "ray_tandem_router_realised_completion_seconds_bucket",
              "ray_tandem_http_requests_total"]

    def complete(i: int) -> str:  # traffic of its own, on both backends, so the test stands alone
        body = {"model": MODEL, "prompt": f"Metrics {i}", "max_tokens": 2}
        return httpx.post(tandem.url + "/v1/completions", json=body, timeout=TIMEOUT_S).headers["x-tandem-backend"]

    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(complete, range(4))) == {"cpu0", "cpu1"}

    def scrape() -> str | None:
        text = httpx.get(tandem.metrics_url, timeout=10).text
        present = all(name in text for name in wanted)
        both = all(f'backend="{b}"' in text for b in ("cpu0", "cpu1"))
        return text if present and both else None

    text = wait_for(scrape, timeout_s=45, interval_s=2, what="Tandem series on the metrics endpoint")
    decisions = [line for line in text.splitlines() if line.startswith("ray_tandem_router_decisions_total{")]
    assert any('policy="cost"' in line for line in decisions)


def test_driver_api_generates_without_http(tandem, reference):
    from tandem.engine.sampling_params import SamplingParams

    outs = list(tandem.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)))
    assert "".join(o.new_text for o in outs) == reference["plain"]
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == outs[-1].usage.completion_tokens


def test_connect_from_another_process(tandem):
    import ray

    # The explicit address, not "auto": other Ray instances may run on this machine.
    address = ray.get_runtime_context().gcs_address
    script = (f"from tandem import cluster; t = cluster.connect({address!r}); "
              "print(sorted(t.backends)); t.shutdown()")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "['cpu0', 'cpu1']" in result.stdout


def test_api_key_is_enforced(tandem):
    base = tandem.url + "/secure/v1"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.post(base + "/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = client.post(base + "/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    wait_for(lambda: backends_idle(tandem), timeout_s=TIMEOUT_S, what="idle backends")


def test_api_key_guards_the_api_description_too(tandem):
    """With a key, only /health and /metrics answer without it: FastAPI's /openapi.json, /docs
    and /redoc need it like the API itself. Without a key they stay open."""
    secure, key = tandem.url + "/secure", {"Authorization": "Bearer sekret"}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for path in ("/openapi.json", "/docs", "/redoc", "/v1/models"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = client.get(secure + path, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
                assert "paths" not in r.text
            assert client.get(secure + path, headers=key).status_code == 200, path
        schema = client.get(secure + "/openapi.json", headers=key).json()
        assert "/v1/chat/completions" in schema["paths"] and schema["servers"] == [{"url": "/secure"}]
        assert "/secure/openapi.json" in client.get(secure + "/docs", headers=key).text
        for path in ("/health", "/metrics"):
            assert client.get(secure + path).status_code == 200, path
        for path in ("/openapi.json", "/docs", "/redoc"):  # the app without a key
            assert client.get(tandem.url + path).status_code == 200, path
        assert "/v1/completions" in client.get(tandem.url + "/openapi.json").json()["paths"]
