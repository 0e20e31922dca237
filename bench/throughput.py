"""Throughput on long, varied requests: workload W and its variants, with the GPU's busy share.

W is what people run against a server, not the 48 x (516 -> 128) the fast path was first tuned
on: 512 requests, prompt lengths uniform in [64, 2048], output lengths uniform in [32, 1024]
(seeded), ignore_eos, all submitted at once to an in-process `LLMEngine` (qwen2.5-0.5b-random,
bf16) at max_active 256. Variants: max_active 64 and 128, and every length halved and doubled
(capped so prompt + output fits the context). Each row reports output tok/s (every output
token over the wall time from submitting the first request to the last one finishing).

The GPU's busy share is the sum of kernel time over wall time. Kernel time comes from a second,
identical run under the torch profiler (CUDA activity only): the schedule and so the kernels are
the same in both runs, so kernel time / wall of the unprofiled run is the plain run's busy share;
the profiled run's own wall is reported too, to show what the profiler costs.

`--phases` adds a host breakdown of one run: time per step in each engine phase (schedule,
input build, launch, waiting for the sampled ids, output processing) by step kind, taken by
wrapping whatever of those methods the engine has.

    PYTHONPATH=. python3 -m bench.throughput --out $OUT/tp            # every row
    PYTHONPATH=. python3 -m bench.throughput --rows W --phases        # W alone, with the breakdown
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

MODEL = "qwen2.5-0.5b-random"
NUM_REQUESTS = 512
PROMPT_RANGE = (64, 2048)
OUTPUT_RANGE = (32, 1024)
# name: (max_active, length scale)
ROWS = {"W": (256, 1.0), "W_ma64": (64, 1.0), "W_ma128": (128, 1.0), "W_half": (256, 0.5), "W_double": (256, 2.0)}
KV_CACHE_GB = 32.0  # the doubled lengths need ~0.8M tokens of K/V at 256 active; the H200 has room


def workload(num: int, scale: float, seed: int, max_model_len: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request: lengths uniform in W's ranges times `scale`, capped
    so prompt + output fits `max_model_len`. Prompts are random ids, so no two share a prefix."""
    rng = random.Random(seed)
    ids = range(3, 250)
    reqs = []
    for _ in range(num):
        num_prompt = rng.randint(int(PROMPT_RANGE[0] * scale), int(PROMPT_RANGE[1] * scale))
        num_output = rng.randint(int(OUTPUT_RANGE[0] * scale), int(OUTPUT_RANGE[1] * scale))
        num_prompt = min(num_prompt, max_model_len - 1)
        num_output = min(num_output, max_model_len - num_prompt)
        reqs.append((rng.choices(ids, k=num_prompt), num_output))
    return reqs


def make_engine(max_active: int, model: str = MODEL, device: str = "cuda", **kw):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    if device == "cuda":
        kw.setdefault("kv_cache_memory_gb", KV_CACHE_GB)
    return LLMEngine(EngineConfig(model=model, device=device, max_active=max_active, **kw))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drive(engine, reqs, tag: str) -> dict:
    """Submit every request at once, step until all finish; wall time, tokens, steps."""
    from tandem.engine.sampling_params import SamplingParams

    _sync()
    t0 = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))
    generated = steps = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    _sync()
    wall = time.perf_counter() - t0
    expected = sum(m for _, m in reqs)
    return {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs), "generated": generated,
            "expected": expected, "wall_s": round(wall, 3), "steps": steps, "tok_s": round(generated / wall, 1),
            "preemptions": engine.scheduler.num_preemptions}


def warm_up(engine, seed: int) -> None:
    """Compile every kernel variant a W run meets (prefill tiles, split counts) outside the timing."""
    reqs = workload(24, 1.0, seed, engine.max_model_len)
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
PHASES = (  # (owner path on the engine, method): wrapped when the engine has it
    ("scheduler", "schedule"), ("scheduler", "advance"), ("scheduler", "update_from_output"),
    ("", "_launch"), ("", "_finish"), ("output_processor", "process_outputs"),
    ("model_runner", "prepare_inputs"), ("model_runner", "launch"), ("model_runner", "execute"),
    ("model_runner", "_execute_eager"), ("model_runner", "_execute_decode_graph"),
    ("model_runner", "_execute_mixed_graph"),
)
STEP_PATHS = {"_execute_eager": "eager", "_execute_mixed_graph": "mixed graph", "_execute_decode_graph": "decode graph"}


class _Timers:
    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.path = "no launch"

    def wrap(self, owner, name: str):
        fn = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.step[name] += time.perf_counter() - t0
                if name in STEP_PATHS:
                    timers.path = STEP_PATHS[name]

        setattr(owner, name, timed)


