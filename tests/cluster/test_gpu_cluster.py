"""The cluster on a CUDA machine: `auto` becomes a cuda backend next to the cpu one, rates are
profiled on first start, HTTP requests land on both kinds of backend, and a killed cuda backend
is restarted by Ray and rejoins. Skipped without CUDA; also runs as a script
(`python3 tests/cluster/test_gpu_cluster.py`) where pytest is not installed.

Uses only the standard library on the client side (the GPU machine has no httpx or openai).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

try:  # pytest is absent on the GPU machine, where this file also runs as a script
    import pytest

    pytestmark = [pytest.mark.slow, pytest.mark.gpu]
except ImportError:
    pass

MODEL = "qwen2.5-0.5b-random"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def run_gpu_cluster_checks(log=print) -> dict:
    import ray

    from tandem import cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    tmp = tempfile.mkdtemp(prefix="tandem-gpu-")
    start = time.perf_counter()
    tandem = cluster.start(model=MODEL, backends=["cpu", "auto"], port=_free_port(), metrics_port=_free_port(),
                           routing_log=f"{tmp}/routing.jsonl", rates_cache=f"{tmp}/rates-cache.json",
                           access_log=False, log=log)
    report: dict = {"start_s": round(time.perf_counter() - start, 1)}
    try:
        infos = ray.get(tandem.router.backend_infos.remote())
        report["backends"] = {b: {"device": i.device, "dtype": i.dtype, "threads": i.threads, "rates": i.rates}
                              for b, i in infos.items()}
        assert set(infos) == {"cpu0", "cuda0"} and infos["cuda0"].device.startswith("cuda"), report
        url = tandem.url + "/v1/completions"
        prefix = "The history of the city is long and full of events. " * 40

        def call(i: int) -> tuple[int, str, dict]:
            time.sleep(0.05 * i)  # arrivals every 50 ms, as in the design's experiment
            body = {"model": MODEL, "prompt": prefix + f"Request {i}.", "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True}
            status, headers, data = _post(url, body)
            return status, headers.get("x-tandem-backend", ""), data.get("usage", {})

        _post(url, {"model": MODEL, "prompt": prefix, "max_tokens": 1})  # seed the cuda cache
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(call, range(16)))
        report["placement"] = [b for _, b, _ in results]
        report["cached_tokens"] = [u.get("prompt_tokens_details", {}).get("cached_tokens") for _, _, u in results]
        assert all(s == 200 for s, _, _ in results), results
        assert "cuda0" in report["placement"], report

        old = ray.get(tandem.backends["cuda0"].ping.remote())
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, i) for i in range(8)]
            time.sleep(1.0)
            ray.kill(tandem.backends["cuda0"], no_restart=False)
            statuses = [f.result(timeout=300)[0] for f in futures]
        report["statuses_after_kill"] = statuses
        assert set(statuses) <= {200, 503}, statuses
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            infos = ray.get(tandem.router.backend_infos.remote())
            if "cuda0" in infos and infos["cuda0"].instance_id != old:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("cuda0 did not rejoin")
        report["rejoined_s"] = round(time.perf_counter() - start, 1)
        status, _, _ = _post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert status == 200
    finally:
        tandem.shutdown()
    return report


def test_gpu_cluster():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run_gpu_cluster_checks()


if __name__ == "__main__":
    print(json.dumps(run_gpu_cluster_checks(log=lambda line: print(line, flush=True)), indent=1))
    sys.exit(0)
