"""`tandem bench serve-load`: its workloads, its summary arithmetic, its client against a canned SSE
server (no Ray), and (slow) the whole bench against a real `tandem serve` on CPU."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.harness import Server
from bench.serve_load import default_client_procs, make_workload, parse_config, run_load, split_clients, startup_lines, summarize

ROOT = Path(__file__).resolve().parents[2]


# -- workloads -----------------------------------------------------------------------------------
def test_fixed_workload_shape_ids_and_counts():
    reqs = make_workload("fixed", 4)
    assert len(reqs) == 256 and len(make_workload("fixed", 256)) == 1024  # max(256, 4 C)
    assert all(len(p) == 516 and m == 128 for p, m in reqs)
    assert all(3 <= t < 250 for p, _ in reqs for t in p)
    assert len({tuple(p) for p, _ in reqs}) == 256  # each its own prompt: no prefix-cache help
    small = make_workload("fixed", 4, num_requests=8, prompt_len=32, max_tokens=8)
    assert len(small) == 8 and all(len(p) == 32 and m == 8 for p, m in small)
    assert small == make_workload("fixed", 4, num_requests=8, prompt_len=32, max_tokens=8)


def test_w_and_nanovllm_workloads_ranges_counts_and_seed():
    w = make_workload("w", 64)
    assert len(w) == 512 and all(64 <= len(p) <= 2048 and 32 <= m <= 1024 for p, m in w)
    assert make_workload("w", 64) == w
    nano = make_workload("nanovllm", 64)
    assert len(nano) == 256 and all(100 <= len(p) <= 1024 and 100 <= m <= 1024 for p, m in nano)
    assert all(3 <= t < 250 for p, _ in nano for t in p)
    # Spread over the range, not stuck at one value.
    assert min(len(p) for p, _ in nano) < 200 and max(len(p) for p, _ in nano) > 900
    assert min(m for _, m in nano) < 200 and max(m for _, m in nano) > 900
    assert make_workload("nanovllm", 64) == nano
    assert len(make_workload("nanovllm", 64, num_requests=12)) == 12
    with pytest.raises(ValueError):
        make_workload("sharegpt", 4)


def test_client_processes():
    assert [default_client_procs(c) for c in (1, 4, 31, 32, 64, 100, 256, 1024)] == [1, 1, 1, 1, 2, 3, 8, 8]
    assert split_clients(10, 3) == [4, 3, 3]
    assert split_clients(256, 8) == [32] * 8
    assert split_clients(2, 8) == [1, 1]  # never an empty process
    assert sum(split_clients(257, 8)) == 257


def test_config_flags_are_shell_split():
    assert parse_config("hybrid=--backends cpu,cuda --max-active 256") == (
        "hybrid", ["--backends", "cpu,cuda", "--max-active", "256"])
    assert parse_config("quoted=--routing-log '/tmp/a b.jsonl'") == ("quoted", ["--routing-log", "/tmp/a b.jsonl"])
    assert parse_config("default=") == ("default", [])
    for bad in ("no-equals", "=--flags", "a/b=--x", "unclosed=--x 'y"):
        with pytest.raises(Exception):
            parse_config(bad)


def test_startup_lines_skip_noise():
    log = ("tandem: starting m\n(BackendActor pid=12) backend cpu0 loaded\nINFO 2026 serve started\n"
           "\nUserWarning: something\nerror: --backends: unknown device\ntandem: Ctrl-C stops the server\n")
    assert startup_lines(log) == ["tandem: starting m", "error: --backends: unknown device",
                                  "tandem: Ctrl-C stops the server"]
    assert Server.UP_LINE in log


# -- summary arithmetic ----------------------------------------------------------------------------
def _record(sent, e2e, ttft=None, status=200, tokens=0, error=None):
    return {"sent": sent, "e2e": e2e, "ttft": ttft, "status": status, "tokens": tokens, "error": error}


def test_summary_counts_rates_and_percentiles():
    records = [
        _record(100.0, 2.0, ttft=0.1, tokens=100),
        _record(100.5, 3.0, ttft=0.3, tokens=100),
        _record(101.0, 1.0, ttft=0.2, tokens=100),
        _record(101.0, 0.01, status=429),  # refused, not retried
        _record(101.5, 0.01, status=429),
        _record(102.0, 0.5, status=0, error="ServerDisconnectedError: x"),
        _record(102.0, 1.0, ttft=0.05, status=200, tokens=20, error="stream error: {}"),  # 200, failed mid-stream
        _record(103.0, 0.02, status=500, error="HTTP 500: boom"),
    ]
    s = summarize(records)
    assert (s["num_requests"], s["ok"], s["refused_429"], s["errors"]) == (8, 3, 2, 3)
    # First send at 100.0, last finish at 100.5 + 3.0 = 103.5: 3.5 s; tokens of every request.
    assert s["wall_s"] == 3.5 and s["output_tokens"] == 320
    assert s["output_tok_s"] == round(320 / 3.5, 1)
    # TTFT and E2E over the requests that succeeded only (percentiles interpolate linearly).
    assert s["ttft_p50_ms"] == 200.0 and s["ttft_p95_ms"] == 290.0
    assert s["e2e_p50_s"] == 2.0
    assert s["error_samples"] == ["ServerDisconnectedError: x", "stream error: {}", "HTTP 500: boom"]


def test_summary_all_refused_and_empty():
    s = summarize([_record(10.0, 0.01, status=429) for _ in range(4)])
    assert (s["ok"], s["refused_429"], s["errors"], s["output_tok_s"]) == (0, 4, 0, 0.0)
    assert s["ttft_p50_ms"] is None and s["e2e_p50_s"] is None
    empty = summarize([])
    assert empty["num_requests"] == 0 and empty["output_tok_s"] == 0.0


# -- the client against a canned SSE server --------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def canned_server():
    """/v1/completions: 429 for prompts starting with 7, an error event for those starting with 8,
    else `max_tokens` text chunks (the first one empty) then usage and [DONE], as Tandem sends them."""
    from aiohttp import web

    seen: list[dict] = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        if body["prompt"][0] == 7:
            return web.json_response({"error": {"message": "overloaded"}}, status=429)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        if body["prompt"][0] == 8:
            await response.write(b'data: {"error":{"message":"engine died"}}\n\ndata: [DONE]\n\n')
            return response
        for i in range(body["max_tokens"]):
            text = "" if i == 0 else "\"usage\":{x}"  # generated text that looks like a key
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}
            await response.write(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
            await asyncio.sleep(0.001)
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode())
        return response

    port = _free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}/v1/completions", seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_closed_loop_over_processes_counts_refusals(canned_server):
    url, seen = canned_server
    requests = [([20 + i, 4, 5], 5) for i in range(10)] + [([7, 4], 5), ([7, 5], 5), ([8, 4], 5)]
    records, cpu_shares = run_load(url, "m", requests, clients=3, procs=2, timeout_s=30,
                                   headers={"Authorization": "Bearer k"})
    assert [r["index"] for r in records] == list(range(13))  # each request exactly once
    assert len(seen) == 13 and len(cpu_shares) == 2
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 and b["stream_options"] == {"include_usage": True}
               for b in seen)
    s = summarize(records)
    assert (s["ok"], s["refused_429"], s["errors"]) == (10, 2, 1)
    assert s["output_tokens"] == 50
    assert all(r["ttft"] is not None and r["ttft"] <= r["e2e"] for r in records if r["status"] == 200 and r["error"] is None)
    assert s["error_samples"] == ['stream error: {"message": "engine died"}']


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_against_a_real_server(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"cpu": {"prefill_tok_s": 2000.0, "decode_tok_s": 200.0}}))
    flags = (f"--backends cpu --cpu-threads 1 --http-replicas 1 --profile never --rates {rates} "
             f"--warmup-tokens 0 --metrics-port {_free_port()}")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "serve-load", "--model", "tiny-llama-random", "--config", f"tiny={flags}",
               "--workload", "fixed", "--clients", "4", "--num-requests", "8", "--prompt-len", "32",
               "--max-tokens", "8", "--port", str(_free_port()), "--start-timeout-s", "120", "--out", str(out)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "serve_load.json").read_text())
    [config] = report["configs"]
    assert config["started"] and config["stop"]["clean"], config
    assert any("Ctrl-C stops the server" in line for line in config["startup_lines"])
    assert not any("pid=" in line or "INFO" in line for line in config["startup_lines"])
    [row] = report["rows"]
    assert (row["config"], row["workload"], row["clients"], row["client_procs"]) == ("tiny", "fixed", 4, 1)
    assert (row["num_requests"], row["ok"], row["refused_429"], row["errors"]) == (8, 8, 0, 0)
    assert row["output_tokens"] == 64 and row["output_tok_s"] > 0 and row["ttft_p50_ms"] is not None
    assert report["machine"]["cpu_count"] == os.cpu_count()
    assert "tiny" in done.stdout and "tok/s" in done.stdout


def test_each_concurrency_has_prompts_of_its_own():
    """A row run after another must not find its prompts in the prefix cache the other filled."""
    four = {tuple(p) for p, _ in make_workload("fixed", 4, num_requests=16)}
    eight = {tuple(p) for p, _ in make_workload("fixed", 8, num_requests=16)}
    assert not four & eight
