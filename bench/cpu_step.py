"""`tandem bench cpu-step`: where a CPU decode step goes, the engine step split into its parts.

`tandem bench fast-path --sections cpu_b4` says how our CPU decode step compares with HF eager;
this says why. At batch B (all decoding, 516-token contexts) it times, each as the
median of many repetitions:

  step       `LLMEngine.step()`, what a served request waits on
  forward    the model's forward plus the logits of the sampled rows (no scheduler or sampler)
  linears    every linear of the forward alone, on inputs of the right shapes, in layer order
  logits     the output projection alone (Qwen2.5-0.5B's is 27% of the weight bytes)
  attention  the attention backend alone, 24 layers of cache write + SDPA
  copy       copying a buffer as large as the weights a step reads; half of it is the read floor
  linears by kind   qkv, o_proj, gate_up, down over all layers (weights from memory, not cache),
             at a few thread counts: microseconds per call and the weight bandwidth reached

plus the time to first token of one 516-token prompt, and the forward's top ops by self time
(torch.profiler). `forward - linears - logits - attention` is what the remaining ops cost
(norms, RoPE, SiLU, adds, casts), with the Python that issues them. oneDNN's instruction set
is the process's: run once as is and once with ONEDNN_MAX_CPU_ISA=ALL to compare with AMX.
`--requests N` measures instead the output tok/s of N 516-token prompts submitted at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from bench._machine import stamp
from bench.fast_path import MODEL, PROMPT_LEN, engine_prefill, engine_throughput
from bench.harness import make_engine, median_ms, start_decoding
from bench.workload import random_prompts


def capture_forward(engine):
    """Run one step while recording the model's forward arguments, so the forward can be re-run alone."""
    model = engine.model_runner.model
    seen = {}
    original = model.forward

    def recording(*a, **kw):
        seen["args"], seen["kwargs"] = a, kw
        return original(*a, **kw)

    model.forward = recording
    try:
        engine.step()
    finally:
        model.forward = original
    return seen["args"], seen["kwargs"]


def part_timings(engine, args) -> dict:
    import torch

    model = engine.model_runner.model
    cfg = model.config
    fwd_args, fwd_kwargs = capture_forward(engine)
    input_ids, positions, kv_caches, meta = fwd_args[:4]
    rows = input_ids.shape[0]
    dtype = engine.dtype
    x = torch.randn(rows, cfg.hidden_size).to(dtype)

    def forward():
        with torch.inference_mode():
            hidden = model(*fwd_args, **fwd_kwargs)
            model.compute_logits(hidden[-rows:])

    layer = model.model.layers[0]
    attn_out = torch.randn(rows, layer.self_attn.q_size).to(dtype)
    act = torch.randn(rows, layer.mlp.down_proj.in_features).to(dtype)

    def all_linears():
        with torch.inference_mode():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                attn.qkv_proj(x)
                attn.o_proj(attn_out)
                mlp.gate_up_proj(x)
                mlp.down_proj(act)

    def logits():
        with torch.inference_mode():
            model.compute_logits(x)

    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = (torch.randn(rows, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    attn = layer.self_attn.attn

    def attention():  # a fresh metadata object per call: the backend plans the step once, as a forward does
        with torch.inference_mode():
            step_meta = dataclasses.replace(meta)
            for kv_cache in kv_caches:
                attn.forward(q, k, v, kv_cache, step_meta, dim**-0.5)

    weight_bytes = bytes_read_per_step(model)
    src = torch.empty(weight_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 10)
    reps = args.reps
    return {
        "step_ms": median_ms(engine.step, reps),
        "forward_ms": median_ms(forward, reps),
        "linears_ms": median_ms(all_linears, reps),
        "logits_ms": median_ms(logits, reps),
        "attention_ms": median_ms(attention, reps),
        "weight_bytes": weight_bytes,
        "copy_ms_read_plus_write": copy_ms,
        "read_floor_ms": copy_ms / 2,
        "op_profile": op_profile(forward),
        "linears_by_kind": linears_by_kind(model, x, attn_out, act, sorted({args.threads, 8, 4}, reverse=True)),
    }


def bytes_read_per_step(model) -> int:
    """Weight bytes a decode step reads: every parameter and packed weight, but of the embedding
    matrix only its few looked-up rows (counted as none) when the output projection has its own copy."""
    import torch

    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if "rotary" not in name)]
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    if model.logits_proj is not None:
        embedding = model.model.embed_tokens.weight
        total -= embedding.numel() * embedding.element_size()
    return total


