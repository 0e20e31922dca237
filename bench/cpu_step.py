"""Where a CPU decode step goes: the whole engine step split into its parts, on any thread count.

`python -m bench.fast_path --sections cpu_b4` says how our CPU decode step compares with HF
eager; this says why. At batch B (all decoding, 516-token contexts) it times, each as the
median of many repetitions:

  step       `LLMEngine.step()`, what a served request waits on
  forward    the model's forward plus the logits of the sampled rows (no scheduler or sampler)
  linears    every linear of the forward alone (with its residual add or SwiGLU), in layer order
  logits     the output projection alone (Qwen2.5-0.5B's is 27% of the weight bytes)
  attention  the attention backend alone, 24 layers of cache write + SDPA
  copy       reading a buffer as large as the weights once: the memory floor of a decode step

and lists the top ops of the forward by self time (torch.profiler). `forward - linears -
attention` is what the remaining ops cost (norms, RoPE, SiLU, adds, casts) including the Python
that issues them.

    python -m bench.cpu_step --threads 14 --dtype bfloat16 --out out/cpu_step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.fast_path import MODEL, PROMPT_LEN, _add, make_engine, make_unfused_cpu_engine, random_prompts
from engine.model.llama import linear_add, silu_and_mul


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def decoding_engine(args):
    """An engine with `args.batch` requests past their prefill, and the inputs of its next decode step."""
    if args.no_fuse and not args.no_pack:
        engine = make_unfused_cpu_engine(args.model, args.batch, args.dtype, args.threads)
    else:
        engine = make_engine(args.model, "cpu", args.batch, args.dtype, args.threads, pack_cpu_weights=not args.no_pack)
    _add(engine, random_prompts(args.batch, PROMPT_LEN, 5), engine.max_model_len - PROMPT_LEN, "anat")
    first = 0
    while first < args.batch:
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    for _ in range(2):
        engine.step()
    return engine


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

    def all_linears():  # with their epilogues (residual adds, SwiGLU), fused or not, as the forward runs them
        with torch.inference_mode():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                attn.qkv_proj(x)
                linear_add(attn.o_proj, attn_out, x)
                silu_and_mul(mlp.gate_up_proj, x)
                linear_add(mlp.down_proj, act, x)

    def logits():
        with torch.inference_mode():
            model.compute_logits(x)

    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = (torch.randn(rows, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    attn = layer.self_attn.attn
    # Fresh metadata object per call: the backend re-plans the step once, as a real forward does.
    def attention():
        with torch.inference_mode():
            step_meta = type(meta)(**vars(meta)) if hasattr(meta, "__dict__") else meta
            for kv_cache in kv_caches:
                attn.forward(q, k, v, kv_cache, step_meta, dim**-0.5)

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype == dtype)
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
    }


def op_profile(forward, steps: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            forward()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3), "calls": e.count // steps}
            for e in rows]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--threads", type=int, default=14)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear weights instead of oneDNN-packed")
    parser.add_argument("--no-fuse", action="store_true", help="packed weights without the fused epilogues")
    parser.add_argument("--out", default="out/cpu_step")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    engine = decoding_engine(args)
    report = {"model": args.model, "threads": args.threads, "dtype": args.dtype, "batch": args.batch,
              "packed_linears": engine.model_runner.num_packed_linears, **part_timings(engine, args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"cpu_step_{args.dtype}_t{args.threads}_b{args.batch}{'_plain' if args.no_pack else '_nofuse' if args.no_fuse else ''}.json"
    (out / name).write_text(json.dumps(report, indent=1))
    r = report
    rest = r["forward_ms"] - r["linears_ms"] - r["logits_ms"] - r["attention_ms"]
    print(f"{args.dtype} {args.threads} threads B={args.batch} packed={r['packed_linears']} fused={not args.no_fuse}: "
          f"step {r['step_ms']:.2f} ms = forward {r['forward_ms']:.2f} + engine {r['step_ms'] - r['forward_ms']:.2f}; "
          f"forward = linears {r['linears_ms']:.2f} + logits {r['logits_ms']:.2f} + attention {r['attention_ms']:.2f} "
          f"+ other ops {rest:.2f}; weight read floor {r['read_floor_ms']:.2f} ms")
    for row in r["op_profile"][:12]:
        print(f"   {row['op']:<48} {row['self_ms']:8.3f} ms  x{row['calls']}")


if __name__ == "__main__":
    main()
