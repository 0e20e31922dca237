"""`tandem bench tenants`: routing policies on many tenants with long shared prefixes, live.

The workload is route-sim's `tenants:` scenario (routing/scenario.py) sent through the real HTTP
endpoint: T tenants, each with a shared prefix of P tokens (a system prompt or document); each
request is one tenant's prefix plus a suffix of its own, tenant k (1-based) picked with weight
1 / k**s (Zipf), arrivals Poisson at a given rate, exact output lengths (EOS ignored). The
arrival times and the tenant of each request come from routing's own `tenant_requests` with the
same seed, so a cell here and its route-sim scenario (written beside the runs, under
OUT/scenarios/, with the backends' rates and cache sizes, their host KV tiers included) describe
the same requests; only the token ids are new (printable ids, as in bench/workload.py).

Arms are routing policies (default `cost`, `prefix-affinity`, `least-requests`,
`round-robin`, `random`), all on one cluster started once (bench/harness.py), switched between
measurements as the sweep does. Each arm gets prefixes of its own (the same lengths and arrival
times), so no arm finds another's blocks in a cache; what an earlier arm left there only takes
room, which LRU eviction gives back. A cell is (tenants, prefix tokens, arrival rate); each run
goes through every cell, the arms' order alternating from run to run. `--num-kv-blocks` sizes
every backend's KV cache, which is what decides whether the prefixes fit.

Per arm and cell the summary gives TTFT p50/p95, E2E p50/p95, output tok/s, the prefix-cache
hit rate (cached prompt tokens from each response's usage over all prompt tokens, as route-sim
defines it) and each backend's share of requests, as means and spreads over runs, and whether
`cost` is at least as good as the best other arm beyond the run-to-run spread. With
`--drain-timeout-s`, a measurement stops waiting that long after its last arrival: requests
still unfinished (a cpu backend given a share of 4k-token prompts by round-robin takes minutes)
are cut off and count in the percentiles with their time so far, a lower bound.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.client import CUT_OFF
from bench.workload import Workload, WorkloadRequest, random_tokens

ARMS = ("cost", "prefix-affinity", "least-requests", "round-robin", "random")
HYBRID_ARM = "cost"
# metric -> True if higher is better; the verdict judges cost on the first three
METRICS: dict[str, bool] = {"ttft_p50_s": False, "ttft_p90_s": False, "ttft_p95_s": False, "output_tok_s": True,
                            "e2e_p50_s": False, "e2e_p95_s": False, "hit_rate": True, "engine_ttft_p50_s": False,
                            "engine_ttft_share": True}
VERDICT_METRICS = ("ttft_p50_s", "ttft_p95_s", "output_tok_s")
HIT_RATE_BAND = 0.05  # cost's hit rate within 5 points of prefix-affinity's


@dataclass(frozen=True)
class TenantsCell:
    """One cell: route-sim's `tenants:` section with the rate and request count of this cell."""

    num_tenants: int
    prefix_tokens: int
    rate_per_s: float
    num_requests: int
    suffix_tokens: int = 64
    max_tokens: int = 64
    zipf_s: float = 1.0

    @property
    def name(self) -> str:
        return f"t{self.num_tenants}-p{self.prefix_tokens}-r{self.rate_per_s:g}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}

    def scenario_tenants(self, seed: int) -> dict[str, Any]:
        """This cell as route-sim's `tenants:` section (routing/scenario.py)."""
        return {"num_requests": self.num_requests, "rate_per_s": self.rate_per_s, "num_tenants": self.num_tenants,
                "zipf_s": self.zipf_s, "prefix_tokens": self.prefix_tokens, "suffix_tokens": self.suffix_tokens,
                "max_tokens": self.max_tokens, "seed": seed}

    def workload(self, token_seed: int, arrival_seed: int, block_size: int = 16) -> Workload:
        """Arrivals and tenants from route-sim with `arrival_seed`; token ids from `token_seed`."""
        rng = random.Random(token_seed)
        prefixes = [random_tokens(rng, self.prefix_tokens) for _ in range(self.num_tenants)]
        requests = [WorkloadRequest(i, arrival_s, prefixes[tenant] + random_tokens(rng, self.suffix_tokens),
                                    self.max_tokens, tenant=tenant)
                    for i, (arrival_s, tenant) in enumerate(self.arrivals(arrival_seed, block_size))]
        return Workload(name=self.name, requests=requests, seed_prompts=[], num_shared_prefix_tokens=0,
                        block_size=block_size,
                        description={"kind": "tenants", "arrival": "poisson", "token_seed": token_seed,
                                     "arrival_seed": arrival_seed, "tenants": [r.tenant for r in requests],
                                     **self.to_dict()})

    def arrivals(self, seed: int, block_size: int = 16) -> list[tuple[float, int]]:
        """(arrival_s, tenant) of each request, exactly as route-sim generates them."""
        from tandem.routing.scenario import parse_scenario

        placeholder = {"backend_id": "b", "device_kind": "cuda", "rates": {"prefill_tok_s": 1, "decode_tok_s": 1}}
        scenario = parse_scenario({"backends": [placeholder], "block_size": block_size,
                                   "tenants": self.scenario_tenants(seed)}, source="tenants cell")
        return [(r.arrival_s, r.tenant) for r in scenario.requests]


