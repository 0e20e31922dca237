"""The multi-tenant bench's pure parts: the workload mirrors route-sim's, metrics censor cut-off
requests, the verdict, and the client's drain deadline (against a fake streaming server)."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from bench.tenants import TenantsCell, build_cells, tenant_run_metrics, verdict
from tandem.routing.scenario import parse_scenario

CELL = TenantsCell(num_tenants=5, prefix_tokens=64, rate_per_s=40.0, num_requests=30, suffix_tokens=16, max_tokens=8)


def test_arrivals_and_tenants_are_route_sims():
    scenario = parse_scenario({"backends": [{"backend_id": "g", "device_kind": "cuda",
                                             "rates": {"prefill_tok_s": 1, "decode_tok_s": 1}}],
                               "tenants": CELL.scenario_tenants(seed=7)})
    workload = CELL.workload(token_seed=1, arrival_seed=7)
    assert [(r.arrival_s, r.tenant) for r in workload.requests] == [(r.arrival_s, r.tenant) for r in scenario.requests]
    assert workload.description["tenants"] == [r.tenant for r in scenario.requests]


def test_a_tenants_requests_share_its_prefix_and_nothing_more():
    requests = CELL.workload(token_seed=1, arrival_seed=7).requests
    assert all(len(r.prompt_token_ids) == 80 and r.max_tokens == 8 for r in requests)
    prefixes = {}
    for r in requests:
        prefixes.setdefault(r.tenant, set()).add(tuple(r.prompt_token_ids[:64]))
    assert all(len(p) == 1 for p in prefixes.values()) and len({next(iter(p)) for p in prefixes.values()}) == len(prefixes)
    assert len({tuple(r.prompt_token_ids[64:]) for r in requests}) == len(requests)


def test_arms_get_their_own_prefixes_and_the_same_arrivals():
    a, b = CELL.workload(token_seed=1, arrival_seed=7), CELL.workload(token_seed=2, arrival_seed=7)
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert a.requests[0].prompt_token_ids[:64] != b.requests[0].prompt_token_ids[:64]
    assert [r.arrival_s for r in CELL.workload(1, arrival_seed=8).requests] != [r.arrival_s for r in a.requests]


def test_cells_take_rate_times_duration_requests():
    args = SimpleNamespace(tenants=[4, 16], prefix_tokens=[1024], arrival_rates=[10.0, 100.0], duration_s=4.0,
                           min_requests=40, suffix_tokens=64, max_tokens=64, zipf_s=1.0)
    cells = build_cells(args)
    assert [(c.name, c.num_requests) for c in cells] == [
        ("t4-p1024-r10", 40), ("t4-p1024-r100", 400), ("t16-p1024-r10", 40), ("t16-p1024-r100", 400)]


def request(index, send, first, end, prompt=80, cached=64, backend="cuda0", error=None, tokens=8):
    return {"index": index, "send_s": send, "first_text_s": first, "end_s": end, "error": error, "backend": backend,
            "ttft_s": None if first is None else first - send, "e2e_s": None if end is None else end - send,
            "num_prompt_tokens": prompt if error is None else 0, "num_cached_tokens": cached if error is None else 0,
            "num_output_tokens": tokens if error is None else 0}


def test_cut_off_requests_count_with_their_time_so_far():
    cut = "cut off at 10.000 s, 5 s after the last arrival"
    metrics = tenant_run_metrics([
        request(0, 0.0, 0.1, 0.5), request(1, 1.0, 1.2, 1.6, cached=0),
        request(2, 2.0, 3.0, None, backend="cpu0", error=cut),   # its first text came, then the cut
        request(3, 4.0, None, None, backend="cpu0", error=cut),  # nothing before the cut
        request(4, 4.5, None, None, error="HTTP 503: no backend"),
    ], ["cuda0", "cpu0"])
    assert (metrics["num_ok"], metrics["num_cut"]) == (2, 2)
    assert metrics["requests_by_backend"] == {"cuda0": 2, "cpu0": 2}
    assert metrics["hit_rate"] == pytest.approx(64 / 160)
    assert metrics["makespan_s"] == pytest.approx(10.0) and metrics["output_tok_s"] == pytest.approx(16 / 10)
    ttfts = sorted([0.1, 0.2, 1.0, 6.0])
    assert metrics["ttft_p50_s"] == pytest.approx((ttfts[1] + ttfts[2]) / 2)
    assert metrics["e2e_p95_s"] > 7.0  # 8.0 (cut at 10, sent at 2) is the largest


def test_the_engines_part_of_ttft_is_its_queue_and_first_step_from_server_timing():
    """`engine_ttft_p50_s`: `to_engine` + `prefill` of the answers that carry both, the part of
    TTFT route-sim's engine model times; the serving path's stages are left out."""
    with_stages = [dict(request(i, float(i), i + 0.05, i + 0.5),
                        server_stages={"route": 0.01, "to_engine": 0.002 * i, "prefill": 0.004, "back": 0.001})
                   for i in range(3)]
    queued = dict(request(3, 3.0, 3.05, 3.5), server_stages={"route": 0.01, "admit": 0.02})  # no engine split
    metrics = tenant_run_metrics(with_stages + [queued, request(4, 4.0, 4.1, 4.6)], ["cuda0"])
    assert metrics["engine_ttft_p50_s"] == pytest.approx(0.002 + 0.004) and metrics["engine_ttft_share"] == 3 / 5
    assert math.isnan(tenant_run_metrics([request(0, 0.0, 0.1, 0.5)], ["cuda0"])["engine_ttft_p50_s"])


def arm(**means):
    return {m: {"mean": v, "sd": 0.01 * v, "n": 2} for m, v in means.items()}


def test_verdict_against_the_best_other_arm():
    arms = {"cost": arm(ttft_p50_s=0.10, ttft_p95_s=0.30, output_tok_s=1000.0, hit_rate=0.80),
            "prefix-affinity": arm(ttft_p50_s=0.11, ttft_p95_s=0.20, output_tok_s=1000.5, hit_rate=0.84),
            "round-robin": arm(ttft_p50_s=0.12, ttft_p95_s=0.40, output_tok_s=990.0, hit_rate=0.50)}
    v = verdict(arms)
    assert v["ttft_p50_s"]["ok"] is True and v["ttft_p50_s"]["best_other_arm"] == "prefix-affinity"
    assert v["ttft_p95_s"]["ok"] is False and v["ttft_p95_s"]["worse_by"] == pytest.approx(0.10)
    assert v["output_tok_s"]["ok"] is True  # 0.5 tok/s behind, within the spread
    assert v["hit_rate"]["ok"] is True and v["hit_rate"]["gap"] == pytest.approx(0.04)
    arms["prefix-affinity"]["hit_rate"]["mean"] = 0.90
    assert verdict(arms)["hit_rate"]["ok"] is False


def test_the_client_cuts_off_what_is_unfinished_at_the_drain_deadline():
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from bench.client import run_workload

    async def completions(request):
        body = await request.json()
        slow = body["prompt"][0] == 1

        async def events():
            yield f"data: {json.dumps({'id': 'x', 'choices': [{'text': 'a', 'finish_reason': None}]})}\n\n"
            if slow:
                await asyncio.sleep(30)
            usage = {"completion_tokens": 1, "prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-tandem-backend": "b"})

    app = Starlette(routes=[Route("/health", lambda r: JSONResponse({})),
                            Route("/v1/completions", completions, methods=["POST"])])
    from bench.workload import Workload, WorkloadRequest

    workload = Workload("w", [WorkloadRequest(0, 0.0, [0, 5], 1), WorkloadRequest(1, 0.0, [1, 5], 1)], [], 0)
    results = asyncio.run(run_workload("http://test", "m", workload, transport=httpx.ASGITransport(app=app),
                                       drain_timeout_s=0.5))
    assert results[0].ok and (results[0].num_prompt_tokens, results[0].num_cached_tokens) == (2, 1)
    assert results[1].error.startswith("cut off at ") and not results[1].ok  # (this transport buffers a response)


def test_engines_on_one_gpu_get_one_device_name():
    from bench.harness import device_names
    from tandem.cluster.plan import BackendPlan

    def plan(backend_id, device, per_gpu=1):
        return BackendPlan(backend_id, device, device, "", threads=1, max_active=4, engines_per_gpu=per_gpu)

    four_on_one = [plan(f"cuda{i}", "cuda", 4) for i in range(4)] + [plan("cpu0", "cpu")]
    assert device_names(four_on_one) == {f"cuda{i}": "cuda:0" for i in range(4)}
    two_by_two = [plan(f"cuda{i}", "cuda", 2) for i in range(4)]
    assert device_names(two_by_two) == {"cuda0": "cuda:0", "cuda1": "cuda:0", "cuda2": "cuda:1", "cuda3": "cuda:1"}
    assert device_names([plan("mps0", "mps")]) == {"mps0": "mps"}


def test_written_scenario_names_each_accelerators_device(tmp_path):
    from bench.harness import Layout
    from bench.tenants import write_scenario
    from tandem.routing.scenario import load_scenario

    rates = {"prefill_tok_s": 1000, "decode_tok_s": 100}
    (tmp_path / "rates.json").write_text(json.dumps({"cuda": rates, "cpu": rates}))
    backends = [{"id": "cuda0", "device": "cuda"}, {"id": "cuda1", "device": "cuda"}, {"id": "cpu0", "device": "cpu"}]
    layout = Layout("m", backends, "cuda0", True, None, devices={"cuda0": "cuda:0", "cuda1": "cuda:0"})
    cluster = SimpleNamespace(rates_path=tmp_path / "rates.json", layout=layout, accel_max_active=8,
                              cpu_max_active=4, router_settings={"spill_margin": 0.05, "spill_allow_queue": False})
    write_scenario(tmp_path / "cell.yaml", CELL, cluster, seed=7)
    scenario = load_scenario(tmp_path / "cell.yaml")
    assert [b.device for b in scenario.backends] == ["cuda:0", "cuda:0", None]
    assert scenario.shared_devices == {"cuda:0": ["cuda0", "cuda1"]}


def test_written_scenario_carries_a_host_tier_where_the_live_backend_has_one(tmp_path, monkeypatch):
    from bench import tenants
    from bench.harness import Layout
    from tandem.routing.scenario import load_scenario

    # 2 MiB a block: 1.5 GiB of host memory is 768 blocks, the engine's own conversion
    monkeypatch.setattr(tenants, "kv_bytes_per_block", lambda model, block_size, dtype: 2 << 20)
    rates = {"prefill_tok_s": 4000, "decode_tok_s": 400}
    (tmp_path / "rates.json").write_text(json.dumps({"sim0": {**rates, "reload_tok_s": 50000}, "sim1": rates}))
    backends = [{"id": f"sim{i}", "device": "sim", "num_kv_blocks": 40, "kv_host_memory_gb": 1.5} for i in range(2)]
    layout = Layout("m", backends, "sim0", True, None, sim_kinds={"sim0": "cuda", "sim1": "cuda"})
    cluster = SimpleNamespace(rates_path=tmp_path / "rates.json", layout=layout, accel_max_active=4,
                              cpu_max_active=4, router_settings={"spill_margin": 0.05, "spill_allow_queue": False})
    tenants.write_scenario(tmp_path / "cell.yaml", CELL, cluster, seed=7)
    scenario = load_scenario(tmp_path / "cell.yaml")
    # sim1's profile has no reload rate, so its engine runs without a tier
    assert [b.num_host_kv_blocks for b in scenario.backends] == [768, 0]
    assert scenario.backends[0].actual_rates.reload_tok_s == 50000
    predictions = tenants.route_sim_predictions(tmp_path / "cell.yaml", ["cost"])
    assert list(predictions["cost"]) == ["engine"]  # the engine model, the one that runs the tier
    assert 0 < predictions["cost"]["engine"]["hit_rate"] < 1
    engine = predictions["cost"]["engine"]  # its engine part counts from the router, not the send
    assert 0 < engine["engine_ttft_p50_s"] <= engine["ttft_p50_s"]


def test_prediction_error_is_the_median_factor_and_point_gap_per_model():
    from bench.tenants_report import prediction_error

    def arm(ttft_s, hit):
        return {"ttft_p50_s": {"mean": ttft_s}, "hit_rate": {"mean": hit}}

    cells = [{"arms": {"cost": arm(0.2, 0.5), "random": arm(1.0, 0.2)},
              "route_sim": {"cost": {"engine": {"ttft_p50_s": 0.1, "hit_rate": 0.52}},  # x2 off, 2 points
                            "random": {"engine": {"ttft_p50_s": 1.25, "hit_rate": 0.2}}}},  # x1.25, 0 points
             {"arms": {"cost": arm(0.4, 0.6)},  # an older summary: route-sim's own backends, unkeyed
              "route_sim": {"cost": {"ttft_p50_s": 0.4, "hit_rate": 0.5}}}]
    errors = prediction_error(cells)
    assert errors["engine"]["pairs"] == 2
    assert errors["engine"]["ttft_p50_factor"] == pytest.approx((2 * 1.25) ** 0.5)  # the median of two logs
    assert errors["engine"]["hit_rate_points"] == pytest.approx(1.0)
    assert errors["route-sim"] == {"pairs": 1, "ttft_p50_factor": 1.0, "hit_rate_points": pytest.approx(10.0)}


def test_written_scenario_times_steps_as_the_sim_profile_or_the_step_profile_says(tmp_path):
    """A sim backend's scenario carries its own profile's context cost and prefill table (its
    emulated device runs them); an accelerator's, the `--step-profile` given; a cpu's, neither."""
    from bench.harness import Layout
    from bench.tenants import write_scenario
    from tandem.routing.scenario import load_scenario

    extras = {"decode_s_per_context_token_by_batch": {"1": 4e-8, "64": 1e-8}, "prefill_tok_s_by_tokens": {"64": 9000}}
    profile = tmp_path / "dev.json"
    profile.write_text(json.dumps({"prefill_tok_s": 1000, "decode_tok_s": 100, **extras}))
    rates = {"prefill_tok_s": 1000, "decode_tok_s": 100}
    (tmp_path / "rates.json").write_text(json.dumps({"cuda": rates, "cpu": rates, "sim": rates}))
    backends = [{"id": "cuda0", "device": "cuda"}, {"id": "cpu0", "device": "cpu"},
                {"id": "sim0", "device": "sim", "profile": str(profile)}]
    layout = Layout("m", backends, "cuda0", True, None, sim_kinds={"sim0": "cuda"}, sim_time_scale=2.0)
    cluster = SimpleNamespace(rates_path=tmp_path / "rates.json", layout=layout, accel_max_active=8,
                              cpu_max_active=4, router_settings={"spill_margin": 0.05, "spill_allow_queue": False})
    write_scenario(tmp_path / "cell.yaml", CELL, cluster, seed=7, step_profile=str(profile))
    cuda, cpu, sim = load_scenario(tmp_path / "cell.yaml").backends
    assert cuda.step_time().step_s(0, 1, 1000) == pytest.approx(1 / 100 + 1000 * 4e-8)
    assert cpu.step_time().step_s(0, 1, 1000) == pytest.approx(1 / 100)
    assert sim.step_time().context_cost(64) == pytest.approx(2 * 1e-8)  # dilated as the sim runs it
    write_scenario(tmp_path / "plain.yaml", CELL, cluster, seed=7)
    assert load_scenario(tmp_path / "plain.yaml").backends[0].step_time_fields == {}


def test_the_report_shows_the_engines_part_beside_route_sims_where_both_were_measured():
    from bench.tenants_report import _predicted

    engine = {"ttft_p50_s": 0.015, "hit_rate": 0.9, "engine_ttft_p50_s": 0.0071}
    cell = {"arms": {"cost": arm(engine_ttft_p50_s=0.0072)}, "route_sim": {"cost": {"engine": engine}}}
    assert _predicted(cell, "cost") == "engine: 15.0 / 90.0 (engine part 7.1, live 7.2)"
    cell["arms"]["cost"] = arm(ttft_p50_s=0.02)  # a summary from before the engine's part
    assert _predicted(cell, "cost") == "engine: 15.0 / 90.0"
