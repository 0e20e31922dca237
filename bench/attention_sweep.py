"""Attention launch settings on workload W's shapes (H200): which tiles, warps, stages and split
counts keep the Triton kernels near the memory floor at 256 requests with 2-3k-token contexts.

Three cases, qwen2.5-0.5b's attention shape (14 query heads, 2 KV heads, head dim 64, bf16,
16-token blocks scattered over the cache): a decode step of 256 requests with contexts uniform
in [600, 3000] (split-context kernel), a mixed step (those 256 decodes plus one fresh
1,500-token prompt, work-list kernel), and a prefill step of four fresh 2,048-token prompts
(work-list kernel). Each setting is timed with `triton.testing.do_bench` (median, ms per
layer call) and set against the floor: every K/V byte of every context read once at the
copy bandwidth measured here.

    PYTHONPATH=. python3 -m bench.attention_sweep --out $OUT/attn
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

H, HKV, D, BS = 14, 2, 64, 16


def _case(reqs: list[tuple[int, int]], seed: int = 0):
    """(q, kv_cache, meta) for requests given as (cached tokens, new tokens), blocks shuffled."""
    import torch

    from tandem.engine.attention.metadata import AttentionMetadata
    from tandem.engine.attention.triton_paged import prefill_block_q
    from tandem.engine.cuda_graphs import build_work_list

    rng = random.Random(seed)
    seq_lens = [c + n for c, n in reqs]
    num_blocks = sum(-(-s // BS) for s in seq_lens) + 1
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for s in seq_lens:
        k = -(-s // BS)
        tables.append(ids[at : at + k])
        at += k
    width = max(len(t) for t in tables)
    starts, slots = [0], []
    for (c, n), t in zip(reqs, tables):
        starts.append(starts[-1] + n)
        slots += [t[p // BS] * BS + p % BS for p in range(c, c + n)]
    dev = "cuda"
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        query_lens_cpu=[n for _, n in reqs], seq_lens_cpu=seq_lens, block_size=BS)
    work = build_work_list(meta.query_lens_cpu, prefill_block_q(H // HKV))
    meta.work_list = torch.tensor(work, dtype=torch.int32, device=dev).view(-1, 2)
    cache = torch.randn(2, num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(starts[-1], H, D, device=dev, dtype=torch.bfloat16)
    kv_bytes = sum(seq_lens) * HKV * D * 2 * 2
    return q, cache, meta, kv_bytes


def copy_bandwidth() -> float:
    import torch
    import triton

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=100, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/attention_sweep")
    args = ap.parse_args(argv)
    import torch
    import triton

    from tandem.engine.attention import triton_paged as tp

    bw = copy_bandwidth()
    rng = random.Random(1)
    decodes = [(rng.randint(600, 3000) - 1, 1) for _ in range(256)]
    cases = {"decode 256": decodes, "mixed 256 + 1500": decodes + [(0, 1500)],
             "prefill 4 x 2048": [(0, 2048)] * 4}
    results = {"copy_gb_s": round(bw / 1e9), "cases": {}}
    defaults = (dict(tp.DECODE_TUNING), dict(tp.PREFILL_TUNING))
    for name, reqs in cases.items():
        q, cache, meta, kv_bytes = _case(reqs)
        floor_ms = 1e3 * kv_bytes / bw
        rows = []
        if name.startswith("decode"):
            grid = [dict(block_n=bn, num_warps=w, num_stages=st, target_programs=tpg)
                    for bn, w, st, tpg in itertools.product((64, 128), (4, 8), (3,), (1024, 4096))]

            def call():
                splits = tp.num_decode_splits(meta.num_reqs, HKV)
                return tp.paged_decode(q, cache, meta, 0.125, splits)
            table = tp.DECODE_TUNING
        else:
            grid = [dict(block_n=bn, num_warps=w, num_stages=st)
                    for bn, w, st in itertools.product((32, 64, 128), (4, 8), (3,))]

            def call():
                return tp.paged_attention_work_list(q, cache, meta, 0.125)
            table = tp.PREFILL_TUNING
        for setting in grid:
            table.update(setting)
            try:
                ms = triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median")
            except Exception as exc:  # an unfit setting (shared memory) is skipped, not fatal
                rows.append({**setting, "error": f"{type(exc).__name__}"})
                continue
            rows.append({**setting, "ms": round(ms, 4), "of_floor": round(floor_ms / ms, 3)})
        tp.DECODE_TUNING.clear(), tp.DECODE_TUNING.update(defaults[0])
        tp.PREFILL_TUNING.clear(), tp.PREFILL_TUNING.update(defaults[1])
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        default = next((r for r in ok if all(r.get(k) == v for k, v in
                                               (defaults[0] if name.startswith("decode") else defaults[1]).items()
                                               if k in r)), None)
        results["cases"][name] = {"floor_ms": round(floor_ms, 4), "default": default, "best": ok[:5], "all": rows}
        print(f"{name}: floor {floor_ms:.3f} ms/layer; default {default and default['ms']} ms; "
              f"best {ok[0]}", flush=True)
        del q, cache, meta
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "attention_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