def build_cells(args: argparse.Namespace) -> list[TenantsCell]:
    """Every (tenants, prefix, rate) cell; each has `rate x duration` requests, at least `min_requests`."""
    return [TenantsCell(num_tenants=t, prefix_tokens=p, rate_per_s=r,
                        num_requests=max(args.min_requests, round(r * args.duration_s)),
                        suffix_tokens=args.suffix_tokens, max_tokens=args.max_tokens, zipf_s=args.zipf_s)
            for p in args.prefix_tokens for t in args.tenants for r in args.arrival_rates]


def settings(args: argparse.Namespace, cells: Sequence[TenantsCell]) -> dict[str, Any]:
    return {"tenants": args.tenants, "prefix_tokens": args.prefix_tokens, "arrival_rates": args.arrival_rates,
            "duration_s": args.duration_s, "min_requests": args.min_requests, "suffix_tokens": args.suffix_tokens,
            "max_tokens": args.max_tokens, "zipf_s": args.zipf_s, "runs": args.runs, "arms": args.arms,
            "max_active": args.max_active, "cpu_max_active": args.cpu_max_active,
            "num_kv_blocks": args.num_kv_blocks, "kv_host_memory_gb": getattr(args, "kv_host_memory_gb", None),
            "kv_host_offload_min_hits": getattr(args, "kv_host_offload_min_hits", None),
            "drain_timeout_s": args.drain_timeout_s,
            "cells": [c.name for c in cells]}


# -- running ---------------------------------------------------------------------------------
def run_tenants(ctx: Any, cells: Sequence[TenantsCell], arms: Sequence[str], runs: int, max_active: int,
                bar: Any, drain_timeout_s: float | None = None, step_profile: str | None = None) -> list[dict[str, Any]]:
    """Measure every cell under every arm, `runs` times, on one cluster; returns the run records.
    `step_profile` (a sim profile) times the accelerator backends' steps in the cells' scenarios."""
    from bench.harness import write_json
    from bench.runner import arm_order, token_seed

    records: list[dict[str, Any]] = []
    pending = max(c.num_requests for c in cells) + 16
    bar.set_description(f"one cluster for {len(cells)} cells: starting")
    with ctx.cluster(HYBRID_ARM, max_active, max_pending_requests=pending) as cluster:
        bar.set_description("the serving path's latency, lone requests")
        latency = measure_serving_latency(cluster, sorted({16 + c.suffix_tokens for c in cells}
                                                          | {c.prefix_tokens + c.suffix_tokens for c in cells}))
        ctx.meta["serving_latency"] = latency
        bar.set_description("the engines' host work per step behind the server")
        host_floor = measure_host_floor(cluster, max(c.prefix_tokens + c.suffix_tokens for c in cells),
                                        max(c.max_tokens for c in cells))
        ctx.meta["host_floor"] = host_floor
        for cell in cells:
            write_scenario(ctx.out_dir / "scenarios" / f"{cell.name}.yaml", cell, cluster, seed=_arrival_seed(cell, 1),
                           serving=latency, step_profile=step_profile, host_floor=host_floor)
        for run in range(1, runs + 1):
            for cell in cells:
                for arm in arm_order(list(arms), run):
                    if ctx.budget.spent():
                        bar.write(f"time budget spent: stopping before {cell.name}, run {run}, {arm}")
                        return records
                    bar.set_description(f"run {run} {arm} {cell.name}")
                    cluster.configure(arm, max_active)
                    workload = cell.workload(token_seed(cell, run, arm), _arrival_seed(cell, run))
                    record = measure_cell(ctx, cluster, workload, bar, drain_timeout_s)
                    record.update(bench="tenants", cell=cell.name, cell_spec=cell.to_dict(), arm=arm, run=run)
                    write_json(ctx.out_dir / "runs" / f"{cell.name}-{arm}-run{run}.json", record)
                    records.append(record)
    return records


