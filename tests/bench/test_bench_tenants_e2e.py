"""`tandem bench tenants` end to end: two CPU backends of a tiny random model, real Ray, Serve,
HTTP and engines, every policy arm on one reused cluster, then the report.

It checks what the mode must get right: every arm served every request with its exact output,
the arms share arrival times and tenants but not prefixes, a tenant's later requests hit its
prefix (the hit rate comes from the responses' usage), the KV cache flag reached the engines,
each cell's route-sim scenario replays the same arrivals, and the report has its table, verdict,
plot and JSON. It runs in a subprocess: the bench starts its own Ray instance, which must not
meet the session cluster of tests/cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATES = {"prefill_tok_s": 2000.0, "decode_tok_s": 200.0, "decode_tok_s_by_batch": {1: 200.0, 2: 380.0}}
ARMS = ["cost", "prefix-affinity", "least-requests", "round-robin", "random"]  # the default arms


def test_tenants_bench_on_two_cpu_backends(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"cpu0": RATES, "cpu1": RATES}))
    out, report = tmp_path / "tenants", tmp_path / "report" / "tenants-cpu.md"
    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "tenants", "--out", str(out),
               "--model", "tiny-llama-random", "--backends", "cpu*2", "--cpu-threads", "1", "--rates", str(rates),
               "--tenants", "2", "--prefix-tokens", "128", "--suffix-tokens", "16", "--max-tokens", "3",
               "--arrival-rates", "20", "--duration-s", "0.3", "--min-requests", "6", "--runs", "1",
               "--max-active", "2", "--cpu-max-active", "2", "--num-kv-blocks", "64", "--warmup-tokens", "2",
               "--drain-timeout-s", "60", "--time-budget-s", "400", "--report", str(report)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    records = {r["arm"]: r for r in (json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json")))}
    assert sorted(records) == sorted(ARMS)
    for arm, record in records.items():
        assert record["cluster"]["policy"] == arm
        assert {b["backend_id"] for b in record["cluster"]["backends"]} == {"cpu0", "cpu1"}
        assert [r["error"] for r in record["requests"]] == [None] * 6
        assert all(r["num_output_tokens"] == 3 and r["num_prompt_tokens"] == 144 for r in record["requests"])
        assert record["tenant_metrics"]["num_cut"] == 0
        assert len(record["decisions"]) == 6 and record["decisions"][0]["per_backend"]["cpu0"]["num_active"] is not None
    first = [records[arm]["workload"] for arm in ARMS]
    assert len({json.dumps((w["arrivals_s"], w["tenants"])) for w in first}) == 1  # the same arrivals and tenants
    assert len({w["token_seed"] for w in first}) == len(ARMS)  # prefixes of their own

    # A tenant's later request on a backend that served it before reuses the whole 128-token
    # prefix (8 blocks, prefix-affinity's key) and nothing of the suffix.
    affinity = records["prefix-affinity"]
    tenants = affinity["workload"]["tenants"]
    served = [(tenants[i], r["backend"]) for i, r in enumerate(affinity["requests"])]
    hits = [r["num_cached_tokens"] for r in affinity["requests"]]
    assert set(hits) <= {0, 128} and hits[0] == 0
    assert [i for i, h in enumerate(hits) if h] == [i for i in range(6) if served[i] in served[:i]] != []
    assert abs(affinity["tenant_metrics"]["hit_rate"] - sum(hits) / (6 * 144)) < 1e-9

    from tandem.routing.scenario import load_scenario

    scenario = load_scenario(out / "scenarios" / "t2-p128-r20.yaml")
    assert [b.num_kv_blocks for b in scenario.backends] == [64, 64]
    assert [b.device for b in scenario.backends] == [None, None]  # cpu backends: cores of their own
    run1 = [r for r in records.values() if r["run"] == 1][0]["workload"]
    # route-sim counts from the client's send (`sent_s`); the router sees each request its serving latency later
    assert [round(r.sent_s, 6) for r in scenario.requests] == run1["arrivals_s"]
    assert [r.tenant for r in scenario.requests] == run1["tenants"]

    summary = json.loads((out / "summary.json").read_text())
    (cell,) = summary["cells"]
    assert sorted(cell["arms"]) == sorted(ARMS) and "ttft_p95_s" in cell["verdict"]
    assert cell["arms"]["random"]["ttft_p95_s"]["n"] == 1 and cell["arms"]["random"]["hit_rate"]["n"] == 1
    assert cell["verdict"]["ttft_p95_s"]["ok"] is None  # one run: no spread to judge by
    text = report.read_text()
    assert "| 2 | 128 | 20 | **cost** |" in text and "| 2 | 128 | 20 | random |" in text
    assert "cost against the best other arm" in text
    assert (report.parent / "tenants-cpu-ttft-p95.png").stat().st_size > 0
    assert json.loads((report.parent / "tenants-cpu.json").read_text())["cells"][0]["cell"] == "t2-p128-r20"
