"""Smoke test of `python -m bench.served_path` at toy sizes: it runs and writes its rows.
In a subprocess, because the cluster tests hold a Ray instance in this process."""

import json
import os
import subprocess
import sys


def test_served_path_bench_writes_a_row_per_system(tmp_path):
    out = tmp_path / "served.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, "-m", "bench.served_path", "--num-requests", "2", "--max-tokens", "4",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["in-process LLMEngine",
                                           "through actors, one channel per caller (the default)",
                                           "through actors, a generator per request, stream_interval_s=0",
                                           "through actors, a generator per request, stream_interval_s=0.01"]
    assert all(r["output_tok_s"] > 0 for r in rows)
