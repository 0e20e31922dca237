"""The end-to-end benchmark's pieces, on synthetic data: workloads, the streaming client, metrics,
the oracle's calibration and share, the routing window and the report. No cluster, no timing."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from bench.client import RequestResult, _apply_chunk, run_workload
from bench.metrics import aggregate, compare, run_metrics, spread
from bench.oracle import cell_oracle, fit_factor, meets_target, share_of_oracle_gain
from bench.summary import first_offload_window, summarize
from bench.workload import CellSpec, poisson_arrivals, spec_workload, sweep_workload
from tandem.routing.backend_spec import BackendSpec
from tandem.routing.rates import RateProfile
from tandem.routing.scenario import Scenario, SimBackendSpec, SimRequest
from tandem.routing.simulator import simulate

# -- workloads -------------------------------------------------------------------------------


def test_spec_workload_is_the_spec_setting():
    w = spec_workload(8)
    prompts = {tuple(r.prompt_token_ids) for r in w.requests}
    assert len(prompts) == 1 and len(w.requests[0].prompt_token_ids) == 516
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.05 * i for i in range(8)])
    assert w.seed_prompts == [w.requests[0].prompt_token_ids[:508]]
    assert w.expected_cached_tokens == 496  # 31 whole 16-token blocks, the worked example's number
    assert all(r.max_tokens == 128 for r in w.requests)
    assert all(32 <= t < 127 for t in w.requests[0].prompt_token_ids)


def test_sweep_workload_shares_only_the_seeded_prefix():
    w = sweep_workload(4, prompt_tokens=516, max_tokens=32, cache_hit=0.5, arrivals_s=[0, 1, 2, 3], token_seed=3)
    assert w.num_shared_prefix_tokens == 256  # 0.5 * 516 = 258, to the nearest whole block
    prefix = w.seed_prompts[0]
    assert all(r.prompt_token_ids[:256] == prefix and len(r.prompt_token_ids) == 516 for r in w.requests)
    assert len({tuple(r.prompt_token_ids[256:]) for r in w.requests}) == 4
    assert sweep_workload(2, 516, 8, 0.0, [0, 1]).seed_prompts == []
    assert spec_workload(3, token_seed=5).requests[0].prompt_token_ids == spec_workload(3, token_seed=5).requests[0].prompt_token_ids


def test_poisson_arrivals_and_cells():
    arrivals = poisson_arrivals(200, 10.0, random.Random(1))
    assert arrivals[0] == 0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
    assert 10.0 < arrivals[-1] < 30.0  # 199 gaps of mean 0.1 s
    cell = CellSpec(num_requests=5, arrival="poisson", rate_per_s=5, cache_hit=0.96, accel_max_active=8)
    assert cell.name == "n5-ma8-poisson5-hit96-p516-o128"
    w = cell.workload(token_seed=1)
    assert w.num_requests == 5 and w.expected_cached_tokens == 496 and w.summary()["arrival"] == "poisson"
    assert [r.arrival_s for r in w.requests] == [r.arrival_s for r in cell.workload(token_seed=1).requests]


# -- the client --------------------------------------------------------------------------------


def _fake_server(backend_by_index):
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def health(request):
        from starlette.responses import JSONResponse
        return JSONResponse({"status": "ok"})

    async def completions(request):
        body = await request.json()
        index = body["seed"] if "seed" in body else 0
        backend = backend_by_index[index]

        async def events():
            for i in range(body["max_tokens"]):
                chunk = {"id": f"cmpl-{index}", "choices": [{"text": "" if i == 0 else "x",
                                                             "finish_reason": "length" if i == body["max_tokens"] - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'id': f'cmpl-{index}', 'choices': [], 'usage': {'completion_tokens': body['max_tokens']}})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-tandem-backend": backend})

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])


def test_client_streams_and_records_each_request():
    import httpx

    workload = spec_workload(3, prompt_tokens=20, seed_prefix_tokens=16, max_tokens=4, interval_s=0.0)
    app = _fake_server({0: "cuda0", 1: "cpu0", 2: "cuda0"})
    done = []
    results = asyncio.run(run_workload("http://test", "m", workload, temperature=1.0, on_done=done.append,
                                       transport=httpx.ASGITransport(app=app)))
    assert [r.index for r in results] == [0, 1, 2] and len(done) == 3
    assert [r.backend for r in results] == ["cuda0", "cpu0", "cuda0"]
    assert all(r.ok and r.num_output_tokens == 4 and r.finish_reason == "length" for r in results)
    assert [r.req_id for r in results] == ["cmpl-0", "cmpl-1", "cmpl-2"]
    assert all(r.send_s <= r.first_text_s <= r.end_s for r in results)


def test_chunk_parsing_handles_errors_and_no_text():
    r = RequestResult(index=0, send_s=1.0)
    _apply_chunk({"id": "a", "choices": [{"text": "", "finish_reason": "length"}]}, 2.5, r)
    assert r.ttft_s == 1.5 and r.finish_reason == "length"  # no text at all: TTFT is the end
    _apply_chunk({"error": {"message": "boom"}}, 3.0, r)
    assert r.error == "error event: boom"


# -- metrics -----------------------------------------------------------------------------------


def _req(index, backend, send, first, end, tokens=4, error=None):
    return RequestResult(index, send, f"r{index}", backend, 200, first, end, tokens, tokens, "length", error).to_dict()


def test_run_metrics_exact():
    requests = [_req(0, "cuda0", 0.0, 1.0, 5.0), _req(1, "cpu0", 0.5, 1.0, 4.5), _req(2, "cuda0", 1.0, 3.0, 9.0),
                _req(3, "cuda0", 1.5, None, None, 0, error="HTTP 503")]
    m = run_metrics(requests, ["cuda0", "cpu0"])
    assert m.num_ok == 3 and m.makespan_s == 9.0 and m.output_tok_s == pytest.approx(12 / 9)
    assert m.ttft_p50_s == pytest.approx(1.0) and m.ttft_p95_s == pytest.approx(1.9)  # ttfts 0.5, 1, 2
    assert m.e2e_p50_s == pytest.approx(5.0) and m.requests_by_backend == {"cuda0": 2, "cpu0": 1}


def test_aggregate_and_compare():
    def metrics(makespan, ttft95):
        return {"num_requests": 2, "num_ok": 2, "makespan_s": makespan, "output_tok_s": 100 / makespan,
                "ttft_p50_s": 1.0, "ttft_p95_s": ttft95, "e2e_p50_s": 2.0, "e2e_p95_s": 3.0,
                "num_output_tokens": 100, "requests_by_backend": {"cuda0": 2}}
    base = aggregate([metrics(10, 1.0), metrics(12, 1.2)])
    hybrid = aggregate([metrics(9, 1.6), metrics(9, 1.6)])
    assert base["makespan_s"]["mean"] == 11 and base["makespan_s"]["sd"] == pytest.approx(math.sqrt(2))
    assert base["requests_by_backend"] == {"cuda0": [2, 2]}
    cmp = compare(base, hybrid)
    assert cmp["makespan_s"]["change"] == pytest.approx(-2 / 11, abs=1e-6) and cmp["makespan_s"]["worse"] is False
    assert cmp["ttft_p95_s"]["worse"] is True  # 1.6 vs 1.1 +- 0.14
    assert compare(aggregate([metrics(10, 1)]), aggregate([metrics(20, 1)]))["makespan_s"]["worse"] is None
    assert spread([]).n == 0


# -- oracle ------------------------------------------------------------------------------------

SPEC_RATES = {"cuda0": {"prefill_tok_s": 2551.0, "decode_tok_s": 293.0},
              "cpu0": {"prefill_tok_s": 73.0, "decode_tok_s": 45.0}}


def _records_from_sim(policy, n=8, run=1):
    """A run record whose timings are the simulator's own (the design's setting, rates as profiled)."""
    backends = [SimBackendSpec(BackendSpec(b, "cuda" if b == "cuda0" else "cpu", RateProfile(**SPEC_RATES[b]), 4),
                               RateProfile(**SPEC_RATES[b])) for b in ("cuda0", "cpu0")]
    arrivals = [0.05 * i for i in range(n)]
    scenario = Scenario("s", policy, backends, [SimRequest(f"r{i + 1}", t, 516, 128, 128, {"cuda0": 496, "cpu0": 496})
                                                for i, t in enumerate(arrivals)])
    result = simulate(scenario)
    requests = [_req(i, o.backend_id, o.arrival_s, o.first_token_s, o.finish_s, 128) for i, o in enumerate(result.outcomes)]
    return {"cell": f"n{n}", "arm": policy, "run": run, "requests": requests, "decisions": [],
            "metrics": run_metrics(requests, ["cuda0", "cpu0"]).to_dict(),
            "workload": {"name": f"n{n}", "num_requests": n, "arrivals_s": arrivals, "num_prompt_tokens": 516,
                         "max_tokens": 128},
            "seeded_cached_tokens": {"cuda0": 496, "cpu0": 496},
            "cluster": {"backends": [{"backend_id": "cuda0", "device": "cuda:0", "device_kind": "cuda", "dtype": "bfloat16",
                                      "threads": 1, "max_active": 4},
                                     {"backend_id": "cpu0", "device": "cpu", "device_kind": "cpu", "dtype": "float32",
                                      "threads": 14, "max_active": 4}],
                        "rates": SPEC_RATES}}


def test_oracle_on_simulated_measurements_matches_route_sim():
    baseline, hybrid = _records_from_sim("accelerator-only"), _records_from_sim("cost")
    o = cell_oracle([baseline], [hybrid], "cuda0")
    assert o["factors"]["cuda0"] == pytest.approx(1.0, abs=1e-3) and o["factors"]["cpu0"] == pytest.approx(1.0, abs=1e-3)
    # docs/routing.md, the design's setting with 8 requests: 3.530 s -> cost 3.446 s, oracle 3.139 s, 21%.
    assert o["baseline_makespan_s"] == pytest.approx(3.530, abs=1e-3)
    assert o["hybrid_makespan_s"] == pytest.approx(3.446, abs=1e-3)
    assert o["oracle_makespan_s"] == pytest.approx(3.139, abs=2e-3)
    assert o["share"] == pytest.approx(0.215, abs=0.01)
    assert o["sim_calibrated"]["oracle_requests_by_backend"] == {"cpu0": 1, "cuda0": 7}
    assert o["sim_calibrated"]["router_replay_s"] == pytest.approx(3.446, abs=1e-3)
    assert o["measured_router_gain"] == pytest.approx(1 - 3.446 / 3.530, abs=1e-3)
    assert meets_target(o) is False  # oracle gains 11%, the router captures 21% of it


def test_fit_factor_and_share():
    assert fit_factor(lambda f: 10.0 / f, 4.0) == pytest.approx(2.5, rel=1e-6)
    s = share_of_oracle_gain(10.0, 9.0, 8.0)
    assert s["oracle_gain"] == pytest.approx(0.2) and s["router_gain"] == pytest.approx(0.1) and s["share"] == pytest.approx(0.5)
    assert share_of_oracle_gain(10.0, 10.0, 8.0)["share"] == 0  # all on the accelerator: none of the gain
    assert share_of_oracle_gain(10.0, 10.5, 10.0)["share"] is None
    assert meets_target({"oracle_gain": 0.02, "share": 0.1}) is None
    assert meets_target({"oracle_gain": 0.1, "share": 0.85}) is True


def test_first_offload_window_and_summary():
    def decision(index, backend):
        score = {"num_active": 4, "num_queued": index, "num_cached_tokens": 496, "num_prefill_tokens": 20.0,
                 "num_decode_tokens": 500.0, "prefill_term_s": 0.0, "decode_term_s": 3.0, "score_s": 3.0,
                 "prefill_tok_s": 1.0, "decode_tok_s": 1.0}
        return {"index": index, "ts": float(index), "backend_id": backend, "per_backend": {"cuda0": score, "cpu0": score}}
    record = {"run": 2, "decisions": [decision(i, "cpu0" if i == 7 else "cuda0") for i in range(10)]}
    w = first_offload_window(record, "cuda0")
    assert w["first_offload_position"] == 8 and [d["position"] for d in w["decisions"]] == [6, 7, 8, 9]
    assert first_offload_window({"run": 1, "decisions": [decision(0, "cuda0")]}, "cuda0")["decisions"] == []
    cells = summarize([_records_from_sim("accelerator-only"), _records_from_sim("cost")], "cuda0")
    assert len(cells) == 1 and set(cells[0]["arms"]) == {"accelerator-only", "cost"}
    assert cells[0]["vs_baseline"]["cost"]["makespan_s"]["change"] < 0 and "oracle" in cells[0]


# -- report ------------------------------------------------------------------------------------


def test_report_renders_tables_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.report import render_report

    runs = [_records_from_sim("accelerator-only"), _records_from_sim("cost")]
    meta = {"bench": "seed", "model": "qwen2.5-0.5b-random", "accel_id": "cuda0", "has_accelerator": True,
            "machine": {"cpu_count": 16, "gpu": "NVIDIA H200"}, "command": "tandem bench seed --out x", "date": "d",
            "temperature": 1.0, "cpu_max_active": 4, "rates": SPEC_RATES,
            "backends": [{"id": "cpu0", "device": "cpu", "threads": 14, "dtype": "auto"},
                         {"id": "cuda0", "device": "cuda", "threads": 1, "dtype": "auto"}],
            "settings": {"runs": 1, "prompt_tokens": 516, "interval_s": 0.05, "max_tokens": 128, "max_active": 4,
                         "seed_prefix_tokens": 508}}
    for r in runs:
        r["bench"] = "seed"
    written = render_report(meta, runs, tmp_path / "seed.md", "seed")
    text = (tmp_path / "seed.md").read_text()
    assert "### 8 requests" in text and "| hybrid (cost) |" in text and "11.47 → 10.35" in text
    assert "Backend `cpu0`: cpu, dtype float32, 14 torch threads" in text
    assert "Backend `cuda0`: cuda:0, dtype bfloat16, 1 torch thread —" in text and "1 torch threads" not in text
    assert {p.name for p in written} >= {"seed.md", "seed-timeline.png", "seed-cdf-n8.png", "seed.json"}
    assert all(p.stat().st_size > 0 for p in written)
    assert len(json.loads((tmp_path / "seed.json").read_text())["runs"]) == 2
    for r in runs:
        r["bench"] = "sweep"
    sweep_meta = dict(meta, settings={"sweep": {"dimensions": {"cache_hit": ["n8", "missing"]}}})
    render_report(sweep_meta, runs, tmp_path / "sweep.md", "sweep")
    text = (tmp_path / "sweep.md").read_text()
    assert "### cache_hit" in text and "| missing | not run |" in text and (tmp_path / "sweep-gain.png").exists()


# -- plans -------------------------------------------------------------------------------------


def test_sweep_plan_with_seed_groups_cells_by_max_active():
    from bench.cli import plan
    from bench.runner import groups, total_requests
    from tandem.cluster.cli import build_parser

    argv = ["bench", "sweep", "--out", "x", "--with-seed", "--num-requests", "6", "--runs", "2",
            "--other-max-active-runs", "1", "--accel-max-active", "1,4,8", "--arrival-rates", "10",
            "--cache-hit", "0,0.96", "--lengths", "516:32"]
    args = build_parser(argv).parse_args(argv)
    items, settings = plan(args)
    names = [i.cell.name for i in items]
    assert names[:2] == ["n8", "n48"] and all(i.runs == 3 and i.bench == "seed" for i in items[:2])
    assert len(names) == len(set(names)) == 2 + 6  # base cell (ma4, hit96, 516:128) appears once
    by_ma = {ma: [i.cell.name for i in group] for ma, group in groups(items)}
    assert list(by_ma) == [4, 1, 8]
    assert by_ma[4][:3] == ["n8", "n48", "n6-ma4-every50ms-hit96-p516-o128"]
    assert {i.runs for i in items if i.cell.accel_max_active != 4} == {1}
    assert settings["sweep"]["dimensions"]["cache_hit"] == ["n6-ma4-every50ms-hit0-p516-o128",
                                                            "n6-ma4-every50ms-hit96-p516-o128"]
    assert total_requests(items, ["accelerator-only", "cost"]) == 2 * (3 * 56 + 2 * 6 * 4 + 1 * 6 * 2)

