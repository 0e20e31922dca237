"""`tandem bench throughput`: long, varied requests (workload W and its variants), with the GPU's
busy share.

W (bench/workload.py) is what people run against a server: 512 requests of 64-2,048 prompt and
32-1,024 output tokens, all submitted at once to an in-process engine (qwen2.5-0.5b-random,
bf16) at max_active 256; variants at max_active 64 and 128 and with every length halved and
doubled. Output tok/s over the wall time from first submit to last finish; the GPU's busy share
is kernel time over wall time under the torch profiler (CUDA activity only). `--phases` times
each public engine phase per step by kind of step. (The fast path's own rows, decode at batch 4
and 48 x (516 -> 128), are `tandem bench fast-path --sections gpu`.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from bench._machine import stamp
from bench.harness import burst, greedy, make_engine
from bench.workload import W, varied_requests

MODEL = "qwen2.5-0.5b-random"
# name: (max_active, length scale)
ROWS = {"W": (256, 1.0), "W_ma64": (64, 1.0), "W_ma128": (128, 1.0), "W_half": (256, 0.5), "W_double": (256, 2.0)}
KV_CACHE_GB = 32.0  # the doubled lengths need ~0.8M tokens of K/V at 256 active; the H200 has room


def drive(engine, reqs, tag: str) -> dict:
    """Submit every request at once, step until all finish; wall time, tokens, steps."""
    run = burst(engine, [p for p, _ in reqs], [m for _, m in reqs], tag)
    return {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs), "generated": run["generated"],
            "expected": sum(m for _, m in reqs), "wall_s": round(run["wall_s"], 3), "steps": run["steps"],
            "tok_s": round(run["tok_s"], 1), "preemptions": engine.get_stats().num_preemptions}


def warm_up(engine, seed: int) -> None:
    """Compile every kernel variant a W run meets (prefill tiles, split counts) outside the timing."""
    reqs = varied_requests(24, W[1], W[2], seed, max_model_len=engine.max_model_len)
    drive(engine, [(p[: engine.max_model_len - 8], 8) for p, _ in reqs], f"warm{seed}")


def kernel_time(engine, reqs, tag: str) -> dict:
    """The same run under the torch profiler (CUDA activity only): kernel time, by kind."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run = drive(engine, reqs, tag)
    by_kind: dict[str, float] = defaultdict(float)
    intervals = []
    for evt in prof.profiler.kineto_results.events():
        if evt.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name()
        kind = kernel_kind(name)
        if kind is None:
            continue
        start, dur = evt.start_ns(), evt.duration_ns()
        by_kind[kind] += dur / 1e9
        intervals.append((start, start + dur))
    intervals.sort()
    busy, end = 0, None
    for s, e in intervals:  # union, in case two streams overlapped
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return {"profiled_wall_s": run["wall_s"], "profiled_tok_s": run["tok_s"], "steps": run["steps"],
            "generated": run["generated"], "preemptions": run["preemptions"], "kernel_s": round(busy / 1e9, 3),
            "num_kernels": len(intervals),
            "by_kind_s": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def kernel_kind(name: str) -> str | None:
    lowered = name.lower()
    if lowered.startswith(("memcpy", "memset")):
        return "copy"
    for kind, keys in (("attention prefill/mixed", ("_paged_attention", "_unified_attention", "_prefill")),
                       ("attention decode", ("_paged_decode", "_merge_splits")),
                       ("kv_write", ("_write_kv",)), ("norm/rope/silu", ("_rms_norm", "_rotary", "_silu")),
                       ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90", "xmma", "cublas", "splitk"))):
        if any(k in lowered for k in keys):
            return kind
    return "other"


# -- host breakdown -------------------------------------------------------------------------
def phase_breakdown(engine, reqs, tag: str) -> dict:
    """One run with the engine's public phases timed (ms per step), by kind of step: `decode`, or
    `with prefill` (the engine's stats of the step a call finished)."""
    from tandem.engine.model_runner import StepHandle

    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    runner, scheduler = engine.model_runner, engine.scheduler
    owners = [(owner, name) for owner, name in ((scheduler, "schedule"), (scheduler, "advance"),
                                                (scheduler, "update_from_output"), (runner, "prepare_inputs"),
                                                (runner, "launch"), (runner, "execute"), (runner.sampler, "sample"),
                                                (engine.output_processor, "process_outputs"))
              if hasattr(owner, name)]
    for owner, name in owners:  # instance attributes shadow the class's methods
        setattr(owner, name, timed(name, getattr(owner, name)))
    tokens = StepHandle.tokens
    StepHandle.tokens = timed("wait for sampled ids", tokens)
    kinds: dict[str, dict] = {}
    try:
        for i, (prompt, max_tokens) in enumerate(reqs):
            engine.add_request(f"{tag}-{i}", prompt, greedy(max_tokens))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            spent.clear()
            s0 = time.perf_counter()
            engine.step()
            dt, stats = time.perf_counter() - s0, engine.get_stats()
            k = kinds.setdefault("with prefill" if stats.step_prefill_tokens else "decode",
                                 {"steps": 0, "wall_s": 0.0, "tokens": 0, "phases_s": defaultdict(float)})
            k["steps"], k["wall_s"] = k["steps"] + 1, k["wall_s"] + dt
            k["tokens"] += stats.step_prefill_tokens + stats.step_decode_tokens
            for name, v in spent.items():
                k["phases_s"][name] += v
        wall = time.perf_counter() - t0
    finally:
        StepHandle.tokens = tokens
        for owner, name in owners:
            del owner.__dict__[name]
    return {"wall_s": round(wall, 3), "kinds": {
        kind: {"steps": k["steps"], "ms_per_step": round(1e3 * k["wall_s"] / k["steps"], 3),
               "tokens_per_step": round(k["tokens"] / k["steps"], 1), "share_of_wall": round(k["wall_s"] / wall, 3),
               "phase_ms_per_step": {p: round(1e3 * v / k["steps"], 3) for p, v in k["phases_s"].items()}}
        for kind, k in kinds.items()}}


# -- the rows -------------------------------------------------------------------------------
def run_row(name: str, engine, seed: int, profile: bool, num_requests: int = W[0],
            plain: bool = False) -> dict:
    """One row. Profiled rows take tok/s and busy share from the one profiled run (CUDA
    activity only: the profiler added no measurable wall time to W); `plain` adds an
    unprofiled run of the same requests, whose tok/s is then reported."""
    max_active, scale = ROWS[name]
    engine.set_max_active(max_active)
    reqs = varied_requests(num_requests, W[1], W[2], seed, scale, engine.max_model_len)
    row = {"row": name, "max_active": max_active, "scale": scale}
    if profile:
        prof = kernel_time(engine, reqs, f"{name}-{seed}p")
        row.update(requests=len(reqs), prompt_tokens=sum(len(p) for p, _ in reqs), generated=None,
                   wall_s=prof["profiled_wall_s"], tok_s=prof["profiled_tok_s"], steps=prof["steps"],
                   gpu_busy=round(prof["kernel_s"] / prof["profiled_wall_s"], 3), profile=prof)
        row["generated"] = prof["generated"]
    if plain or not profile:
        run = drive(engine, reqs, f"{name}-{seed}")
        row.update(run)
        if profile:
            row["gpu_busy_vs_plain_wall"] = round(row["profile"]["kernel_s"] / run["wall_s"], 3)
    print(f"[{name}] {row['tok_s']:,.0f} tok/s, wall {row['wall_s']} s, {row['steps']} steps, busy {row.get('gpu_busy')}",
          flush=True)
    return row


def render(report: dict) -> str:
    lines = ["| row | max_active | lengths | requests | output tokens | wall s | steps | output tok/s | GPU busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        busy = f"{100 * r['gpu_busy']:.0f}%" if r.get("gpu_busy") is not None else "—"
        lines.append(f"| {r['row']}{' (' + r['variant'] + ')' if r.get('variant') else ''} | {r['max_active']} | x{r['scale']} | "
                     f"{r['requests']} | {r['generated']:,} | {r['wall_s']:.2f} | {r['steps']} | **{r['tok_s']:,.0f}** | {busy} |")
    for r in report["rows"]:
        if "phases" in r:
            lines += ["", f"Host breakdown, {r['row']} ({r['phases']['wall_s']} s under the timers):"]
            for kind, k in r["phases"]["kinds"].items():
                ph = ", ".join(f"{p} {v:.2f}" for p, v in sorted(k["phase_ms_per_step"].items(), key=lambda kv: -kv[1]))
                lines.append(f"  {kind}: {k['steps']} steps, {k['ms_per_step']:.2f} ms/step, {k['tokens_per_step']} tok/step, "
                             f"{100 * k['share_of_wall']:.0f}% of wall; ms/step: {ph}")
        if "profile" in r:
            p = r["profile"]
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_s"].items())
            lines.append(f"Kernels, {r['row']}: {p['kernel_s']:.2f} s in {p['num_kernels']:,} kernels ({kinds}); "
                         f"profiled run {p['profiled_wall_s']:.2f} s")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--out", default="out/throughput")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run (no GPU busy share)")
    parser.add_argument("--profile-rows", nargs="*", default=None, help="rows that get the profiled run (default: all)")
    parser.add_argument("--plain-rows", nargs="*", default=[], help="profiled rows that also get an unprofiled run")
    parser.add_argument("--phases", action="store_true", help="also time the engine's host phases on W")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--device", default="cuda", help="cpu runs the logic on a tiny model (smoke test)")
    parser.add_argument("--num-requests", type=int, default=W[0])
    parser.add_argument("--variant", default="", help="a label for this engine configuration")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="EngineConfig override (ints and floats parsed), e.g. max_num_batched_tokens=16384")


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def run(args: argparse.Namespace) -> int:
    engine_kw = {key: _value(value) for key, _, value in (kv.partition("=") for kv in args.engine)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {**stamp(None, args.device), "model": args.model, "engine": engine_kw, "kv_cache_gb": KV_CACHE_GB,
              "rows": []}
    t0 = time.perf_counter()
    kv = {"kv_cache_memory_gb": KV_CACHE_GB} if args.device == "cuda" else {}
    engine = make_engine(args.model, args.device, max(ROWS[r][0] for r in args.rows), **{**kv, **engine_kw})
    report["engine_build_s"] = round(time.perf_counter() - t0, 1)
    warm_up(engine, seed=99)
    profile_rows = args.rows if args.profile_rows is None else args.profile_rows
    for name in args.rows:
        row = run_row(name, engine, args.seed, not args.no_profile and name in profile_rows, args.num_requests,
                      plain=name in args.plain_rows)
        row["variant"] = args.variant
        if args.phases and name == "W":
            reqs = varied_requests(args.num_requests, W[1], W[2], args.seed + 1, max_model_len=engine.max_model_len)
            row["phases"] = phase_breakdown(engine, reqs, "phases")
        report["rows"].append(row)
        (out / "throughput.json").write_text(json.dumps(report, indent=1))
    table = render(report)
    (out / "throughput.md").write_text(table)
    print(table)
    return 0
