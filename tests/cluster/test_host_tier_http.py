"""The host KV tier end to end: `tandem serve` with one sim backend whose device cache holds one
prompt's prefix at a time and whose host tier holds them all. A prefix evicted from the device
comes back from the host: the response's usage counts it cached and its `tandem` field says how
much came from the host, and the router, which mirrors both tiers from the backend's reports,
scored it as a host-tier hit priced at the profile's reload rate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.cluster.conftest import TIMEOUT_S, free_port, start_serve, wait_for

pytestmark = pytest.mark.slow

RELOAD_TOK_S = 1_000_000.0
PROFILE = {"description": "a device with millisecond steps and a host KV tier, for tests", "prefill_tok_s": 20000.0,
           "decode_tok_s": 1000.0, "max_active": 2, "host_reload_tok_s": RELOAD_TOK_S}
PREFIX_TOKENS = 256  # 16 blocks; the device cache has 40 usable blocks


def prefix(i: int) -> list[int]:
    return [3 + (7 * i + 13 * t) % 200 for t in range(PREFIX_TOKENS)]


def start_server(tmp_path, port: int) -> tuple[subprocess.Popen, list[str]]:
    (tmp_path / "device.json").write_text(json.dumps(PROFILE))
    config = {"model": "tiny-llama-random", "port": port, "metrics_port": free_port(),
              "routing_log": str(tmp_path / "routing.jsonl"), "warmup_tokens": 0,
              "backends": [{"device": "sim", "profile": str(tmp_path / "device.json"), "num_kv_blocks": 41,
                            "kv_host_memory_gb": 0.05}]}
    (tmp_path / "tandem.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("TANDEM_CACHE_DIR", None)
    return start_serve([sys.executable, "-m", "tandem.cluster.cli", "serve", "--config", str(tmp_path / "tandem.yaml")],
                       env)


def test_a_prefix_the_device_evicted_is_reloaded_from_the_host_and_priced_so(tmp_path):
    port = free_port()
    proc, _ = start_server(tmp_path, port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        def complete(prompt: list[int]) -> dict:
            r = httpx.post(url, json={"model": "tiny-llama-random", "prompt": prompt, "max_tokens": 2},
                           timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
            return r.json()

        first = complete(prefix(0) + [250])
        assert first["tandem"]["host_cached_tokens"] == 0
        # A second use: the tier keeps only blocks that were hit (a prefix used once is not offloaded).
        assert complete(prefix(0) + [249])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        for i in (1, 2, 3):  # each fills most of the device cache: prefix 0 is evicted to the host tier
            complete(prefix(i) + [250])
        time.sleep(0.5)  # the backend's reports of the evictions reach the router's mirror
        again = complete(prefix(0) + [251, 252])
        host = again["tandem"]["host_cached_tokens"]
        assert host > 0 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= host

        log = tmp_path / "routing.jsonl"
        line = wait_for(lambda: next((json.loads(x) for x in log.read_text().splitlines()
                                      if json.loads(x)["req_id"] == again["id"]), None), what="the decision's log line")
        score = line["per_backend"]["sim0"]
        assert line["host_cache_answers"]["sim0"] == score["num_host_cached_tokens"] > 0
        assert score["reload_term_s"] == pytest.approx(score["num_host_cached_tokens"] / RELOAD_TOK_S, rel=1e-3)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
