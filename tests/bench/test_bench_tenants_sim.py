"""`tandem bench tenants` on four sim backends: the router's multi-tenant grid, live through
HTTP, on emulated devices (engine/sim_runner.py), as CI can run it on two cores.

Every arm serves the same arrivals and tenants through real Ray actors, Serve, HTTP and engine
cores, whose schedulers and prefix caches are the real ones; only the forward pass is a profiled
step time. The caches hold every tenant's prefix, so a policy loses hits only by spreading a
tenant over backends that must each prefill it once: `cost` keeps a tenant where its prefix is
(the recompute term) and must reach the best hit rate of all the arms in every cell. A sim's
output is its `max_tokens` pseudo-random ids, so every request's token counts are exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILE = {"description": "a device with millisecond steps, for tests", "prefill_tok_s": 20000.0,
           "decode_tok_s": 1000.0, "max_active": 4, "decode_s_per_context_token_by_batch": {"1": 2e-7, "4": 1e-7}}
ARMS = ["cost", "prefix-affinity", "least-requests", "round-robin", "random"]


def test_cost_has_the_best_hit_rate_of_every_arm_on_four_sim_backends(tmp_path):
    profile = tmp_path / "device.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "tenants"
    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "tenants", "--out", str(out),
               "--model", "tiny-llama-random", "--backends", "sim*4", "--sim-profile", str(profile),
               "--tenants", "8", "--prefix-tokens", "256", "--suffix-tokens", "16", "--max-tokens", "4",
               "--arrival-rates", "10,40", "--duration-s", "3", "--min-requests", "30", "--runs", "1",
               "--max-active", "4", "--num-kv-blocks", "200", "--warmup-tokens", "2",
               "--drain-timeout-s", "60", "--time-budget-s", "600", "--step-profile", str(profile)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    records = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    assert sorted((r["cell"], r["arm"]) for r in records) == sorted(
        (cell, arm) for cell in ("t8-p256-r10", "t8-p256-r40") for arm in ARMS)
    for record in records:
        assert {b["backend_id"] for b in record["cluster"]["backends"]} == {"sim0", "sim1", "sim2", "sim3"}
        assert all(r["error"] is None for r in record["requests"])
        assert all(r["num_output_tokens"] == 4 and r["num_prompt_tokens"] == 272 for r in record["requests"])
        assert {r["backend"] for r in record["requests"]} <= {"sim0", "sim1", "sim2", "sim3"}
        # each engine's own work over the run: the tokens it generated for the requests sent to it
        work = record["engine_work"]
        assert set(work) == {"sim0", "sim1", "sim2", "sim3"}
        for backend_id, w in work.items():
            sent = sum(r["backend"] == backend_id for r in record["requests"])
            assert w["generated_tokens"] >= 3 * sent  # the first of each request's 4 is a prefill's
            assert (w["busy_share"] > 0) == (sent > 0) and w["busy_share"] <= 1.05
            assert (w["steps"] > 0) == (sent > 0)
            assert w["host_ms_per_step"] >= 0 and w["device_wait_ms_per_step"] >= 0

    summary = json.loads((out / "summary.json").read_text())
    for cell in summary["cells"]:
        hit = {arm: cell["arms"][arm]["hit_rate"]["mean"] for arm in ARMS}
        assert all(hit["cost"] >= rate for rate in hit.values()), (cell["cell"], hit)
        # Each tenant's first request misses wherever it goes, so no arm reaches 100%; a tenant
        # spread over the four backends misses up to four times (round-robin's loss).
        assert hit["cost"] < 256 / 272 and hit["round-robin"] < hit["cost"]
        # the engine's part of TTFT (its queue and first step, from the answers' Server-Timing)
        for m in cell["arms"].values():
            assert 0 < m["engine_ttft_p50_s"]["mean"] < m["ttft_p50_s"]["mean"]

    # The serving path's latency, measured with lone requests before the cells, goes into every
    # cell's route-sim scenario: route-sim's TTFT counts from the client's send, as the live one does.
    latency = summary["meta"]["serving_latency"]
    assert sorted(map(int, latency["by_prompt_tokens"])) == [32, 272]
    assert latency["fixed_s"] > 0 and latency["per_prompt_token_s"] >= 0
    import yaml

    scenario = yaml.safe_load((out / "scenarios" / "t8-p256-r10.yaml").read_text())
    assert scenario["serving"] == {k: latency[k] for k in ("fixed_s", "per_prompt_token_s")}
    # and each sim backend's step timing beyond its rates, as its emulated device runs it, with
    # the host work per step its engine did behind the server in a burst before the cells
    # (an engine the router sent none of the burst has none)
    floor = summary["meta"]["host_floor"]
    assert floor and set(floor) <= {"sim0", "sim1", "sim2", "sim3"}
    for b in scenario["backends"]:
        timing = {"decode_s_per_context_token_by_batch": {1: 2e-7, 4: 1e-7}}
        measured = floor.get(b["backend_id"])
        if measured:
            assert measured["steps"] > 0 and measured["batch"] > 0 and measured["host_s"] >= 0
            timing["host_s_per_step_by_batch"] = {max(1, round(measured["batch"])): measured["host_s"]}
        assert b["step_time"] == timing