def measure_serving_latency(cluster: Any, prompt_lengths: Sequence[int], repeats: int = 4,
                            seed: int = 7, budget_s: float = 60.0) -> dict[str, Any]:
    """The serving path's latency that route-sim's backends do not hold (routing/scenario.py's
    `ServingLatency`), from lone requests through HTTP: each prompt is sent twice, far enough apart
    that nothing queues, and its second TTFT, less the step the profile gives its uncached tail on
    the backend it hit, is the path's time (HTTP, tokenizing, hashing, routing, the hops), after
    one unmeasured pair of each length. A line through the shortest and the longest prompt's
    medians gives the fixed and per-token parts.
    Fewer repeats (one at least) where the backends prefill so slowly that four would pass
    `budget_s`."""
    import asyncio

    from bench.client import run_workload
    from tandem.routing.rates import load_rate_profiles
    from tandem.routing.step_time import StepTimeModel

    rates = load_rate_profiles(cluster.rates_path)
    slowest_prefill_s = max(max(prompt_lengths) / r.prefill_tok_s for r in rates.values())
    gap_s = 2 * slowest_prefill_s + 0.1
    repeats = max(1, min(repeats, int(budget_s / (2 * len(prompt_lengths) * gap_s))))
    rng, requests = random.Random(seed), []
    # One unmeasured pair per length first: a new server's first requests may compile kernels or
    # fill caches.
    warmup = len(prompt_lengths)
    for length in prompt_lengths:
        prompt = random_tokens(rng, length)
        for _ in range(2):
            requests.append(WorkloadRequest(len(requests), len(requests) * gap_s, prompt, 1))
    for length in prompt_lengths:
        for _ in range(repeats):
            prompt = random_tokens(rng, length)
            for _ in range(2):  # a miss, then the hit that is measured
                requests.append(WorkloadRequest(len(requests), len(requests) * gap_s, prompt, 1))
    workload = Workload("serving-latency", requests, seed_prompts=[], num_shared_prefix_tokens=0)
    results = asyncio.run(run_workload(cluster.tandem.url, cluster.layout.model, workload))
    seconds: dict[int, list[float]] = {}
    for result in results[2 * warmup + 1::2]:
        if result.ttft_s is None or result.backend is None:
            continue
        profile = rates.get(result.backend) or next(iter(rates.values()))
        model_s = StepTimeModel(profile).step_s(result.num_prompt_tokens - result.num_cached_tokens, 0)
        seconds.setdefault(result.num_prompt_tokens, []).append(result.ttft_s - model_s)
    medians = {n: statistics.median(v) for n, v in sorted(seconds.items())}
    if not medians:
        return {"fixed_s": 0.0, "per_prompt_token_s": 0.0, "by_prompt_tokens": {}}
    (short, short_s), (long, long_s) = next(iter(medians.items())), list(medians.items())[-1]
    per_token_s = max(0.0, (long_s - short_s) / (long - short)) if long > short else 0.0
    return {"fixed_s": round(max(0.0, short_s - per_token_s * short), 6), "per_prompt_token_s": per_token_s,
            "by_prompt_tokens": {n: round(v, 6) for n, v in medians.items()}}


