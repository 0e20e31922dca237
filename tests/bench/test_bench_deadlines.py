"""`tandem bench deadlines` for a few seconds on two CPU backends of a tiny random model (real Ray,
Serve, HTTP and engines), in a subprocess: the bench starts its own Ray instance, which must not
meet the session cluster of tests/cluster. It checks that both arms replay the same workload,
every request is answered (200, or 429 for an urgent one in the deadline arm only), the
deadline arm's requests carried their projection, and the report has its table and figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.deadlines import Outcome, format_table, request_body, summarize
from bench.workload import Traffic
from bench.workload import priority_mix as make_workload

ROOT = Path(__file__).resolve().parents[2]
RATES = {"prefill_tok_s": 2000.0, "decode_tok_s": 200.0}


def outcome(index, urgent, send_s, status=0, first_text_s=None, end_s=None, num_output_tokens=0,
            projected_ttft_s=None, **kw):
    return Outcome(index, send_s, status=status, first_text_s=first_text_s, end_s=end_s,
                   num_output_tokens=num_output_tokens, projected_ttft_s=projected_ttft_s, urgent=urgent, **kw)


def test_workload_mix_and_bodies_are_seeded_and_per_arm():
    traffic = Traffic(urgent_share=0.2, deadline_ms=300)
    a, b = make_workload(20, 10, traffic, seed=1), make_workload(20, 10, traffic, seed=1)
    assert [(r.arrival_s, r.urgent, r.prompt) for r in a] == [(r.arrival_s, r.urgent, r.prompt) for r in b]
    assert {len(r.prompt) for r in a if r.urgent} == {64} and {len(r.prompt) for r in a if not r.urgent} == {256}
    # Another arm or rate: the same arrivals and classes, prompts that share no block with these.
    other = make_workload(20, 10, traffic, seed=1, prompts_of="fcfs")
    assert [(r.arrival_s, r.urgent) for r in other] == [(r.arrival_s, r.urgent) for r in a]
    assert not {tuple(r.prompt[:16]) for r in a} & {tuple(r.prompt[:16]) for r in other}
    assert {tuple(r.prompt[:16]) for r in make_workload(40, 10, traffic, seed=1)}.isdisjoint(
        {tuple(r.prompt[:16]) for r in a})
    urgent = next(r for r in a if r.urgent)
    batch = next(r for r in a if not r.urgent)
    assert (request_body("m", urgent, "deadline", traffic)["priority"],
            request_body("m", urgent, "deadline", traffic)["ttft_deadline_ms"]) == (0, 300)
    assert request_body("m", batch, "deadline", traffic)["priority"] == 1
    assert "priority" not in request_body("m", urgent, "fcfs", traffic)
    assert "ttft_deadline_ms" not in request_body("m", urgent, "fcfs", traffic)


def test_summary_figures():
    traffic = Traffic(deadline_ms=500)
    outcomes = [outcome(0, True, 0.0, 200, 0.2, 0.5, 4, 0.1, backend="cpu0"),
                outcome(1, True, 1.0, 200, 1.9, 2.0, 4, 0.5, backend="cpu1"),
                outcome(2, True, 2.0, 429, None, 2.01), outcome(3, False, 0.5, 200, 0.9, 4.5, 40, 0.3, backend="cpu0")]
    s = summarize(outcomes, traffic)
    assert (s["num_urgent"], s["num_batch"], s["num_refused"], s["num_failed"]) == (3, 1, 1, 0)
    assert abs(s["urgent_within_deadline"] - 1 / 3) < 1e-12  # 0.2 s met, 0.9 s missed, one refused
    assert abs(s["batch_output_tok_s"] - 40 / 4.0) < 1e-12
    assert abs(s["refusal_latency_p50_s"] - 0.01) < 1e-9
    errors = sorted([0.2 - 0.1, 0.9 - 0.5, 0.4 - 0.3])
    assert abs(s["projection_error_p50_s"] - errors[1]) < 1e-9
    by_backend = s["projection_error_by_backend"]
    assert sorted(by_backend) == ["cpu0", "cpu1"] and (by_backend["cpu0"]["n"], by_backend["cpu1"]["n"]) == (2, 1)
    assert by_backend["cpu0"]["median_abs_s"] == pytest.approx((0.1 + 0.1) / 2)  # 0.2 - 0.1 and 0.4 - 0.3
    assert by_backend["cpu1"]["median_s"] == pytest.approx(0.9 - 0.5)
    assert s["client_lag_max_s"] == 0.0  # the outcomes were built on schedule


def test_the_table_says_where_the_client_fell_behind():
    late = outcome(0, False, 0.4, 200, 0.5, 0.9, 8, 0.1, send_lag_s=0.3)
    rows = [{"arm": "fcfs", "rate_per_s": rate, **summarize(outcomes, Traffic())}
            for rate, outcomes in ((1.0, [outcome(0, False, 0.0, 200, 0.1, 0.5, 8, 0.1)]), (9.0, [late]))]
    table = format_table(rows)
    assert "the client sent late" in table and "fcfs 9/s" in table and "fcfs 1/s" not in table.split("late")[-1]


def test_deadlines_bench_on_two_cpu_backends(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"cpu": RATES}))
    out = tmp_path / "deadlines.json"
    command = [sys.executable, "-m", "tandem.cluster.cli", "bench", "deadlines", "--model", "tiny-llama-random", "--backends", "cpu,auto",
               "--cpu-threads", "1", "--max-active", "2", "--rates", str(rates), "--loads", "4",
               "--duration-s", "2", "--urgent-lengths", "16,4", "--batch-lengths", "64,16", "--urgent-share", "0.3",
               "--deadline-ms", "2000", "--seed", "3", "--client-procs", "2", "--routing-log", str(tmp_path / "routing.jsonl"),
               "--out", str(out)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["arm"]: r["requests"] for r in report["runs"]}
    assert sorted(runs) == ["deadline", "fcfs"]
    assert [r["urgent"] for r in runs["deadline"]] == [r["urgent"] for r in runs["fcfs"]] != []
    for arm, requests in runs.items():
        # Two client processes sent the arrivals between them: every request once, back in order.
        assert [r["index"] for r in requests] == list(range(len(requests)))
        for r in requests:
            assert r["error"] is None or r["status"] == 429, r
            assert r["status"] == 200 or (arm == "deadline" and r["urgent"] and r["status"] == 429), r
            if r["status"] == 200:
                assert r["num_output_tokens"] == (4 if r["urgent"] else 16)
                assert r["projected_ttft_s"] is not None and r["projected_ttft_s"] > 0
    summaries = {s["arm"]: s for s in report["summaries"]}
    assert summaries["fcfs"]["num_refused"] == 0 and summaries["deadline"]["num_failed"] == 0
    assert summaries["fcfs"]["batch_output_tok_s"] > 0
    assert "urgent p95" in done.stdout and "proj err p95" in done.stdout and "client lag p99" in done.stdout
    assert all(s["client_lag_max_s"] >= s["client_lag_p99_s"] >= 0 for s in report["summaries"])
    # Each run replayed from the started server's routing log, over its own span of it.
    assert "replay p50" in done.stdout
    first, second = report["summaries"]
    assert first["replay_window_s"][1] <= second["replay_window_s"][0]
    for s in report["summaries"]:
        assert s["replayed_ttft_p50_s"] > 0 and s["ttft_p50_s"] > 0
        # Every served request names its backend, so each error is counted under one.
        served = sum(r["status"] == 200 for r in runs[s["arm"]])
        assert set(s["projection_error_by_backend"]) <= {"cpu0", "cpu1"}
        assert sum(e["n"] for e in s["projection_error_by_backend"].values()) == served
    assert "projection error (observed - projected TTFT) by backend" in done.stdout
    # The started server's processes were sampled during each run: the backends worked.
    assert "busiest processes" in done.stdout
    for run in report["runs"]:
        assert len(run["cpu_by_role"]["ray::BackendActor"]) >= 1
        assert any(share > 0 for role, series in run["cpu_by_role"].items() for share in series
                   if role.startswith("ray::BackendActor"))


def test_a_run_the_routing_log_does_not_cover_keeps_its_figures_and_says_why(tmp_path):
    from bench.deadlines import replayed

    log = ROOT / "tests" / "routing" / "fixtures" / "routing-log.jsonl"
    first = json.loads(log.read_text().splitlines()[0])["ts"]
    covered = replayed(log, (first - 1, first + 1), [{"status": 200, "send_s": 0.0, "first_text_s": 0.25}])
    assert covered["replayed_ttft_p50_s"] > 0 and covered["ttft_p50_s"] == 0.25
    assert "no placed decision in that --window" in replayed(log, (first + 60, first + 61), [])["replay_error"]
    assert "replay_error" in replayed(tmp_path / "missing.jsonl", (0, 1), [])
