"""`tandem bench sweep` end to end on one reused cluster: real Ray, Serve, HTTP and engines.

A tiny random model on two CPU backends (`auto` resolves to a second cpu backend here), two
max_active cells, both arms, one run each. It checks what the reused cluster must get right:
every arm ran at its cell's max_active, the accelerator-only arm used only the `auto` backend
(the other one cordoned), each arm had its own prompts, and the warm-up fed the router's
online calibration before the first measured request. It runs in a subprocess: the bench
starts its own Ray instance, which must not meet the session cluster of tests/cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATES = {"prefill_tok_s": 2000.0, "decode_tok_s": 200.0, "decode_tok_s_by_batch": {1: 200.0, 2: 380.0}}


def test_sweep_on_one_reused_cluster(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"cpu0": RATES, "cpu1": RATES}))
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "sweep", "--out", str(out),
               "--model", "tiny-llama-random", "--cpu-threads", "1", "--rates", str(rates),
               "--num-requests", "4", "--runs", "1", "--prompt-tokens", "48", "--max-tokens", "4",
               "--accel-max-active", "1,2", "--base-max-active", "2", "--arrival-rates", "", "--cache-hit", "",
               "--lengths", "", "--warmup-tokens", "4", "--time-budget-s", "300"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    meta = json.loads((out / "meta.json").read_text())
    assert meta["reuse_cluster"] is True and meta["warmup_tokens"] == 4
    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    assert {(r["cell_spec"]["accel_max_active"], r["arm"]) for r in records} == {
        (1, "accelerator-only"), (1, "cost"), (2, "accelerator-only"), (2, "cost")}
    for record in records:
        backends = {b["backend_id"]: b for b in record["cluster"]["backends"]}
        accel = meta["accel_id"]
        assert backends[accel]["max_active"] == record["cell_spec"]["accel_max_active"]
        served_by = {r["backend"] for r in record["requests"]}
        assert all(r["num_output_tokens"] == 4 for r in record["requests"])
        if record["arm"] == "accelerator-only":
            assert set(backends) == {accel} and served_by == {accel}
        else:
            assert set(backends) == {"cpu0", "cpu1"}
        assert record["cluster"]["router"]["calibration_alpha"] == 0.2
        # The warm-up's steps were observed: the calibrated rates moved off the profile.
        assert record["router_rates_at_start"][accel]["decode_tok_s"] != RATES["decode_tok_s"]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["cells"]) == 2


def test_reused_cluster_gives_each_arm_its_own_prompts():
    from bench.runner import token_seed
    from bench.workload import CellSpec

    cell = CellSpec(num_requests=4, prompt_tokens=48, max_tokens=4, cache_hit=0.96, interval_s=0.05,
                    accel_max_active=1)
    assert token_seed(cell, 1) == token_seed(cell, 1)  # fresh clusters: the same prompts per arm
    a, b = cell.workload(token_seed(cell, 1, "cost")), cell.workload(token_seed(cell, 1, "accelerator-only"))
    assert a.seed_prompts != b.seed_prompts
    assert [len(r.prompt_token_ids) for r in a.requests] == [len(r.prompt_token_ids) for r in b.requests]


def test_reused_cluster_keeps_poisson_arrivals_the_same_across_arms():
    from bench.runner import token_seed
    from bench.workload import CellSpec

    cell = CellSpec(num_requests=6, arrival="poisson", rate_per_s=10.0)
    a = cell.workload(token_seed(cell, 2, "cost"), arrival_seed=token_seed(cell, 2))
    b = cell.workload(token_seed(cell, 2, "accelerator-only"), arrival_seed=token_seed(cell, 2))
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert a.requests[0].prompt_token_ids != b.requests[0].prompt_token_ids
    other_run = cell.workload(token_seed(cell, 3, "cost"), arrival_seed=token_seed(cell, 3))
    assert [r.arrival_s for r in other_run.requests] != [r.arrival_s for r in a.requests]
