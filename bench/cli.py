"""`tandem bench MODE`: every benchmark. The end-to-end ones through the HTTP endpoint:

    tandem bench seed  --out out/seed  [--num-requests 8,48] [--runs 3] [--report docs/benchmarks/x.md]
    tandem bench sweep --out out/sweep [--accel-max-active 1,2,4,8,16,32] [--cache-hit 0,0.5,0.96] ...
                       [--with-seed --seed-report docs/benchmarks/seed-x.md] [--report docs/benchmarks/sweep-x.md]
    tandem bench tenants --out out/tenants --backends cpu,cuda*2 [--tenants 4,16] [--prefix-tokens 1024]
                       [--arrival-rates 10,40,100] [--num-kv-blocks N] [--report docs/benchmarks/tenants-x.md]
    tandem bench soak --out out/soak --model tiny-llama-random --flags='--backends cpu*2' [--duration-s 600]
    tandem bench fidelity --out out/fid --model smollm2-135m --device cpu --scale 0.1   # a real engine vs its sim
    tandem bench report out/sweep --report seed-x.md --sweep-report sweep-x.md   # re-render from the JSON

`seed` and `sweep` write OUT/meta.json first, one JSON per run under OUT/runs/ as it finishes,
then OUT/summary.json (cells, means and spreads, oracle) and the reports asked for, each with
its plots and one JSON of everything it shows beside it. See bench/seed.py, bench/sweep.py and
bench/runner.py for what runs where, bench/report.py for what the reports show; bench/tenants.py
and bench/tenants_report.py for the multi-tenant mode; bench/soak.py for the long mixed-traffic
run against one `tandem serve` (lost requests, memory growth, latency drift).

The other modes (`TOOLS`) each live in one module with `add_arguments(parser)` and `run(args)`;
only the chosen one is imported, so `tandem bench --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from bench._machine import command
from bench.harness import floats, ints

# mode -> (module, one-line help)
TOOLS: dict[str, tuple[str, str]] = {
    "engine": ("bench.engine", "one engine against HF transformers in-process: tok/s, TTFT, E2E"),
    "fast-path": ("bench.fast_path", "GPU fast path and CPU decode step against HF eager and the memory floor"),
    "throughput": ("bench.throughput", "workload W in-process: output tok/s, GPU busy share, host phases"),
    "cpu-vs-llamacpp": ("bench.cpu_vs_llamacpp", "the CPU engine against llama.cpp at matched precision"),
    "quant-accuracy": ("bench.quant_accuracy", "int8/int4 weights: perplexity and top-1 agreement"),
    "structured-output": ("bench.structured_output", "what a JSON-schema constraint costs per decode step"),
    "served-path": ("bench.served_path", "the in-process engine against tandem serve's HTTP API"),
    "fanout-step": ("bench.fanout_step", "the engine core's I/O work per step, and the caller's"),
    "serve-load": ("bench.serve_load", "tandem serve configurations under closed-loop HTTP load"),
    "deadlines": ("bench.deadlines", "TTFT deadlines and priorities against FCFS through HTTP"),
    "engine-queue": ("bench.engine_queue", "the engine's host time per step with a long queue past saturation"),
    "router-decision": ("bench.router_decision", "router decision latency with a deep backlog"),
    "router-scaling": ("bench.router_scaling", "one router actor's CPU per placement and report, by backends"),
    "route-sim-grid": ("bench.route_sim_grid", "the multi-tenant routing grid in the simulator"),
}


def _lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        prompt, _, output = item.partition(":")
        if not output:
            raise argparse.ArgumentTypeError(f"--lengths wants PROMPT:OUTPUT pairs, got {item!r}")
        pairs.append((int(prompt), int(output)))
    return pairs


def _policies(text: str) -> list[str]:
    from tandem.routing import POLICIES

    arms = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [a for a in arms if a not in POLICIES]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"--arms: unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    return arms


def _arms(text: str) -> list[str]:
    arms = [x.strip() for x in text.split(",") if x.strip()]
    if "accelerator-only" not in arms or "cost" not in arms:
        raise argparse.ArgumentTypeError("--arms must include accelerator-only and cost (the baseline and the hybrid)")
    return arms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="MODE", required=True)
    seed = sub.add_parser("seed", help="the design's experiment: accelerator-only vs hybrid, 8 and 48 requests")
    _common(seed)
    _seed_arguments(seed, "--num-requests")
    seed.add_argument("--runs", type=int, default=3, help="runs per arm, each on a fresh cluster (default 3)")
    seed.add_argument("--max-active", type=int, default=4, help="accelerator max_active (default 4)")
    seed.add_argument("--report", help="markdown report to write (plots and JSON go beside it)")
    sweep = sub.add_parser("sweep", help="GPU concurrency, Poisson arrivals, cache-hit rate, prompt/output lengths")
    _common(sweep)
    _sweep_arguments(sweep)
    tenants = sub.add_parser("tenants", help="routing policies on many tenants with long shared prefixes "
                             "(Zipf popularity, Poisson arrivals), one reused cluster")
    _tenants_arguments(tenants)
    from bench import soak

    soak.add_arguments(sub.add_parser("soak", help="one `tandem serve` under mixed traffic for a long time: "
                                      "lost requests, memory growth, latency drift"))
    from bench import fidelity

    fidelity.add_arguments(sub.add_parser("fidelity", help="a real engine against its sim (the sim device) on "
                                          "the same workloads: TTFT, throughput, hit rate"))
    report = sub.add_parser("report", help="render the reports from a finished bench's JSON")
    report.add_argument("out", help="the bench's output folder (meta.json and runs/)")
    report.add_argument("--report", help="seed report (markdown) to write")
    report.add_argument("--sweep-report", help="sweep report (markdown) to write")
    report.add_argument("--tenants-report", help="tenants report (markdown) to write")
    chosen = _chosen_mode()
    for name, (module, help_text) in TOOLS.items():
        tool = sub.add_parser(name, help=help_text, description=f"{help_text} (see {module.replace('.', '/')}.py)")
        if chosen in (name, None):
            importlib.import_module(module).add_arguments(tool)


def _chosen_mode() -> str | None:
    """The mode on this process's command line (`tandem bench MODE ...`), "" for none (`tandem
    bench --help`), None when this is not the `tandem bench` command line (tests): every mode."""
    if "bench" not in sys.argv[:2]:
        return None
    rest = sys.argv[sys.argv.index("bench") + 1:]
    return rest[0] if rest else ""


def _seed_arguments(parser: argparse.ArgumentParser, *aliases: str) -> None:
    parser.add_argument("--seed-num-requests", *aliases, dest="seed_num_requests", type=ints,
                        default=[8, 48], help="request counts of the design's experiment (default 8,48)")
    parser.add_argument("--seed-prefix-tokens", type=int, default=508,
                        help="prompt tokens seeded into both caches (default 508: 496 reusable in 16-token blocks)")


def _sweep_arguments(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument("--num-requests", type=int, default=24, help="requests per cell (default 24)")
    sweep.add_argument("--runs", type=int, default=2, help="runs per arm of the base max_active's cells (default 2)")
    sweep.add_argument("--other-max-active-runs", type=int,
                       help="runs per arm of the other max_active values' cells (default: --runs)")
    sweep.add_argument("--accel-max-active", type=ints, default=[1, 2, 4, 8, 16, 32],
                       help="accelerator max_active values ('' skips; default 1,2,4,8,16,32)")
    sweep.add_argument("--arrival-rates", type=floats, default=[5.0, 10.0, 20.0],
                       help="Poisson arrival rates, requests/s ('' skips; default 5,10,20)")
    sweep.add_argument("--cache-hit", type=floats, default=[0.0, 0.5, 0.96],
                       help="seeded shared fraction of each prompt ('' skips; default 0,0.5,0.96)")
    sweep.add_argument("--lengths", type=_lengths, default=[(516, 32), (128, 128)],
                       help="PROMPT:OUTPUT token lengths ('' skips; default 516:32,128:128)")
    sweep.add_argument("--base-cache-hit", type=float, default=0.96, help="the base cell's cache hit (default 0.96)")
    sweep.add_argument("--base-max-active", type=int, default=4, help="the base cell's accelerator max_active (4)")
    sweep.add_argument("--report", help="sweep report (markdown) to write (plots and JSON go beside it)")
    sweep.add_argument("--fresh-clusters", action="store_true",
                       help="a fresh cluster per max_active, run and arm, as the seed does (default: one cluster "
                            "for the whole sweep, reconfigured between cells; see bench/runner.py)")
    sweep.add_argument("--with-seed", action="store_true",
                       help="also run the design's experiment, in the base max_active's clusters")
    sweep.add_argument("--seed-runs", type=int, default=3, help="runs of the design's cells with --with-seed (3)")
    sweep.add_argument("--seed-report", help="with --with-seed: the seed report (markdown) to write")
    _seed_arguments(sweep)


def _common(parser: argparse.ArgumentParser) -> None:
    _cluster_options(parser)
    parser.add_argument("--arms", type=_arms, default=["accelerator-only", "cost"],
                        help="policies to compare (default accelerator-only,cost; e.g. add least-requests)")
    parser.add_argument("--prompt-tokens", type=int, default=516, help="prompt tokens (default 516)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens, EOS ignored (default 128)")
    parser.add_argument("--interval-s", type=float, default=0.05, help="fixed arrival interval (default 0.05 s)")
    parser.add_argument("--only", type=_only, help="run only these clusters, RUN:ARM,... (e.g. 2:accelerator-only), "
                        "to complete a bench that ran out of time")


def _tenants_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.tenants import ARMS

    _cluster_options(parser)
    parser.add_argument("--arms", type=_policies, default=list(ARMS),
                        help=f"routing policies to compare (default {','.join(ARMS)})")
    parser.add_argument("--tenants", type=ints, default=[4, 16], help="tenant counts (default 4,16)")
    parser.add_argument("--prefix-tokens", type=ints, default=[1024],
                        help="shared prefix tokens per tenant (default 1024; a list runs each)")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="unique prompt tokens per request (default 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens, EOS ignored (default 64)")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="tenant k is picked with weight 1/k**s (default 1)")
    parser.add_argument("--arrival-rates", type=floats, default=[10.0, 40.0, 100.0],
                        help="Poisson arrival rates, requests/s (default 10,40,100)")
    parser.add_argument("--duration-s", type=float, default=10.0,
                        help="seconds of arrivals per cell: rate x duration requests (default 10)")
    parser.add_argument("--min-requests", type=int, default=40, help="requests per cell at least (default 40)")
    parser.add_argument("--runs", type=int, default=2, help="runs per arm and cell (default 2)")
    parser.add_argument("--drain-timeout-s", type=float,
                        help="stop waiting this long after a measurement's last arrival; unfinished requests are "
                             "cut off and count with their time so far (default: wait for every request)")
    parser.add_argument("--max-active", type=int, default=16, help="accelerator backends' max_active (default 16)")
    parser.add_argument("--num-kv-blocks", type=int,
                        help="KV cache blocks (16 tokens each) of every backend; what decides whether the "
                             "prefixes fit (default: the engine's, sized from memory)")
    parser.add_argument("--kv-host-memory-gb", type=float, metavar="GIB",
                        help="every cuda and sim backend's host-memory KV tier (tandem serve --kv-host-memory-gb; "
                             "0: off; default the server's)")
    parser.add_argument("--kv-host-offload-min-hits", type=int, metavar="N",
                        help="the host tier keeps only evicted blocks hit at least N times (0: every evicted "
                             "block; default the engine's)")
    parser.add_argument("--report", help="markdown report to write (plot and JSON go beside it)")
    parser.add_argument("--step-profile", metavar="FILE",
                        help="a sim profile of the accelerator backends' device (tandem profile --sim-profiles): "
                             "route-sim's prediction of each cell times their steps with its context cost and "
                             "prefill table, which the rates leave out (sim backends: their own profile's)")


def _cluster_options(parser: argparse.ArgumentParser) -> None:
    from tandem.engine.config import CPU_KERNELS

    parser.add_argument("--out", required=True, help="output folder for the JSON (meta.json, runs/, summary.json)")
    parser.add_argument("--model", default="smollm2-135m", help="model preset (default smollm2-135m)")
    parser.add_argument("--backends", default="cpu,auto",
                        help="backends (default cpu,auto; several GPUs: cpu,cuda*2 or cpu,cuda*all)")
    parser.add_argument("--cpu-threads", type=int,
                        help="torch threads per cpu backend (default: the cores left after one for serving and "
                             "one per accelerator backend, shared by the cpu backends)")
    parser.add_argument("--cpu-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "int4"],
                        help="cpu backends' dtype, `auto` resolved to a cpu included: int8/int4 are weight-only "
                             "quantized linears with bfloat16 activations (default auto: float32)")
    parser.add_argument("--cpu-compile", action="store_true",
                        help="opt-in: cpu backends decode through torch.compile'd graphs (tandem serve "
                             "--cpu-compile); the first cluster start compiles for a while, later ones load the "
                             "cache, and the profile step measures the compiled rates. It lost to eager decode on "
                             "a 14-thread Xeon in our measurements")
    parser.add_argument("--cpu-kernels", default="auto", choices=CPU_KERNELS,
                        help="whose kernels run the cpu backends (tandem serve --cpu-kernels): auto (default: "
                             "float32 decode steps through ggml's graph where ggml is built, the rest eager), torch, "
                             "or ggml (with --cpu-dtype int8/int4), llama.cpp's own quantized dot "
                             "products, built when Tandem is installed (about a minute on two cores), "
                             "faster per decode row on AVX2 CPUs; or ggml-graph (int8, int4 or float32), each decode "
                             "step run as one ggml graph; the profile step measures their rates")
    parser.add_argument("--cpu-max-active", type=int, default=4, help="cpu backends' max_active (default 4)")
    parser.add_argument("--sim-profile", metavar="NAME|FILE",
                        help="the device sim backends emulate (tandem serve --sim-profile; default its default)")
    parser.add_argument("--sim-time-scale", type=float, default=1.0, metavar="K",
                        help="sim steps last K times their profile's (tandem serve --sim-time-scale; default 1)")
    parser.add_argument("--rates", help="rates file for every cluster (default: run tandem profile first)")
    parser.add_argument("--temperature", type=float,
                        help="sampling temperature (default 0, or 1.0 seeded per request for *-random presets)")
    parser.add_argument("--time-budget-s", type=float, help="stop starting clusters/cells after this many seconds")
    parser.add_argument("--warmup-tokens", type=int, default=48,
                        help="after each cluster starts, every backend decodes a full batch at the same time, this "
                             "many tokens per request on the slowest backend (cluster/warmup.py; default 48; 0: none)")
    parser.add_argument("--verbose", action="store_true", help="show the actors' logs")


def _only(text: str) -> set[tuple[int, str]]:
    pairs = set()
    for item in (x.strip() for x in text.split(",") if x.strip()):
        run, _, arm = item.partition(":")
        if not arm:
            raise argparse.ArgumentTypeError(f"--only wants RUN:ARM pairs, got {item!r}")
        pairs.add((int(run), arm))
    return pairs


def plan(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """The cells to run and the settings recorded in meta.json."""
    from bench import seed, sweep

    if args.bench_command == "seed":
        return seed.seed_items(args, args.runs), {"seed": seed.settings(args, args.runs)}
    cells, dims = sweep.build_cells(args)
    items = sweep.sweep_items(cells, args.runs, args.other_max_active_runs, args.base_max_active)
    settings = {"sweep": sweep.settings(args, dims)}
    if args.with_seed:
        args.max_active = args.base_max_active
        items = seed.seed_items(args, args.seed_runs) + items
        settings["seed"] = seed.settings(args, args.seed_runs)
    return items, settings


def run(args: argparse.Namespace) -> int:
    if args.bench_command in TOOLS:
        return int(importlib.import_module(TOOLS[args.bench_command][0]).run(args) or 0)
    if args.bench_command == "report":
        if args.tenants_report:
            _render_tenants(Path(args.out), Path(args.tenants_report))
        return _render(Path(args.out), args.report, args.sweep_report) if args.report or args.sweep_report else 0
    if args.bench_command == "tenants":
        return _run_tenants(args)
    if args.bench_command == "soak":
        from bench import soak

        return soak.run(args)
    if args.bench_command == "fidelity":
        from bench import fidelity

        return fidelity.run(args)
    from tqdm import tqdm

    from bench import harness, runner

    out_dir = Path(args.out)
    items, settings = plan(args)
    ctx = harness.prepare(out_dir, args.model, args.backends, args.cpu_threads, args.cpu_dtype, args.cpu_max_active,
                          max(i.cell.accel_max_active for i in items), args.rates, args.temperature,
                          args.time_budget_s, args.verbose, command(), cpu_compile=args.cpu_compile,
                          cpu_kernels=args.cpu_kernels, sim_profile=args.sim_profile,
                          sim_time_scale=args.sim_time_scale)
    ctx.warmup_tokens = args.warmup_tokens
    ctx.meta.update(bench=args.bench_command, settings=settings, arms=args.arms, warmup_tokens=args.warmup_tokens,
                    reuse_cluster=args.bench_command == "sweep" and not args.fresh_clusters,
                    only=sorted(f"{run}:{arm}" for run, arm in args.only) if args.only else None)
    harness.write_json(out_dir / "meta.json", ctx.meta)
    with tqdm(total=runner.total_requests(items, args.arms), unit="req", dynamic_ncols=True) as bar:
        records = runner.run_plan(ctx, items, args.arms, bar, args.only,
                                  reuse=args.bench_command == "sweep" and not args.fresh_clusters)
    _write_summary(out_dir, ctx.meta, records)
    seed_report = args.report if args.bench_command == "seed" else getattr(args, "seed_report", None)
    sweep_report = args.report if args.bench_command == "sweep" else None
    if seed_report or sweep_report:
        return _render(out_dir, seed_report, sweep_report)
    return 0


def _run_tenants(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bench import harness, tenants

    out_dir = Path(args.out)
    cells = tenants.build_cells(args)
    ctx = harness.prepare(out_dir, args.model, args.backends, args.cpu_threads, args.cpu_dtype, args.cpu_max_active,
                          args.max_active, args.rates, args.temperature, args.time_budget_s, args.verbose,
                          command(), num_kv_blocks=args.num_kv_blocks, cpu_compile=args.cpu_compile,
                          cpu_kernels=args.cpu_kernels, sim_profile=args.sim_profile,
                          sim_time_scale=args.sim_time_scale, kv_host_memory_gb=args.kv_host_memory_gb,
                          kv_host_offload_min_hits=args.kv_host_offload_min_hits)
    ctx.warmup_tokens = args.warmup_tokens
    ctx.meta.update(bench="tenants", settings={"tenants": tenants.settings(args, cells)}, arms=args.arms,
                    warmup_tokens=args.warmup_tokens, reuse_cluster=True)
    harness.write_json(out_dir / "meta.json", ctx.meta)
    total = args.runs * len(args.arms) * sum(c.num_requests for c in cells)
    with tqdm(total=total, unit="req", dynamic_ncols=True) as bar:
        records = tenants.run_tenants(ctx, cells, args.arms, args.runs, args.max_active, bar,
                                       args.drain_timeout_s, args.step_profile)
    harness.write_json(out_dir / "meta.json", ctx.meta)  # with what the run measured first (serving_latency)
    cells_summary = tenants.summarize(records)
    for cell in cells_summary:
        scenario = out_dir / "scenarios" / f"{cell['cell']}.yaml"
        if scenario.is_file():
            cell["route_sim"] = tenants.route_sim_predictions(scenario, args.arms)
    harness.write_json(out_dir / "summary.json", {"meta": ctx.meta, "cells": cells_summary})
    print(f"wrote {out_dir / 'summary.json'} ({len(records)} runs)")
    if args.report:
        _render_tenants(out_dir, Path(args.report))
    return 0


def _render_tenants(out_dir: Path, path: Path) -> None:
    from bench.report import load_bench
    from bench.tenants_report import render_tenants_report

    meta, runs = load_bench(out_dir)
    summary_path = out_dir / "summary.json"
    cells = json.loads(summary_path.read_text())["cells"] if summary_path.is_file() else []
    predictions = {c["cell"]: c["route_sim"] for c in cells if c.get("route_sim")}
    written = render_tenants_report(meta, [r for r in runs if r.get("bench") == "tenants"], path,
                                    predictions=predictions)
    print("wrote " + ", ".join(str(p) for p in written))


def _write_summary(out_dir: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    from bench.harness import write_json
    from bench.summary import summarize

    write_json(out_dir / "summary.json", {"meta": meta, "cells": summarize(records, meta["accel_id"])})
    print(f"wrote {out_dir / 'summary.json'} ({len(records)} runs)")


def _render(out_dir: Path, seed_report: str | None, sweep_report: str | None) -> int:
    from bench.report import load_bench, render_report

    meta, runs = load_bench(out_dir)
    written: list[Path] = []
    for which, path in (("seed", seed_report), ("sweep", sweep_report)):
        if path:
            written += render_report(meta, runs, Path(path), which)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