def linears_by_kind(model, x, attn_out, act, thread_counts: list[int], reps: int = 10) -> list[dict]:
    """Each kind of linear over all 24 layers (so its weights come from memory, not cache), at a few
    thread counts: time per call and the weight bandwidth it reaches."""
    import torch

    layers = model.model.layers
    kinds = {
        "qkv_proj": ([l.self_attn.qkv_proj for l in layers], lambda m: m(x)),
        "o_proj": ([l.self_attn.o_proj for l in layers], lambda m: m(attn_out)),
        "gate_up_proj": ([l.mlp.gate_up_proj for l in layers], lambda m: m(x)),
        "down_proj": ([l.mlp.down_proj for l in layers], lambda m: m(act)),
        "logits": ([model], lambda m: m.compute_logits(x)),
    }
    flush = torch.empty(64 << 20, dtype=torch.float32).uniform_()  # 256 MB: more than any L3 here
    threads_before = torch.get_num_threads()
    out = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for name, (modules, call) in kinds.items():
                nbytes = _logits_bytes(model) if name == "logits" else sum(map(_module_bytes, modules))
                times = []
                with torch.inference_mode():
                    for _ in range(reps + 2):
                        flush.add_(1.0)
                        t0 = time.perf_counter()
                        for m in modules:
                            call(m)
                        times.append(time.perf_counter() - t0)
                seconds = statistics.median(times[2:])
                out.append({"kind": name, "threads": threads, "calls": len(modules),
                            "us_per_call": 1e6 * seconds / len(modules), "total_ms": 1e3 * seconds,
                            "weight_mb": nbytes / 1e6, "gb_s": nbytes / seconds / 1e9})
    finally:
        torch.set_num_threads(threads_before)
    return out


def _module_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _logits_bytes(model) -> int:
    weight = model.output_weight()
    return weight.numel() * weight.element_size()


def op_profile(forward, steps: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            forward()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3), "calls": e.count // steps}
            for e in rows]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--threads", type=int, default=14)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear weights instead of oneDNN-packed")
    parser.add_argument("--pack-hint", type=int, help="rows to pack weights for (engine default: 4)")
    parser.add_argument("--requests", type=int, help="instead of the breakdown: output tok/s of this many "
                        "516-token prompts submitted at once, at max_active --batch")
    parser.add_argument("--max-tokens", type=int, default=128, help="with --requests: tokens each one generates")
    parser.add_argument("--tag", default="", help="suffix for the JSON file name")
    parser.add_argument("--out", default="out/cpu_step")


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine.model import cpu_linear

    torch.set_num_threads(args.threads)
    if args.pack_hint is not None:  # the row count oneDNN lays packed weights out for
        cpu_linear.BATCH_HINT = args.pack_hint
    # PyTorch's kernels throughout: the breakdown splits the eager forward into its parts (the
    # default runs decode steps as one ggml graph, which `tandem bench cpu-vs-llamacpp` measures).
    engine = make_engine(args.model, "cpu", args.batch, args.dtype, args.threads, pack_cpu_weights=not args.no_pack,
                         cpu_kernels="torch")
    prefill = engine_prefill(engine, 3, seed=3)  # alone, before the batch starts decoding
    report = {**stamp(args.threads, "cpu"), "model": args.model, "threads": args.threads, "dtype": args.dtype, "batch": args.batch,
              "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
              "packed_linears": engine.model_runner.num_packed_linears, "prefill": prefill}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"cpu_step_{args.dtype}_t{args.threads}_b{args.batch}{'_plain' if args.no_pack else ''}{args.tag}"
    threads = f"{args.threads} thread{'' if args.threads == 1 else 's'}"
    if args.requests:
        report["throughput"] = engine_throughput(engine, args.requests, args.max_tokens, seed=7)
        (out / f"{name}_throughput.json").write_text(json.dumps(report, indent=1))
        t = report["throughput"]
        print(f"{args.tag} {args.dtype} {threads}, {t['requests']} x ({PROMPT_LEN} -> {t['max_tokens']}) at "
              f"max_active {args.batch}: {t['wall_s']:.2f} s, {t['tok_s']:.1f} output tok/s; prefill of one prompt "
              f"{prefill['ttft_ms']:.0f} ms (ONEDNN_MAX_CPU_ISA={report['onednn_max_cpu_isa']})")
        return 0
    start_decoding(engine, random_prompts(args.batch, PROMPT_LEN, 5), engine.max_model_len - PROMPT_LEN, "anat")
    report.update(part_timings(engine, args))
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    r = report
    rest = r["forward_ms"] - r["linears_ms"] - r["logits_ms"] - r["attention_ms"]
    print(f"{args.tag} {args.dtype} {threads} B={args.batch} packed={r['packed_linears']}: "
          f"step {r['step_ms']:.2f} ms = forward {r['forward_ms']:.2f} + engine {r['step_ms'] - r['forward_ms']:.2f}; "
          f"forward = linears {r['linears_ms']:.2f} + logits {r['logits_ms']:.2f} + attention {r['attention_ms']:.2f} "
          f"+ other ops {rest:.2f}; weight read floor {r['read_floor_ms']:.2f} ms; "
          f"prefill of {PROMPT_LEN} tokens {r['prefill']['ttft_ms']:.0f} ms (ONEDNN_MAX_CPU_ISA={r['onednn_max_cpu_isa']})")
    for row in r["op_profile"][:12]:
        print(f"   {row['op']:<48} {row['self_ms']:8.3f} ms  x{row['calls']}")
    for row in r["linears_by_kind"]:
        unit = "thread" if row["threads"] == 1 else "threads"
        print(f"   {row['kind']:<22} {row['threads']:>2} {unit}: {row['us_per_call']:8.1f} us/call x{row['calls']}"
              f" = {row['total_ms']:6.2f} ms, {row['weight_mb']:7.1f} MB at {row['gb_s']:5.1f} GB/s")
    return 0