def measure_host_floor(cluster: Any, prompt_tokens: int, max_tokens: int,
                       seed: int = 11) -> dict[str, dict[str, float]]:
    """Each accelerator engine's host work per step behind the server, the floor under route-sim's
    engine-model steps (routing/step_time.py's `host_s_per_step_by_batch`): a burst of as many
    requests as those engines run at once, each a new prompt of `prompt_tokens` generating
    `max_tokens` (so the steps admit, prefill and stream as a cell's do), sent together through
    HTTP. From each engine's stats before and after: its steps, their host seconds each (the step
    loop's time less its wait for the device) and their mean batch (generated tokens per step).
    A cpu engine's steps are its own device time, which its profile already holds: none."""
    import asyncio

    from bench.client import run_workload
    from bench.harness import engine_stats, step_work

    accelerators = {bid: cluster.tandem.backends[bid] for bid, info in cluster.infos.items()
                    if info.device_kind != "cpu"}
    if not accelerators:
        return {}
    rng = random.Random(seed)
    num_requests = sum(cluster.infos[bid].max_active for bid in accelerators)
    requests = [WorkloadRequest(i, 0.0, random_tokens(rng, prompt_tokens), max_tokens) for i in range(num_requests)]
    before = engine_stats(accelerators)
    asyncio.run(run_workload(cluster.tandem.url, cluster.layout.model,
                             Workload("host-floor", requests, seed_prompts=[], num_shared_prefix_tokens=0)))
    after = engine_stats(accelerators)
    if not before or not after:
        return {}
    floor = {}
    for bid, b, a in zip(accelerators, before, after):
        work = step_work(b, a)
        if work["steps"]:
            generated = a.num_generation_tokens_total - b.num_generation_tokens_total
            floor[bid] = {"batch": round(generated / work["steps"], 2), "steps": work["steps"],
                          "host_s": round(work["host_ms_per_step"] / 1e3, 6)}
    return floor


def _arrival_seed(cell: TenantsCell, run: int) -> int:
    """The same arrivals and tenants for every arm of a run; other arrivals in the next run."""
    from bench.runner import token_seed

    return token_seed(cell, run)


def measure_cell(ctx: Any, cluster: Any, workload: Workload, bar: Any,
                 drain_timeout_s: float | None = None) -> dict[str, Any]:
    from bench.harness import measure

    record = measure(cluster, workload, ctx.temperature, on_done=lambda _: bar.update(1),
                     drain_timeout_s=drain_timeout_s)
    record["decisions"] = [compact_decision(d) for d in record["decisions"]]
    record["tenant_metrics"] = tenant_run_metrics(record["requests"], list(cluster.infos))
    return record


def compact_decision(decision: dict[str, Any]) -> dict[str, Any]:
    """What the report needs of a routing-log line (the full line stays in OUT/logs/)."""
    keep = ("num_cached_tokens", "num_inflight_cached_tokens", "num_active", "num_queued", "score_s",
            "recompute_term_s", "replication_term_s", "queue_term_s")
    return {"index": decision["index"], "ts": decision["ts"], "backend_id": decision["backend_id"],
            "per_backend": {b: {k: s.get(k) for k in keep} for b, s in decision["per_backend"].items()}}