def phase_breakdown(engine, reqs, tag: str) -> dict:
    """One run with the engine's phases timed (ms per step, by step kind)."""
    from tandem.engine.sampling_params import SamplingParams

    timers = _Timers()
    for owner_path, name in PHASES:
        owner = getattr(engine, owner_path) if owner_path else engine
        if hasattr(owner, name):
            timers.wrap(owner, name)
    sampler = engine.model_runner.sampler

    class TimedSampler:  # `self.sampler(...)` looks __call__ up on the type, so wrap the object
        def __getattr__(self, item):
            return getattr(sampler, item)

        def __call__(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return sampler(*args, **kwargs)
            finally:
                timers.step["sampler (incl. GPU wait)"] += time.perf_counter() - t0

    engine.model_runner.sampler = TimedSampler()
    handle_cls = None
    try:
        from tandem.engine.model_runner import StepHandle as handle_cls
    except ImportError:
        pass
    if handle_cls is not None:
        tokens = handle_cls.tokens

        def timed_tokens(self):
            t0 = time.perf_counter()
            try:
                return tokens(self)
            finally:
                timers.step["wait for sampled ids"] += time.perf_counter() - t0

        handle_cls.tokens = timed_tokens
    kinds: dict[str, dict] = {}
    _sync()
    t0 = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))
    while engine.has_unfinished_requests():
        timers.step.clear()
        timers.path = "no launch"
        s0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - s0
        st = engine.get_stats()
        # by what this call launched; tokens are those of the step it finished (the same one
        # when scheduling is synchronous, the previous one when it is asynchronous)
        k = kinds.setdefault(timers.path, {"steps": 0, "wall_s": 0.0, "tokens": 0, "phases_s": defaultdict(float)})
        k["steps"] += 1
        k["wall_s"] += dt
        k["tokens"] += st.step_prefill_tokens + st.step_decode_tokens
        for name, v in timers.step.items():
            k["phases_s"][name] += v
    _sync()
    wall = time.perf_counter() - t0
    engine.model_runner.sampler = sampler
    if handle_cls is not None:
        handle_cls.tokens = tokens
    for owner_path, name in PHASES:  # drop the wrappers (instance attributes) again
        owner = getattr(engine, owner_path) if owner_path else engine
        owner.__dict__.pop(name, None)
    out = {"wall_s": round(wall, 3), "kinds": {}}
    for kind, k in kinds.items():
        n = k["steps"]
        out["kinds"][kind] = {"steps": n, "ms_per_step": round(1e3 * k["wall_s"] / n, 3),
                              "tokens_per_step": round(k["tokens"] / n, 1), "share_of_wall": round(k["wall_s"] / wall, 3),
                              "phase_ms_per_step": {p: round(1e3 * v / n, 3) for p, v in k["phases_s"].items()}}
    return out


# -- the rows -------------------------------------------------------------------------------
def run_row(name: str, engine, seed: int, profile: bool, num_requests: int = NUM_REQUESTS,
            plain: bool = False) -> dict:
    """One row. Profiled rows take tok/s and busy share from the one profiled run (CUDA
    activity only: the profiler added no measurable wall time to W); `plain` adds an
    unprofiled run of the same requests, whose tok/s is then reported."""
    max_active, scale = ROWS[name]
    engine.set_max_active(max_active)
    reqs = workload(num_requests, scale, seed, engine.max_model_len)
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


def ablation_row(engine, seed: int, num_requests: int) -> dict:
    """W on the same engine with asynchronous scheduling off and prefill/mixed steps eager:
    the previous path's loop, kept as the same-run baseline (decode steps still replay graphs)."""
    runner = engine.model_runner
    saved = engine.async_scheduling, runner.mixed_graph_runner
    engine.async_scheduling, runner.mixed_graph_runner = False, None
    try:
        row = run_row("W", engine, seed, profile=False, num_requests=num_requests)
    finally:
        engine.async_scheduling, runner.mixed_graph_runner = saved
    row["variant"] = "sync scheduling, eager prefill/mixed steps"
    return row


