"""`tandem bench fast-path`: the accelerator fast path against HF transformers and the memory floor.

Model: the Qwen2.5-0.5B shape with random weights (speed does not depend on weight values), bf16
on the GPU; distinct random prompts, so no run hits the prefix cache. Sections, each in its own
process under a time limit (a hung baseline cannot take the run with it):

  floor     weight bytes / measured device-to-device copy bandwidth: a decode step reads every
            weight once, and at batch B also B contexts of K/V
  gpu       decode ms/step with B requests of 516-token contexts all decoding (the median
            `LLMEngine.step()`, host included, and one CUDA-graph replay's GPU time); prefill of
            one 516-token prompt; 48 x (516 -> 128) submitted at once at max_active 4 and 64
            (2,048- and 8,192-token steps; the latter the median of 3 runs)
  hf_gpu    HF eager: one `model(...)` decode step with a DynamicCache, prefill, and `generate`
            on one static batch of the 48
  hf_batch  transformers' continuous batching (`generate_batch`) on the 48
  cpu_b4    the CPU at batch 4: our decode step and HF eager's in alternating rounds (drift on a
            shared machine hits both), medians

Writes fast_path.json and fast_path.md (the table and the targets) under --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from bench._machine import stamp
from bench.harness import abort_all, burst, make_engine, median_run, start_decoding
from bench.hf import hf_decode_ms, hf_decoder, hf_generate, hf_model, hf_prefill_ms
from bench.workload import random_prompts

MODEL = "qwen2.5-0.5b-random"
PROMPT_LEN = 516
SECTIONS = ("floor", "gpu", "hf_gpu", "cpu_b4", "hf_batch")
DEFAULT_TIMEOUTS = {"floor": 60, "gpu": 150, "hf_gpu": 120, "cpu_b4": 240, "hf_batch": 120}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=os.environ.get("OUT") or "out/fast_path", help="folder for the JSON and table")
    parser.add_argument("--model", default=MODEL, help="a random-weight preset (default %(default)s)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--decode-steps", type=int, default=50)
    parser.add_argument("--hf-decode-steps", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cpu-threads", type=int, default=14)
    parser.add_argument("--cpu-decode-steps", type=int, default=12)
    parser.add_argument("--cpu-rounds", type=int, default=6, help="cpu_b4: alternating rounds of --cpu-decode-steps")
    parser.add_argument("--timeout", action="append", default=[], metavar="SECTION=SECONDS",
                        help=f"per-section time limit (defaults {DEFAULT_TIMEOUTS})")


def run(args: argparse.Namespace) -> int:
    args.timeouts = dict(DEFAULT_TIMEOUTS, **{k: float(v) for k, _, v in (t.partition("=") for t in args.timeout)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {**stamp(args.cpu_threads), "model": args.model, "sections": {}}
    for name in args.sections:
        report["sections"][name] = run_section(name, args)
        (out / "fast_path.json").write_text(json.dumps(report, indent=1))
    report["targets"] = targets(report["sections"])
    (out / "fast_path.json").write_text(json.dumps(report, indent=1))
    table = render_table(report)
    (out / "fast_path.md").write_text(table)
    print(table)
    return 0


def run_section(name: str, args: argparse.Namespace) -> dict:
    """One section in a child process under its time limit; a failure is recorded, not raised."""
    part = Path(args.out) / f".part_{name}.json"
    part.unlink(missing_ok=True)
    child = multiprocessing.get_context("spawn").Process(target=_section, args=(name, args, part))
    t0 = time.perf_counter()
    child.start()
    child.join(args.timeouts[name])
    if child.is_alive():
        child.kill()
        child.join()
        status = f"timed out after {args.timeouts[name]} s"
    else:
        status = "ok" if child.exitcode == 0 and part.is_file() else f"exit {child.exitcode}"
    result = json.loads(part.read_text()) if part.is_file() else {}
    part.unlink(missing_ok=True)
    print(f"[{name}] {status} in {time.perf_counter() - t0:.0f} s", flush=True)
    return dict(result, status=status)


def _section(name: str, args: argparse.Namespace, part: Path) -> None:
    sections = {"floor": section_floor, "gpu": section_gpu, "hf_gpu": section_hf_gpu, "cpu_b4": section_cpu_b4,
                "hf_batch": section_hf_batch}
    part.write_text(json.dumps(sections[name](args), indent=1))


# -- Tandem's engine ------------------------------------------------------------------------
def engine_decode(engine, batch: int, steps: int, seed: int) -> dict:
    """Median engine step (and CUDA-graph replay) with `batch` requests all decoding."""
    ids = start_decoding(engine, random_prompts(batch, PROMPT_LEN, seed), min(1024, engine.max_model_len - PROMPT_LEN),
                         f"dec{batch}", settle=3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out = {"batch": batch, "context": PROMPT_LEN, "step_ms": 1e3 * statistics.median(times)}
    if engine.model_runner.graph_runner is not None:
        out["graph_replay_ms"] = replay_ms(engine.model_runner.graph_runner, batch)
    abort_all(engine, ids)
    return out


def replay_ms(graphs, batch: int, reps: int = 50) -> float:
    """GPU time of one replay of the bucket holding `batch` rows (inputs as the last step left them)."""
    import torch

    graph = graphs.graphs[next(b for b in graphs.batch_sizes if b >= batch)]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def engine_prefill(engine, reps: int, seed: int) -> dict:
    """Time from submitting one 516-token prompt to holding its first token (median; one warm-up)."""
    prompts = random_prompts(reps + 1, PROMPT_LEN, seed)
    t = statistics.median([burst(engine, [p], 1, f"pf{seed}-{i}")["wall_s"] for i, p in enumerate(prompts)][1:])
    return {"prompt_tokens": PROMPT_LEN, "ttft_ms": 1e3 * t, "tok_s": PROMPT_LEN / t}


def engine_throughput(engine, num: int, max_tokens: int, seed: int) -> dict:
    """`num` x (516 -> `max_tokens`) submitted at once, after a two-request warm-up."""
    burst(engine, random_prompts(2, PROMPT_LEN, seed + 1), 4, f"warm{seed}")
    run = burst(engine, random_prompts(num, PROMPT_LEN, seed), max_tokens, f"tp{seed}")
    return {"requests": num, "prompt_tokens": PROMPT_LEN, "max_tokens": max_tokens,
            "max_active": engine.config.max_active,
            "max_num_batched_tokens": engine.config.resolved_max_num_batched_tokens,
            **{k: run[k] for k in ("generated", "wall_s", "steps", "tok_s")}}


def section_gpu(args) -> dict:
    import torch

    out = {"dtype": "bfloat16"}
    engine = make_engine(args.model, "cuda", max(args.decode_batches), max_num_batched_tokens=2048)
    out["decode"] = [engine_decode(engine, b, args.decode_steps, seed=10 + b) for b in args.decode_batches]
    out["prefill"] = engine_prefill(engine, 5, seed=3)
    out["throughput"] = [engine_throughput(engine, args.num_requests, args.max_tokens, seed=7)]
    del engine
    torch.cuda.empty_cache()
    # The default on cuda, an 8,192-token step budget; three runs on distinct prompts, the median counts.
    engine = make_engine(args.model, "cuda", 64)
    out["throughput"].append(median_run([engine_throughput(engine, args.num_requests, args.max_tokens, seed=seed)
                                         for seed in (7, 107, 207)]))
    del engine
    torch.cuda.empty_cache()
    engine = make_engine(args.model, "cuda", 4)
    out["throughput"].insert(0, engine_throughput(engine, args.num_requests, args.max_tokens, seed=7))
    return out


def section_hf_gpu(args) -> dict:
    import torch

    model = hf_model(args.model, "cuda", torch.bfloat16, shape_only=True)
    prefill_ms = hf_prefill_ms(model, random_prompts(4, PROMPT_LEN, 3))
    hf_generate(model, random_prompts(2, PROMPT_LEN, 8), 4)  # warm-up
    static = hf_generate(model, random_prompts(args.num_requests, PROMPT_LEN, 7), args.max_tokens)
    return {"dtype": "bfloat16", "attn_implementation": "sdpa",
            "decode": [{"batch": b, "context": PROMPT_LEN, "step_ms": hf_decode_ms(
                model, random_prompts(b, PROMPT_LEN, 10 + b), args.hf_decode_steps)} for b in args.decode_batches],
            "prefill": {"prompt_tokens": PROMPT_LEN, "ttft_ms": prefill_ms, "tok_s": 1e3 * PROMPT_LEN / prefill_ms},
            "static_batch": {"requests": args.num_requests, "max_tokens": args.max_tokens,
                             **{k: static[k] for k in ("generated", "wall_s", "tok_s")}}}


def section_hf_batch(args) -> dict:
    """transformers' continuous batching (`generate_batch`) on the same workload."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    attn = "paged|sdpa"
    try:
        model = hf_model(args.model, "cuda", torch.bfloat16, attn, shape_only=True)
    except (ValueError, KeyError) as exc:  # an older or newer spelling of the paged SDPA kernel
        print(f"attn_implementation={attn!r} refused ({exc}); using 'sdpa'", flush=True)
        attn = "sdpa"
        model = hf_model(args.model, "cuda", torch.bfloat16, attn, shape_only=True)
    kwargs = {"continuous_batching_config": ContinuousBatchingConfig(max_requests_per_batch=64), "progress_bar": False}
    prompts = random_prompts(args.num_requests, PROMPT_LEN, seed=7)

    def config(max_tokens: int):
        return GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    # No inference_mode here: generate_batch's worker thread updates its own static tensors in place.
    model.generate_batch(inputs=random_prompts(2, PROMPT_LEN, 8), generation_config=config(4), **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config(args.max_tokens), **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    generated = sum(len(r.generated_tokens) for r in results.values())
    if not generated:
        raise RuntimeError("generate_batch returned no tokens (see the log for its worker's error)")
    return {"attn_implementation": model.config._attn_implementation, "requested": attn,
            "requests": len(prompts), "max_tokens": args.max_tokens, "generated": generated, "wall_s": wall,
            "tok_s": generated / wall}


def section_cpu_b4(args) -> dict:
    """Ours vs HF eager, B=4 decode on the CPU, alternating rounds; medians and op counts per dtype."""
    import torch

    torch.set_num_threads(args.cpu_threads)
    out = {"threads": args.cpu_threads, "batch": 4, "context": PROMPT_LEN, "rounds": args.cpu_rounds}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(args.model, "cpu", 4, dtype, args.cpu_threads)
        start_decoding(engine, random_prompts(4, PROMPT_LEN, 14), engine.max_model_len - PROMPT_LEN, "b4")
        hf_step = hf_decoder(hf_model(args.model, "cpu", getattr(torch, dtype)), random_prompts(4, PROMPT_LEN, 14))
        for _ in range(2):
            hf_step()
        steppers = {"ours": engine.step, "hf": hf_step}
        times = {name: [] for name in steppers}
        for _ in range(args.cpu_rounds):
            for name, step in steppers.items():
                for _ in range(args.cpu_decode_steps):
                    t0 = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - t0)
        out[dtype] = {name: {"step_ms": 1e3 * statistics.median(times[name])} for name in steppers}
        out[dtype]["hf_over_ours"] = out[dtype]["hf"]["step_ms"] / out[dtype]["ours"]["step_ms"]
        del steppers, engine
    # oneDNN's instruction set is per process, so ours and HF ran under the same one (see
    # engine/model/cpu_linear.py on ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, decode without AMX).
    out["onednn_max_cpu_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return out


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


# -- the report -------------------------------------------------------------------------------
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
    gpu, b4 = s.get("gpu", {}), s.get("cpu_b4", {})
    step4 = _decode_at(gpu.get("decode"), 4)
    tput = {t.get("max_num_batched_tokens"): t["tok_s"] for t in gpu.get("throughput", []) if t["max_active"] == 64}
    ours4 = [x for x in (_get(b4, d, "ours", "step_ms") for d in ("float32", "bfloat16")) if x]
    hf4 = [x for x in (_get(b4, d, "hf", "step_ms") for d in ("float32", "bfloat16")) if x]
    ratio = min(hf4) / min(ours4) if ours4 and hf4 else None
    return {
        "gpu_decode_b4_ms": {"target": 1.5, "measured": step4, "met": step4 is not None and step4 <= 1.5},
        "gpu_tok_s_48x516x128_ma64": {"target": 15000, "measured": tput.get(8192),
                                      "met": (tput.get(8192) or 0) >= 15000},
        "gpu_tok_s_48x516x128_ma64_2k_steps": {"target": 15000, "measured": tput.get(2048),
                                               "met": (tput.get(2048) or 0) >= 15000},
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
    gpu, hf, hfb, floor = (s.get(k, {}) for k in ("gpu", "hf_gpu", "hf_batch", "floor"))
    m = r["machine"]
    lines = [f"Machine: {m.get('gpu') or 'no GPU'}, {m.get('cpu_model')} ({m.get('cpu_count')} cores); torch {m.get('torch')}, "
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
    b4 = s.get("cpu_b4", {})
    if _get(b4, "float32") or _get(b4, "bfloat16"):
        lines += ["", f"| CPU B=4 decode, {b4.get('threads')} threads, alternating rounds, ONEDNN_MAX_CPU_ISA="
                      f"{b4.get('onednn_max_cpu_isa')} | ms/step |", "|---|---|"]
        lines += [f"| {who} {d} | {_fmt(_get(b4, d, key, 'step_ms'), 1)} |"
                  for d in ("float32", "bfloat16") for who, key in (("Tandem", "ours"), ("HF eager", "hf"))]
    lines += ["", "| prefill, one 516-token prompt | tok/s | TTFT ms |", "|---|---|---|"]
    for label, p in (("Tandem GPU bf16", gpu.get("prefill")), ("HF eager GPU bf16", hf.get("prefill"))):
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
    if floor.get("weight_bytes"):
        lines += ["", f"Floor: {floor['weight_bytes'] / 1e9:.3f} GB of bf16 weights at a measured "
                      f"{floor['copy_bandwidth_gb_s']:,.0f} GB/s copy bandwidth = {floor['floor_ms_weights_only']:.3f} ms "
                      f"per decode step, plus {floor['kv_bytes_per_token'] / 1e3:.0f} kB of K/V per context token."]
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for name, t in r.get("targets", {}).items():
        lines.append(f"| {name} ≥/≤ {t['target']} | {_fmt(t['measured'])} | {'yes' if t['met'] else 'no'} |")
    statuses = ", ".join(f"{k}: {v.get('status')}" for k, v in s.items())
    lines += ["", f"Sections: {statuses}", ""]
    return "\n".join(lines)
