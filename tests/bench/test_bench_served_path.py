"""Smoke test of `tandem bench served-path` at toy sizes: it runs and writes its rows.
In a subprocess, because the cluster tests hold a Ray instance in this process."""

import json
import os
import subprocess
import sys

import pytest


def test_served_path_runs_every_row_at_toy_scale(tmp_path):
    """The GPU bench's code path on the CPU (tiny model, a twentieth of the sizes): the rows and the
    burst TTFT spreads come out, so it does not rot between GPU runs."""
    out = tmp_path / "served-http.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "bench", "served-path", "--model",
                           "tiny-llama-random", "--device", "cpu", "--dtype", "float32", "--threads", "1", "--scale", "0.05",
                           "--repeats", "1", "--ttft-requests", "2", "--capacity-rates", "", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 3
    for row in result["rows"]:
        assert row["in_process_tok_s"] > 0 and row["http_tok_s"] > 0
        # one rate per repeat (the warm-up excluded) on each side, the best among them
        assert len(row["in_process_tok_s_runs"]) == len(row["http_tok_s_runs"]) == 1
        assert max(row["http_tok_s_runs"]) == pytest.approx(row["http_tok_s"], abs=0.1)
        assert row["ratio_of_medians"] > 0
        for p50, worst in row["ttft_p50_max_ms"].values():
            assert 0 < p50 <= worst
        steps, mean_ms = row["in_process_steps_mean_ms"]
        assert steps > 0 and mean_ms > 0
        # the engine's steps of the best burst, in process and behind HTTP, host work apart
        for work in row["step_work"].values():
            assert work["steps"] > 0 and work["host_ms_per_step"] > 0 and work["device_wait_ms_per_step"] >= 0
        # the busiest processes over the burst, by role. A toy burst lasts a few ms, under the
        # kernel's 10 ms CPU-time tick, so which process was charged a tick is chance: only the
        # shape is checked here (tests/bench/test_soak.py checks the differencing).
        assert 0 < len(row["server_cpu"]) <= 5
        assert all(share >= 0 for share in row["server_cpu"].values())
    # one lone-request row per prompt length (516 and 4160, scaled)
    assert [t["prompt_tokens"] for t in result["ttft"]] == [25, 208]
    assert all(t["http_ms"] > 0 and t["in_process_ms"] > 0 for t in result["ttft"])
    for t in result["ttft"]:  # where the lone requests' time went, from the answers' Server-Timing
        parts = t["http_parts_ms"]
        assert {"prepare", "route", "tandem", "to_headers", "to_first_chunk"} <= set(parts) and parts["tandem"] > 0