def regression_rows(engine_kw: dict) -> dict:
    """What holds today: decode step at batch 4 (engine step, host included) and 48 x (516 -> 128)
    at max_active 64, median of three runs (bench.fast_path's own functions)."""
    import torch

    from bench.fast_path import _median_run, engine_decode, engine_throughput
    from bench.fast_path import make_engine as fp_engine

    out = {}
    engine = fp_engine(MODEL, "cuda", 64, max_num_batched_tokens=2048, **engine_kw)
    out["decode_b4"] = engine_decode(engine, 4, 30, seed=14, device="cuda")
    del engine
    torch.cuda.empty_cache()
    engine = fp_engine(MODEL, "cuda", 64, **engine_kw)
    runs = [engine_throughput(engine, 48, 128, seed=s) for s in (7, 107, 207)]
    out["tput_48x516x128_ma64"] = _median_run(runs)
    del engine
    torch.cuda.empty_cache()
    print(f"[regression] decode B=4 {out['decode_b4']['step_ms']:.3f} ms; 48x(516->128) "
          f"{out['tput_48x516x128_ma64']['tok_s']:,.0f} tok/s {[round(r) for r in out['tput_48x516x128_ma64']['runs_tok_s']]}",
          flush=True)
    return out


def render(report: dict) -> str:
    lines = ["| row | max_active | lengths | requests | output tokens | wall s | steps | output tok/s | GPU busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        busy = f"{100 * r['gpu_busy']:.0f}%" if r.get("gpu_busy") is not None else "—"
        lines.append(f"| {r['row']}{' (' + r['variant'] + ')' if r.get('variant') else ''} | {r['max_active']} | x{r['scale']} | "
                     f"{r['requests']} | {r['generated']:,} | {r['wall_s']:.2f} | {r['steps']} | **{r['tok_s']:,.0f}** | {busy} |")
    reg = report.get("regression")
    if reg:
        lines += ["", f"decode step at batch 4 (engine step, host included): {reg['decode_b4']['step_ms']:.3f} ms "
                      f"(graph replay {reg['decode_b4'].get('graph_replay_ms', 0):.3f} ms)",
                  f"48 x (516 -> 128), max_active 64: {reg['tput_48x516x128_ma64']['tok_s']:,.0f} tok/s "
                  f"(runs {[round(x) for x in reg['tput_48x516x128_ma64']['runs_tok_s']]})"]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--out", default="out/throughput")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled run (no GPU busy share)")
    ap.add_argument("--profile-rows", nargs="*", default=None, help="rows that get the profiled run (default: all)")
    ap.add_argument("--plain-rows", nargs="*", default=[], help="profiled rows that also get an unprofiled run")
    ap.add_argument("--ablation", action="store_true",
                    help="W again with synchronous scheduling and eager prefill/mixed steps (the previous path)")
    ap.add_argument("--phases", action="store_true", help="also time the engine's host phases on W")
    ap.add_argument("--regression", action="store_true", help="also the decode B=4 and 48 x (516 -> 128) rows")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--device", default="cuda", help="cpu runs the logic on a tiny model (smoke test)")
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--variant", default="", help="a label for this engine configuration")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="EngineConfig override (ints and floats parsed), e.g. max_num_batched_tokens=16384")
    args = ap.parse_args(argv)
    from bench._machine import machine_info, run_stamp

    engine_kw = {}
    for kv in args.engine:
        key, value = kv.split("=", 1)
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        engine_kw[key] = {"True": True, "False": False}.get(value, value) if isinstance(value, str) else value
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(None, args.device), **run_stamp(), "model": args.model, "engine": engine_kw,
              "kv_cache_gb": KV_CACHE_GB, "rows": []}
    if args.regression:  # first: small engines, and the rows that must hold whatever else runs out of time
        report["regression"] = regression_rows(engine_kw)
        Path(args.out, "throughput.json").write_text(json.dumps(report, indent=1))
    t0 = time.perf_counter()
    engine = make_engine(max(ROWS[r][0] for r in args.rows), args.model, args.device, **engine_kw)
    report["engine_build_s"] = round(time.perf_counter() - t0, 1)
    warm_up(engine, seed=99)
    profile_rows = args.rows if args.profile_rows is None else args.profile_rows
    for name in args.rows:
        row = run_row(name, engine, args.seed, not args.no_profile and name in profile_rows, args.num_requests,
                      plain=name in args.plain_rows)
        row["variant"] = args.variant
        if args.phases and name == "W":
            reqs = workload(args.num_requests, 1.0, args.seed + 1, engine.max_model_len)
            row["phases"] = phase_breakdown(engine, reqs, "phases")
        report["rows"].append(row)
        if args.ablation and name == "W":  # right after W: the same-run baseline comes before the variants
            report["rows"].append(ablation_row(engine, args.seed, args.num_requests))
        Path(args.out, "throughput.json").write_text(json.dumps(report, indent=1))
    del engine
    Path(args.out, "throughput.json").write_text(json.dumps(report, indent=1))
    table = render(report)
    Path(args.out, "throughput.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
