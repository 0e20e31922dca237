"""Accelerator fast-path benchmark: Tandem's engine against HF transformers on one machine.

Model: the Qwen2.5-0.5B shape with random weights (`qwen2.5-0.5b-random`; speed does not depend
on weight values), bf16 on the GPU. Prompts are random token ids, distinct per request so no run
hits the prefix cache. Every row is measured in this run, on this machine:

  floor            weight bytes / measured device-to-device copy bandwidth (a decode step must
                   read every weight once; at batch B it must also read B contexts of K/V)
  decode ms/step   B requests with 516-token prompts, all decoding; median wall time of one
                   `LLMEngine.step()` (host work included), and the GPU time of one CUDA-graph
                   replay (events). HF: one `model(...)` forward with a DynamicCache + argmax
  prefill tok/s    one 516-token prompt, time to its first token (engine step / HF forward)
  output tok/s     48 x (516 -> 128 tokens, EOS ignored, greedy) submitted at once; generated
                   tokens / wall time. Tandem at max_active 4 and 64; HF `generate` on one static
                   batch of 48; HF `generate_batch` (transformers' continuous batching)
  cpu              the same engine on the CPU with 14 torch threads, fp32 and bf16, against HF
                   eager on the same threads (fewer sizes: the CPU is ~100x slower)
  cpu_b4           the CPU target's own numbers: B=4 decode steps of our engine and of HF eager
                   in alternating rounds (so drift on a shared machine hits both), medians, and
                   the aten ops one step dispatches (all, and top-level), a noise-free proxy
  profile          kernel time by kind for one eager decode step (torch.profiler), next to the
                   graph replay and engine step times: where a step's time goes

Each section runs in its own subprocess with a time limit (a hung baseline cannot take the run
with it) and writes its JSON part; the parent prints one table and writes `fast_path.json` and
`fast_path.md` under --out. `python -m bench.fast_path --help` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = "qwen2.5-0.5b-random"
PROMPT_LEN = 516
SECTIONS = ("floor", "gpu", "hf_gpu", "cpu", "cpu_b4", "hf_batch")
DEFAULT_TIMEOUTS = {"floor": 60, "gpu": 150, "hf_gpu": 120, "cpu": 150, "cpu_b4": 240, "hf_batch": 120}


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(num)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- Tandem's engine ------------------------------------------------------------------------
def make_engine(model: str, device: str, max_active: int, dtype: str = "auto", threads: int | None = None, **kw):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_active=max_active,
                                  num_threads=threads, **kw))


def _add(engine, prompts, max_tokens: int, tag: str) -> list[str]:
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    return ids


def engine_decode(engine, batch: int, steps: int, seed: int, device: str) -> dict:
    """Median engine step (and CUDA-graph replay) with `batch` requests all decoding."""
    max_tokens = min(1024, engine.max_model_len - PROMPT_LEN)
    ids = _add(engine, random_prompts(batch, PROMPT_LEN, seed), max_tokens, f"dec{batch}")
    first = 0
    while first < batch:  # prefill every request
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out = {"batch": batch, "context": PROMPT_LEN, "step_ms": 1e3 * statistics.median(times)}
    graphs = engine.model_runner.graph_runner
    if graphs is not None:
        out["graph_replay_ms"] = replay_ms(graphs, batch)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return out


def replay_ms(graphs, batch: int, reps: int = 50) -> float:
    """GPU time of one replay of the bucket holding `batch` rows (inputs as the last step left them)."""
    import torch

    bucket = next(b for b in graphs.batch_sizes if b >= batch)
    graph = graphs.graphs[bucket]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def engine_prefill(engine, reps: int, seed: int, device: str) -> dict:
    """Time from submitting one 516-token prompt to holding its first token."""
    times = []
    for i, prompt in enumerate(random_prompts(reps + 1, PROMPT_LEN, seed)):
        _sync(device)
        t0 = time.perf_counter()
        _add(engine, [prompt], 1, f"pf{seed}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"prompt_tokens": PROMPT_LEN, "ttft_ms": 1e3 * t, "tok_s": PROMPT_LEN / t}


def engine_throughput(engine, num: int, max_tokens: int, seed: int) -> dict:
    _add(engine, random_prompts(2, PROMPT_LEN, seed + 1), 4, f"warm{seed}")
    while engine.has_unfinished_requests():
        engine.step()
    prompts = random_prompts(num, PROMPT_LEN, seed)
    t0 = time.perf_counter()
    _add(engine, prompts, max_tokens, f"tp{seed}")
    generated, steps = 0, 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    return {"requests": num, "prompt_tokens": PROMPT_LEN, "max_tokens": max_tokens, "max_active": engine.config.max_active,
            "max_num_batched_tokens": engine.config.resolved_max_num_batched_tokens,
            "generated": generated, "wall_s": wall, "steps": steps, "tok_s": generated / wall}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s, carrying every run's figure."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    return dict(ordered[len(ordered) // 2], runs_tok_s=[r["tok_s"] for r in runs])


def profile_decode(engine, batch: int, seed: int) -> dict:
    """Kernel time by kind for one eager run of the captured decode forward (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = _add(engine, random_prompts(batch, PROMPT_LEN, seed), 64, f"prof{batch}")
    first = 0
    while first < batch:
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    engine.step()  # leaves this batch's real inputs in the graph buffers
    graphs = engine.model_runner.graph_runner
    bucket = next(b for b in graphs.batch_sizes if b >= batch)
    reps = 5
    with torch.inference_mode():
        graphs._forward(bucket)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graphs._forward(bucket)
            torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    counts: dict[str, int] = {}
    top: list[tuple[float, str, int]] = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if not us or evt.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            continue
        kind = _kernel_kind(evt.key)
        if kind is None:
            continue
        kinds[kind] = kinds.get(kind, 0.0) + us / reps
        counts[kind] = counts.get(kind, 0) + evt.count // reps
        top.append((us / reps, evt.key[:90], evt.count // reps))
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    total = sum(kinds.values())
    return {"batch": batch, "bucket": bucket, "kernel_us_total": total, "replay_ms": replay_ms(graphs, batch),
            "by_kind_us": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "kernels_per_step": counts,
            "top_kernels_us": [{"us": round(t, 1), "calls": c, "name": n} for t, n, c in sorted(top, reverse=True)[:12]]}


def host_profile(engine, batch: int, seed: int, steps: int = 20) -> dict:
    """cProfile of engine steps with `batch` requests decoding: where the host half of a step goes."""
    import cProfile
    import pstats

    ids = _add(engine, random_prompts(batch, PROMPT_LEN, seed), 200, f"host{batch}")
    first = 0
    while first < batch:
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    for _ in range(3):
        engine.step()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    wall = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(profiler).stats
    by_func = {f"{Path(f).name}:{line}({name})": (ct / steps * 1e3, tt / steps * 1e3)
               for (f, line, name), (_, _, tt, ct, _) in stats.items()}
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    top_cum = sorted(by_func.items(), key=lambda kv: -kv[1][0])[:25]
    return {"batch": batch, "step_ms_under_cprofile": 1e3 * wall,
            "top_cumulative_ms": [{"fn": k, "cum_ms": round(c, 3), "self_ms": round(t, 3)} for k, (c, t) in top_cum]}


def eager_prefill_split(engine, seed: int) -> dict:
    """One 516-token prefill forward, eager: host time to enqueue it vs GPU time (events)."""
    import torch

    runner = engine.model_runner
    _add(engine, random_prompts(1, PROMPT_LEN, seed), 1, f"eager{seed}")
    sched = engine.scheduler.schedule()
    ids, pos, meta = runner.prepare_inputs(sched, engine.kv_cache_manager)
    out = {}
    with torch.inference_mode():
        for _ in range(3):
            runner.model(ids, pos, runner.kv_caches, meta)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        runner.model(ids, pos, runner.kv_caches, meta)
        end.record()
        out["host_enqueue_ms"] = 1e3 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
        out["gpu_ms"] = start.elapsed_time(end)
        from tandem.engine.model.fused_layers import rms_norm  # one small Triton launch, host cost only

        x = torch.randn(4, 896, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(896, device="cuda", dtype=torch.bfloat16)
        rms_norm(x, w, 1e-6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            rms_norm(x, w, 1e-6)
        out["triton_launch_us"] = 1e6 * (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            torch.add(x, x)
        out["torch_op_launch_us"] = 1e6 * (time.perf_counter() - t0) / 200
    engine.scheduler.update_from_output(sched, {})  # no token sampled: finish the request by abort
    for s in sched.scheduled:
        engine.abort_request(s.request.req_id)
    engine.step()
    return out


def _kernel_kind(name: str) -> str | None:
    lowered = name.lower()
    if lowered.startswith(("aten::", "cuda", "memcpy", "memset")):
        return None  # CPU-side op records and API calls, not kernels
    for kind, keys in (("attention", ("_paged_attention", "_paged_decode", "_merge_splits")), ("kv_write", ("_write_kv",)),
                       ("rms_norm", ("_rms_norm",)), ("rotary", ("_rotary",)), ("silu_mul", ("_silu",)),
                       ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90", "xmma", "cublas", "splitk")),
                       ("gather/embedding", ("index", "embedding", "gather"))):
        if any(k in lowered for k in keys):
            return kind
    return "other elementwise"


def section_gpu(args) -> dict:
    import torch

    device = "cuda"
    out = {"dtype": "bfloat16"}
    # Decode and prefill timings, then throughput with the old 2,048-token step budget.
    engine = make_engine(args.model, device, max(args.decode_batches), max_num_batched_tokens=2048)
    out["decode"] = [engine_decode(engine, b, args.decode_steps, seed=10 + b, device=device)
                     for b in args.decode_batches]
    out["prefill"] = engine_prefill(engine, 5, seed=3, device=device)
    out["throughput"] = [engine_throughput(engine, args.num_requests, args.max_tokens, seed=7)]
    del engine
    torch.cuda.empty_cache()
    # The default on cuda, an 8,192-token step budget: 4 prefill steps instead of 13, each one GPU-bound.
    # The target row: three runs on distinct prompts (no prefix hits between them); the median counts.
    engine = make_engine(args.model, device, 64)
    runs = [engine_throughput(engine, args.num_requests, args.max_tokens, seed=seed) for seed in (7, 107, 207)]
    out["throughput"].append(_median_run(runs))
    del engine
    torch.cuda.empty_cache()
    engine = make_engine(args.model, device, 4)
    out["throughput"].insert(0, engine_throughput(engine, args.num_requests, args.max_tokens, seed=7))
    del engine
    torch.cuda.empty_cache()
    # Diagnostics last, each on its own: a failure here must not cost the measurements above.
    engine = make_engine(args.model, device, max(args.decode_batches))
    out["profile"] = [_diagnostic(profile_decode, engine, b, seed=50 + b)
                      for b in (4, 64) if b <= engine.config.max_active]
    out["host_profile"] = _diagnostic(host_profile, engine, min(48, engine.config.max_active), seed=90)
    out["eager_prefill"] = _diagnostic(eager_prefill_split, engine, seed=91)
    return out


def _diagnostic(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # a diagnostic's failure is reported in the JSON, never fatal
        import traceback

        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- HF transformers baselines -------------------------------------------------------------
def hf_model(name: str, device: str, dtype, attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.model.presets import build_hf_model, get_preset

    if device == "cpu":
        return build_hf_model(name).to(dtype).eval()  # our random weights, float32 first
    with torch.device(device):  # initialise on the GPU: seconds instead of a minute on the CPU
        model = AutoModelForCausalLM.from_config(get_preset(name).hf_config(), dtype=dtype, attn_implementation=attn)
    return model.eval()


def hf_decode(model, batch: int, steps: int, device: str, seed: int) -> dict:
    import torch

    ids = torch.tensor(random_prompts(batch, PROMPT_LEN, seed), device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for i in range(steps + 2):
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.tolist()  # the host reads the tokens every step, as generate's stopping check does
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return {"batch": batch, "context": PROMPT_LEN, "step_ms": 1e3 * statistics.median(times)}


def hf_prefill(model, reps: int, device: str, seed: int) -> dict:
    import torch

    times = []
    with torch.inference_mode():
        for i, prompt in enumerate(random_prompts(reps + 1, PROMPT_LEN, seed)):
            ids = torch.tensor([prompt], device=device)
            _sync(device)
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
            if i:
                times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"prompt_tokens": PROMPT_LEN, "ttft_ms": 1e3 * t, "tok_s": PROMPT_LEN / t}


def hf_static_batch(model, num: int, max_tokens: int, device: str, seed: int) -> dict:
    import torch

    ids = torch.tensor(random_prompts(num, PROMPT_LEN, seed), device=device)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        _sync(device)
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - PROMPT_LEN) * num
    return {"requests": num, "max_tokens": max_tokens, "generated": generated, "wall_s": wall, "tok_s": generated / wall}


def section_hf_gpu(args) -> dict:
    import torch

    model = hf_model(args.model, "cuda", torch.bfloat16)
    return {
        "dtype": "bfloat16", "attn_implementation": "sdpa",
        "decode": [hf_decode(model, b, args.hf_decode_steps, "cuda", seed=10 + b) for b in args.decode_batches],
        "prefill": hf_prefill(model, 3, "cuda", seed=3),
        "static_batch": hf_static_batch(model, args.num_requests, args.max_tokens, "cuda", seed=7),
    }


def section_hf_batch(args) -> dict:
    """transformers' continuous batching (`generate_batch`) on the same workload."""
    import torch
    from transformers import GenerationConfig

    attn = "paged|sdpa"
    try:
        model = hf_model(args.model, "cuda", torch.bfloat16, attn)
    except (ValueError, KeyError) as exc:  # an older or newer spelling of the paged SDPA kernel
        print(f"attn_implementation={attn!r} refused ({exc}); using 'sdpa'", flush=True)
        attn = "sdpa"
        model = hf_model(args.model, "cuda", torch.bfloat16, attn)
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs = {}
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:  # older transformers: generate_batch's defaults
        ContinuousBatchingConfig = None
    if ContinuousBatchingConfig is not None:
        try:
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_requests_per_batch=64)
        except TypeError:
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig()
    prompts = random_prompts(args.num_requests, PROMPT_LEN, seed=7)
    # No inference_mode here: generate_batch's worker thread updates its own static tensors in place.
    model.generate_batch(inputs=random_prompts(2, PROMPT_LEN, 8), generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0), progress_bar=False, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False, **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    generated = sum(len(r.generated_tokens) for r in results.values())
    if not generated:
        raise RuntimeError("generate_batch returned no tokens (see the log for its worker's error)")
    return {"attn_implementation": model.config._attn_implementation, "requested": attn,
            "requests": len(prompts), "max_tokens": args.max_tokens, "generated": generated, "wall_s": wall,
            "tok_s": generated / wall}


def section_cpu(args) -> dict:
    import torch

    torch.set_num_threads(args.cpu_threads)
    out = {"threads": args.cpu_threads, "ours": {}, "hf": {}}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(args.model, "cpu", 4, dtype, args.cpu_threads)
        out["ours"][dtype] = {
            "decode": [engine_decode(engine, b, args.cpu_decode_steps, seed=10 + b, device="cpu") for b in (1, 4)],
            "prefill": engine_prefill(engine, 2, seed=3, device="cpu"),
        }
        del engine
    best = min(out["ours"], key=lambda d: out["ours"][d]["decode"][-1]["step_ms"])
    engine = make_engine(args.model, "cpu", 4, best, args.cpu_threads)
    out["ours"]["throughput"] = dict(engine_throughput(engine, args.cpu_requests, args.cpu_max_tokens, seed=7),
                                     dtype=best)
    del engine
    out["ours"]["op_profile_b4"] = _diagnostic(cpu_op_profile, lambda: make_engine(args.model, "cpu", 4, best,
                                                                                  args.cpu_threads))
    for dtype in (torch.float32, torch.bfloat16):
        model = hf_model(args.model, "cpu", dtype)
        out["hf"][str(dtype).removeprefix("torch.")] = {
            "decode": [hf_decode(model, b, args.cpu_decode_steps, "cpu", seed=10 + b) for b in (1, 4)],
            "prefill": hf_prefill(model, 2, "cpu", seed=3),
        }
        del model
    return out


def section_cpu_b4(args) -> dict:
    """Ours vs HF eager, B=4 decode on the CPU, alternating rounds; medians and op counts per dtype."""
    import torch

    torch.set_num_threads(args.cpu_threads)
    out = {"threads": args.cpu_threads, "batch": 4, "context": PROMPT_LEN, "rounds": args.cpu_rounds}
    for dtype in ("float32", "bfloat16"):
        steppers = {"ours": _engine_decoder(make_engine(args.model, "cpu", 4, dtype, args.cpu_threads), 4),
                    "hf": _hf_decoder(hf_model(args.model, "cpu", getattr(torch, dtype)), 4)}
        times = {name: [] for name in steppers}
        for _ in range(args.cpu_rounds):
            for name, step in steppers.items():
                for _ in range(args.cpu_decode_steps):
                    t0 = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - t0)
        out[dtype] = {name: dict(step_ms=1e3 * statistics.median(times[name]), **count_aten_ops(step))
                      for name, step in steppers.items()}
        out[dtype]["hf_over_ours"] = out[dtype]["hf"]["step_ms"] / out[dtype]["ours"]["step_ms"]
        del steppers
    # oneDNN's instruction set is per process, so ours and HF ran under the same one (see
    # engine/model/cpu_linear.py on ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, decode without AMX).
    out["onednn_max_cpu_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return out


def _engine_decoder(engine, batch: int):
    """`batch` requests past their prefill; returns a function that runs one decode step."""
    _add(engine, random_prompts(batch, PROMPT_LEN, 14), engine.max_model_len - PROMPT_LEN, "b4")
    first = 0
    while first < batch:
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    for _ in range(2):
        engine.step()
    return engine.step


def _hf_decoder(model, batch: int):
    """HF eager with a DynamicCache after a `batch`-row prefill; one call = one decode step + argmax."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor(random_prompts(batch, PROMPT_LEN, 14)), use_cache=True, logits_to_keep=1)
    state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step() -> None:
        with torch.inference_mode():
            out = model(input_ids=state["next"], past_key_values=state["past"], use_cache=True)
            state["past"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            state["next"].tolist()

    for _ in range(2):
        step()
    return step


def count_aten_ops(step, steps: int = 2) -> dict:
    """aten ops one `step()` dispatches: every record, and those not nested in another aten op."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    every, top = 0, Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        every += 1
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            top[event.name.removeprefix("aten::")] += 1
    return {"aten_ops": every / steps, "top_level_ops": sum(top.values()) / steps,
            "top_level_by_op": {k: v / steps for k, v in top.most_common(20)}}


def cpu_op_profile(make, batch: int = 4, steps: int = 3) -> dict:
    """Top torch ops by self CPU time over a few decode steps (where a CPU step goes)."""
    from torch.profiler import ProfilerActivity, profile

    engine = make()
    _add(engine, random_prompts(batch, PROMPT_LEN, 77), 64, "cpuprof")
    first = 0
    while first < batch:
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    engine.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t0) / steps
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {"dtype": str(engine.dtype), "step_ms_under_profiler": 1e3 * wall,
            "top_self_ms": [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3),
                             "calls": e.count // steps} for e in rows]}


def section_floor(args) -> dict:
    import torch

    from tandem.engine.model.loader import load_model

    model = load_model(args.model, "cuda", torch.bfloat16).model
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    cfg = model.config
    del model
    n = 1 << 29  # 1 GiB of bf16: far past the 60 MB L2
    src, dst = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    bandwidth = 2 * n * 2 / seconds  # bytes read + written
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    floors = {str(b): 1e3 * (weight_bytes + b * (PROMPT_LEN + 64) * kv_per_token) / bandwidth
              for b in args.decode_batches}
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "floor_ms_weights_only": 1e3 * weight_bytes / bandwidth, "floor_ms_with_kv": floors,
            "kv_bytes_per_token": kv_per_token}


# -- orchestration ----------------------------------------------------------------------------
def run_section(name: str, args) -> dict:
    """Run one section in a child process under its time limit; a failure is recorded, not raised."""
    part = _part_path(args, name)
    part.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.fast_path", "--section", name, *sys.argv[1:]]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=args.timeouts[name], env=dict(os.environ, PYTHONUNBUFFERED="1"))
        status = "ok" if proc.returncode == 0 and part.is_file() else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {args.timeouts[name]} s"
    result = json.loads(part.read_text()) if part.is_file() else {}
    part.unlink(missing_ok=True)  # merged into fast_path.json; keeps $OUT to a few files
    print(f"[{name}] {status} in {time.perf_counter() - t0:.0f} s", flush=True)
    return dict(result, status=status)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.section:
        fn = {"floor": section_floor, "gpu": section_gpu, "hf_gpu": section_hf_gpu, "cpu": section_cpu,
              "cpu_b4": section_cpu_b4, "hf_batch": section_hf_batch}[args.section]
        _part_path(args, args.section).write_text(json.dumps(fn(args), indent=1))
        return
    from bench._machine import machine_info, run_stamp

    report = {"machine": machine_info(args.cpu_threads, "cuda" if _has_cuda() else "cpu"), **run_stamp(),
              "model": args.model, "sections": {}}
    for name in args.sections:
        report["sections"][name] = run_section(name, args)
        Path(args.out, "fast_path.json").write_text(json.dumps(report, indent=1))
    report["targets"] = targets(report["sections"])
    Path(args.out, "fast_path.json").write_text(json.dumps(report, indent=1))
    table = render_table(report)
    Path(args.out, "fast_path.md").write_text(table)
    print(table)


def _part_path(args, name: str) -> Path:
    return Path(args.out) / f".part_{name}.json"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _get(d: dict, *path, default=None):
    for key in path:
        if isinstance(d, dict) and key in d:
            d = d[key]
        elif isinstance(d, list) and isinstance(key, int) and -len(d) <= key < len(d):
            d = d[key]
        else:
            return default
    return d


def _decode_at(rows, batch: int, key: str = "step_ms"):
    return next((r.get(key) for r in rows or [] if r.get("batch") == batch), None)


def targets(s: dict) -> dict:
    gpu, cpu = s.get("gpu", {}), s.get("cpu", {})
    step4 = _decode_at(gpu.get("decode"), 4)
    tput64 = next((t["tok_s"] for t in gpu.get("throughput", []) if t["max_active"] == 64
                   and t.get("max_num_batched_tokens") == 2048), None)
    tput64_8k = next((t["tok_s"] for t in gpu.get("throughput", []) if t["max_active"] == 64
                      and t.get("max_num_batched_tokens") == 8192), None)
    b4 = s.get("cpu_b4", {})
    if all(_get(b4, d, who, "step_ms") for d in ("float32", "bfloat16") for who in ("ours", "hf")):
        ours4 = [b4[d]["ours"]["step_ms"] for d in ("float32", "bfloat16")]  # the interleaved runs
        hf4 = [b4[d]["hf"]["step_ms"] for d in ("float32", "bfloat16")]
    else:
        ours4 = [_decode_at(_get(cpu, "ours", d, "decode"), 4) for d in ("float32", "bfloat16")]
        hf4 = [_decode_at(_get(cpu, "hf", d, "decode"), 4) for d in ("float32", "bfloat16")]
    ours4, hf4 = [x for x in ours4 if x], [x for x in hf4 if x]
    ratio = min(hf4) / min(ours4) if ours4 and hf4 else None
    return {
        "gpu_decode_b4_ms": {"target": 1.5, "measured": step4, "met": step4 is not None and step4 <= 1.5},
        "gpu_tok_s_48x516x128_ma64": {"target": 15000, "measured": tput64_8k,
                                      "met": tput64_8k is not None and tput64_8k >= 15000},
        "gpu_tok_s_48x516x128_ma64_2k_steps": {"target": 15000, "measured": tput64,
                                               "met": tput64 is not None and tput64 >= 15000},
        "cpu_decode_b4_speedup_vs_hf_best": {"target": 1.3, "measured": ratio, "met": ratio is not None and ratio >= 1.3},
    }


def _fmt(x, digits=2) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def render_table(r: dict) -> str:
    s = r["sections"]
    gpu, hf, hfb, cpu, floor = (s.get(k, {}) for k in ("gpu", "hf_gpu", "hf_batch", "cpu", "floor"))
    m = r["machine"]
    lines = [f"Machine: {m.get('gpu', 'no GPU')}, {m.get('cpu_model')} ({m.get('cpu_count')} cores); torch {m.get('torch')}, "
             f"transformers {m.get('transformers')}; model {r['model']} (random weights)",
             f"Command: `{r['command']}`; date {r['date']}; git {m.get('git_revision')}", ""]
    lines += ["| decode ms/step (context 516) | B=1 | B=4 | B=16 | B=64 |", "|---|---|---|---|---|"]
    batches = (1, 4, 16, 64)
    rows = [("Tandem GPU bf16, engine step (host included)", gpu.get("decode"), "step_ms"),
            ("Tandem GPU bf16, CUDA-graph replay (GPU only)", gpu.get("decode"), "graph_replay_ms"),
            ("HF eager GPU bf16 (sdpa)", hf.get("decode"), "step_ms")]
    for label, data, key in rows:
        lines.append(f"| {label} | " + " | ".join(_fmt(_decode_at(data, b, key), 3) for b in batches) + " |")
    fl = floor.get("floor_ms_with_kv", {})
    lines.append("| floor: (weights + KV) / copy bandwidth | " + " | ".join(_fmt(fl.get(str(b)), 3) for b in batches) + " |")
    for d in ("float32", "bfloat16"):
        for who, key in (("Tandem", "ours"), ("HF eager", "hf")):
            dec = _get(cpu, key, d, "decode")
            lines.append(f"| {who} CPU {cpu.get('threads', '?')} threads {d} | " + _fmt(_decode_at(dec, 1), 1)
                         + " | " + _fmt(_decode_at(dec, 4), 1) + " | — | — |")
    b4 = s.get("cpu_b4", {})
    if _get(b4, "float32") or _get(b4, "bfloat16"):
        lines += ["", f"| CPU B=4 decode, {b4.get('threads')} threads, alternating rounds, ONEDNN_MAX_CPU_ISA="
                      f"{b4.get('onednn_max_cpu_isa')} | ms/step | aten ops/step "
                      "(top-level) |", "|---|---|---|"]
        for d in ("float32", "bfloat16"):
            for who, key in (("Tandem", "ours"), ("HF eager", "hf")):
                row = _get(b4, d, key, default={})
                lines.append(f"| {who} {d} | {_fmt(row.get('step_ms'), 1)} | {_fmt(row.get('aten_ops'), 0)} "
                             f"({_fmt(row.get('top_level_ops'), 0)}) |")
    lines += ["", "| prefill, one 516-token prompt | tok/s | TTFT ms |", "|---|---|---|"]
    for label, p in (("Tandem GPU bf16", gpu.get("prefill")), ("HF eager GPU bf16", hf.get("prefill")),
                     *((f"Tandem CPU {d}", _get(cpu, "ours", d, "prefill")) for d in ("float32", "bfloat16")),
                     *((f"HF eager CPU {d}", _get(cpu, "hf", d, "prefill")) for d in ("float32", "bfloat16"))):
        lines.append(f"| {label} | {_fmt(_get(p, 'tok_s'), 0)} | {_fmt(_get(p, 'ttft_ms'), 1)} |")
    lines += ["", "| output tok/s, N x (516 -> M) submitted at once | N x M | wall s | output tok/s |", "|---|---|---|---|"]
    for t in gpu.get("throughput", []):
        runs = (f" (median of {len(t['runs_tok_s'])}: " + ", ".join(_fmt(x, 0) for x in t["runs_tok_s"]) + ")"
                if t.get("runs_tok_s") else "")
        lines.append(f"| Tandem GPU bf16, max_active {t['max_active']}, {t['max_num_batched_tokens']}-token steps{runs} | "
                     f"{t['requests']} x {t['max_tokens']} | "
                     f"{_fmt(t['wall_s'], 3)} | {_fmt(t['tok_s'], 0)} |")
    sb = hf.get("static_batch")
    if sb:
        lines.append(f"| HF eager `generate`, one static batch | {sb['requests']} x {sb['max_tokens']} | "
                     f"{_fmt(sb['wall_s'], 2)} | {_fmt(sb['tok_s'], 0)} |")
    if hfb.get("tok_s"):
        lines.append(f"| HF `generate_batch` ({hfb.get('attn_implementation')}) | {hfb['requests']} x {hfb['max_tokens']} | "
                     f"{_fmt(hfb['wall_s'], 2)} | {_fmt(hfb['tok_s'], 0)} |")
    ct = _get(cpu, "ours", "throughput")
    if ct:
        lines.append(f"| Tandem CPU {cpu.get('threads')} threads {ct['dtype']}, max_active 4 | {ct['requests']} x "
                     f"{ct['max_tokens']} | {_fmt(ct['wall_s'], 2)} | {_fmt(ct['tok_s'], 1)} |")
    if floor:
        lines += ["", f"Floor: {floor['weight_bytes'] / 1e9:.3f} GB of bf16 weights at a measured "
                      f"{floor['copy_bandwidth_gb_s']:,.0f} GB/s copy bandwidth = {floor['floor_ms_weights_only']:.3f} ms "
                      f"per decode step, plus {floor['kv_bytes_per_token'] / 1e3:.0f} kB of K/V per context token."]
    for p in gpu.get("profile", []):
        if "error" in p:
            continue
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in p["by_kind_us"].items())
        lines.append(f"Profile B={p['batch']} (eager, µs/step): kernels {p['kernel_us_total']:.0f} µs = {kinds}; "
                     f"graph replay {p['replay_ms'] * 1e3:.0f} µs.")
        lines.append("  top kernels: " + "; ".join(f"{k['name'][:60]} ×{k['calls']} {k['us']:.0f} µs"
                                                 for k in p.get("top_kernels_us", [])[:6]))
    hp = gpu.get("host_profile")
    if hp and "error" not in hp:
        picks = [f"{t['fn']} {t['cum_ms']:.2f}" for t in hp["top_cumulative_ms"][:12]]
        lines.append(f"Host, B={hp['batch']} decode step under cProfile {hp['step_ms_under_cprofile']:.2f} ms; "
                     f"cumulative ms/step: " + ", ".join(picks))
    ep = gpu.get("eager_prefill")
    if ep and "error" not in ep:
        lines.append(f"Eager 516-token prefill forward: host enqueue {ep['host_enqueue_ms']:.2f} ms, GPU {ep['gpu_ms']:.2f} ms; "
                     f"one Triton launch {ep['triton_launch_us']:.1f} µs, one torch op {ep['torch_op_launch_us']:.1f} µs (host).")
    cp = _get(cpu, "ours", "op_profile_b4")
    if cp and "error" not in cp:
        lines.append(f"CPU B=4 {cp['dtype']} step {cp['step_ms_under_profiler']:.1f} ms under the profiler; top self ms: "
                     + ", ".join(f"{o['op']} {o['self_ms']:.1f} (×{o['calls']})" for o in cp["top_self_ms"][:8]))
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for name, t in r.get("targets", {}).items():
        lines.append(f"| {name} ≥/≤ {t['target']} | {_fmt(t['measured'])} | {'yes' if t['met'] else 'no'} |")
    statuses = ", ".join(f"{k}: {v.get('status')}" for k, v in s.items())
    lines += ["", f"Sections: {statuses}", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fast_path", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "out/fast_path", help="folder for JSON, table and parts")
    parser.add_argument("--model", default=MODEL, help="a random-weight preset (the GPU machine has no real weights)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # a child process's one section
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--decode-steps", type=int, default=50)
    parser.add_argument("--hf-decode-steps", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cpu-threads", type=int, default=14)
    parser.add_argument("--cpu-decode-steps", type=int, default=12)
    parser.add_argument("--cpu-rounds", type=int, default=6, help="cpu_b4: alternating rounds of --cpu-decode-steps")
    parser.add_argument("--cpu-requests", type=int, default=8)
    parser.add_argument("--cpu-max-tokens", type=int, default=32)
    parser.add_argument("--timeout", action="append", default=[], metavar="SECTION=SECONDS",
                        help=f"per-section time limit (defaults {DEFAULT_TIMEOUTS})")
    args = parser.parse_args(argv)
    args.timeouts = dict(DEFAULT_TIMEOUTS)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        args.timeouts[name] = float(seconds)
    return args


if __name__ == "__main__":
    main()