def write_scenario(path: Path, cell: TenantsCell, cluster: Any, seed: int,
                   serving: dict[str, Any] | None = None, step_profile: str | None = None,
                   host_floor: dict[str, dict[str, float]] | None = None) -> None:
    """The route-sim scenario of `cell` on this cluster's backends (run 1's arrivals), with the
    serving path's latency (`measure_serving_latency`) when measured, and each backend's step
    timing beyond its rates (`step_timing`, and its host floor: `measure_host_floor`)."""
    import json

    import yaml

    rates = json.loads(Path(cluster.rates_path).read_text())
    backends = []
    for b in cluster.layout.arm_backends(HYBRID_ARM, cluster.accel_max_active, cluster.cpu_max_active):
        backend = {"backend_id": b["id"], "device_kind": b["device"], "max_active": b["max_active"],
                   "rates": rates.get(b["id"]) or rates[b["device"]]}
        timing = step_timing(b, cluster.layout, step_profile)
        measured = (host_floor or {}).get(b["id"])
        if measured:
            timing["host_s_per_step_by_batch"] = {max(1, round(measured["batch"])): measured["host_s"]}
        if timing:
            backend["step_time"] = timing
        if b["id"] in cluster.layout.devices:  # engines on one GPU share it in the simulator too
            backend["device"] = cluster.layout.devices[b["id"]]
        if b.get("num_kv_blocks"):
            backend["num_kv_blocks"] = b["num_kv_blocks"]
        # A host KV tier runs only where the profile found its reload rate (a sim engine without
        # one runs without a tier): the rates say whether the live backend has one.
        if b.get("kv_host_memory_gb") and backend["rates"].get("reload_tok_s"):
            backend["num_host_kv_blocks"] = host_kv_blocks(cluster.layout.model, b, SCENARIO_BLOCK_SIZE)
            if b.get("kv_host_offload_min_hits") is not None:
                backend["kv_host_offload_min_hits"] = b["kv_host_offload_min_hits"]
        backends.append(backend)
    router = cluster.router_settings
    scenario = {"name": cell.name, "policy": HYBRID_ARM, "block_size": SCENARIO_BLOCK_SIZE, "backends": backends,
                "router": {"spill_guard": {"margin": router["spill_margin"], "allow_queue": router["spill_allow_queue"]},
                           **({"calibration": {"alpha": router["calibration_alpha"]}}
                              if router.get("calibration_alpha") else {})},
                "tenants": cell.scenario_tenants(seed)}
    if serving:
        scenario["serving"] = {"fixed_s": serving["fixed_s"], "per_prompt_token_s": serving["per_prompt_token_s"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# tandem bench tenants, cell {cell.name}, run 1's arrivals; replay with\n"
                    f"#   tandem route-sim {path.name} --policy {','.join(ARMS)} --no-decisions\n"
                    + yaml.safe_dump(scenario, sort_keys=False))


SCENARIO_BLOCK_SIZE = 16  # the cluster's block size (its default)


def step_timing(backend: dict[str, Any], layout: Any, step_profile: str | None) -> dict[str, Any]:
    """What times `backend`'s steps beyond its rates in route-sim (the context cost, the prefill
    table): a sim backend's own profile, as its emulated device runs it; an accelerator's,
    `step_profile` where given (a sim profile of that device, `tandem profile --sim-profiles`)."""
    from tandem.routing.step_time import load_sim_profile

    if backend.get("profile"):
        return load_sim_profile(backend["profile"]).dilated(layout.sim_time_scale).step_time_fields()
    if step_profile and backend["device"] != "cpu":
        return load_sim_profile(step_profile).step_time_fields()
    return {}


def host_kv_blocks(model: str, backend: dict[str, Any], block_size: int) -> int:
    """The blocks of a backend's host KV tier of `kv_host_memory_gb` GiB, as its engine converts
    them (EngineConfig.resolved_kv_host_blocks, at the KV bytes of a block in the engine's dtype),
    and on cuda as its pinned tensors round them (engine/kv_host_cache.py's pinned_num_blocks)."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.kv_host_cache import pinned_num_blocks
    from tandem.engine.model.loader import load_model_meta

    config = EngineConfig(model=model, device=backend["device"], dtype=backend.get("dtype", "auto"),
                          block_size=block_size, kv_host_memory_gb=backend["kv_host_memory_gb"])
    block_bytes = kv_bytes_per_block(model, block_size, config.torch_dtype)
    blocks = config.resolved_kv_host_blocks(block_bytes)
    if backend["device"] != "cuda":
        return blocks
    return pinned_num_blocks(blocks, block_bytes // load_model_meta(model).model_config.num_hidden_layers)


def kv_bytes_per_block(model: str, block_size: int, dtype: Any) -> int:
    """One KV block's bytes for `model` (its config only, no weights)."""
    from tandem.engine.model.loader import load_model_meta
    from tandem.engine.model_runner import ModelRunner

    return ModelRunner.kv_bytes_per_block(load_model_meta(model).model_config, block_size, dtype)


# -- metrics ---------------------------------------------------------------------------------
def tenant_run_metrics(requests: Sequence[dict[str, Any]], backend_ids: Sequence[str]) -> dict[str, Any]:
    """One run's metrics, bench/metrics.py's definitions plus the prefix-cache hit rate.

    A request cut off at the drain deadline (bench/client.py) is censored, not dropped: its TTFT
    is its first text's time if that came, else the time to the cut-off, and its E2E the time
    to the cut-off, both lower bounds, so an arm that falls behind keeps its worst requests in
    its percentiles. Other failed requests are left out and counted.

    `engine_ttft_p50_s` is the engine's part of TTFT alone, from the answers' Server-Timing: its
    queue and its first step (`to_engine` + `prefill`), what route-sim's engine model times from
    a request reaching the router (`route_sim_predictions`); the rest of TTFT is the serving path.
    Only an answer whose admission brought its first token has both stages; one that waited for
    a running slot has `admit` instead and is left out, so past saturation the figure is of the
    requests that did not wait for a slot: `engine_ttft_share` says how many of the answers it
    counts."""
    from tandem.routing.sim_report import percentile

    cut = [r for r in requests if (r.get("error") or "").startswith(CUT_OFF)]
    ok = [r for r in requests if r.get("error") is None and r.get("end_s") is not None]
    cut_at = max((_cut_time(r) for r in cut), default=None)
    counts = {b: 0 for b in backend_ids}
    for r in ok + cut:
        if r.get("backend"):
            counts[r["backend"]] = counts.get(r["backend"], 0) + 1
    ttfts = [r["ttft_s"] for r in ok] + [(r["first_text_s"] if r.get("first_text_s") is not None else cut_at)
                                          - r["send_s"] for r in cut]
    e2es = [r["e2e_s"] for r in ok] + [cut_at - r["send_s"] for r in cut]
    ends = [r["end_s"] for r in ok] + ([cut_at] if cut else [])
    makespan = max(ends) - min(r["send_s"] for r in requests) if ends else math.nan
    num_tokens = sum(r["num_output_tokens"] for r in ok)
    prompt = sum(r.get("num_prompt_tokens", 0) for r in ok)
    nan = math.nan
    stages = [r.get("server_stages") or {} for r in ok]
    engine_ttfts = [s["to_engine"] + s["prefill"] for s in stages if "to_engine" in s and "prefill" in s]
    return {"num_requests": len(requests), "num_ok": len(ok), "num_cut": len(cut), "makespan_s": makespan,
            "output_tok_s": num_tokens / makespan if makespan and makespan > 0 else nan,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else nan, "ttft_p90_s": percentile(ttfts, 90) if ttfts else nan,
            "ttft_p95_s": percentile(ttfts, 95) if ttfts else nan,
            "e2e_p50_s": percentile(e2es, 50) if e2es else nan, "e2e_p95_s": percentile(e2es, 95) if e2es else nan,
            "hit_rate": sum(r.get("num_cached_tokens", 0) for r in ok) / prompt if prompt else nan,
            "engine_ttft_p50_s": percentile(engine_ttfts, 50) if engine_ttfts else nan,
            "engine_ttft_share": len(engine_ttfts) / len(ok) if ok else nan,
            "num_output_tokens": num_tokens, "requests_by_backend": counts}


def _cut_time(request: dict[str, Any]) -> float:
    return float(request["error"].split(" at ", 1)[1].split(" s", 1)[0])


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: each arm's means and spreads, and cost against the best other arm."""
    cells: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        cells.setdefault(record["cell"], []).append(record)
    return [summarize_cell(runs) for runs in cells.values()]


def summarize_cell(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    arms: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: (r["run"], r["arm"])):
        arms.setdefault(record["arm"], []).append(record["tenant_metrics"])
    out = {"cell": records[0]["cell"], "spec": records[0]["cell_spec"],
           "arms": {arm: aggregate(runs) for arm, runs in arms.items()}}
    out["verdict"] = verdict(out["arms"])
    return out


def route_sim_predictions(scenario_path: Path, arms: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
    """route-sim's prediction of a cell (its scenario, run 1's arrivals) under each arm, on the
    engine's scheduler and KV cache (`tandem route-sim`'s model): what the simulator says beside
    what the live cluster did, and its engine part alone (from the router seeing a request to its
    first token: `engine_ttft_p50_s`, against the live answers' Server-Timing). Keyed by arm, then
    by model ("engine")."""
    from tandem.cluster.engine_sim_backend import engine_backend_factory
    from tandem.routing.scenario import load_scenario
    from tandem.routing.sim_report import percentile
    from tandem.routing.sim_report import summarize as summarize_sim
    from tandem.routing.simulator import simulate

    scenario = load_scenario(scenario_path)
    backend_ids = [b.spec.backend_id for b in scenario.backends]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm in arms:
        outcomes = simulate(scenario, arm, engine_backend_factory()).outcomes
        summary = summarize_sim(arm, outcomes, backend_ids)
        out[arm] = {"engine": {"ttft_p50_s": summary.ttft_p50_s, "ttft_p95_s": summary.ttft_p95_s,
                               "output_tok_s": summary.output_tok_s, "hit_rate": summary.cache_hit_rate,
                               "engine_ttft_p50_s": percentile([o.first_token_s - o.arrival_s for o in outcomes], 50)}}
    return out


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: spread([r.get(name, math.nan) for r in runs]) for name in METRICS}
    backends = sorted({b for r in runs for b in r["requests_by_backend"]})
    out["requests_by_backend"] = {b: [r["requests_by_backend"].get(b, 0) for r in runs] for b in backends}
    out["num_runs"] = len(runs)
    out["num_cut_requests"] = sum(r["num_cut"] for r in runs)
    out["num_failed_requests"] = sum(r["num_requests"] - r["num_ok"] - r["num_cut"] for r in runs)
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": math.nan, "sd": math.nan, "n": 0}
    return {"mean": round(statistics.fmean(values), 6),
            "sd": round(statistics.stdev(values), 6) if len(values) > 1 else 0.0, "n": len(values)}


def verdict(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Is `cost` at least as good as the best other arm on TTFT p50, TTFT p95 and throughput,
    beyond the run-to-run spread (worse by more than the larger of the two sds), and is its hit
    rate within 5 points of prefix-affinity's? None where there is nothing to judge by."""
    if HYBRID_ARM not in arms or len(arms) < 2:
        return {}
    cost = arms[HYBRID_ARM]
    out: dict[str, Any] = {}
    for metric in VERDICT_METRICS:
        higher = METRICS[metric]
        others = {a: v[metric] for a, v in arms.items() if a != HYBRID_ARM and v[metric]["n"]}
        if not others or not cost[metric]["n"]:
            continue
        best_arm = (max if higher else min)(others, key=lambda a: others[a]["mean"])
        best = others[best_arm]
        worse_by = (best["mean"] - cost[metric]["mean"]) if higher else (cost[metric]["mean"] - best["mean"])
        tolerance = max(best["sd"], cost[metric]["sd"])
        judged = best["n"] > 1 and cost[metric]["n"] > 1
        out[metric] = {"best_other_arm": best_arm, "best_other": best["mean"], "cost": cost[metric]["mean"],
                       "worse_by": round(worse_by, 6), "tolerance": tolerance,
                       "ok": (worse_by <= tolerance) if judged else None}
    affinity = arms.get("prefix-affinity")
    if affinity and affinity["hit_rate"]["n"] and cost["hit_rate"]["n"]:
        gap = affinity["hit_rate"]["mean"] - cost["hit_rate"]["mean"]
        out["hit_rate"] = {"prefix_affinity": affinity["hit_rate"]["mean"], "cost": cost["hit_rate"]["mean"],
                           "gap": round(gap, 6), "ok": gap <= HIT_RATE_BAND}
    return out
