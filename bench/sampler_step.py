"""`tandem bench sampler-step`: the cost of one `Sampler.sample` call on the CPU (or a GPU), by batch
size and kind of batch.

The sampler runs once per engine step on every sampling row. This times it on random logits of
SmolLM2's vocabulary (49152) for: an all-greedy batch (the argmax fast path), plain sampling
(temperature 0.8, top-p 0.9, a quarter of the rows seeded), and the same with penalties, a
logit bias and 5 top logprobs on every row. Prints a table (median ms per call) and writes JSON.
Compare two versions of the sampler by running this on each, on the same machine, in the same
minute.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench._machine import stamp
from bench.harness import median_ms, write_json

VOCAB_SIZE = 49152


def rows_for(kind: str, batch: int, device: str):
    import torch

    from tandem.engine.sampler import SamplingRow
    from tandem.engine.sampling_params import SamplingParams

    rows = []
    for i in range(batch):
        seed = i if i % 4 == 0 else None
        if kind == "greedy":
            params = SamplingParams(temperature=0.0)
        elif kind == "sample":
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
        else:
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, presence_penalty=0.5,
                                    frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={7: 5.0},
                                    logprobs=5)
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        rows.append(make_row(SamplingRow, params, generator, prompt=list(range(100 + i, 164 + i))))
    return rows


def make_row(row_cls, params, generator, prompt):
    try:
        return row_cls(params, generator, prompt_token_ids=prompt)
    except TypeError:  # a sampler without penalties
        return row_cls(params, generator)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="4,64,256")
    parser.add_argument("--kinds", default="greedy,sample,penalties")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/sampler_step.json"))


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine.sampler import Sampler

    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results = []
    print(f"{'kind':<10} {'batch':>6} {'ms/call':>9}")
    for kind in args.kinds.split(","):
        for batch in map(int, args.batches.split(",")):
            try:
                rows = rows_for(kind, batch, args.device)
            except Exception as exc:  # this sampler version lacks the settings
                print(f"{kind:<10} {batch:>6} {'n/a':>9}  ({type(exc).__name__})")
                continue
            logits = torch.randn(batch, VOCAB_SIZE, device=args.device)
            sampler = Sampler()
            ms = median_ms(lambda: (sampler.sample(logits, rows), sync()), args.repeats)
            results.append({"kind": kind, "batch": batch, "ms": round(ms, 4), "device": args.device})
            print(f"{kind:<10} {batch:>6} {ms:>9.3f}")
    write_json(args.out, {**stamp(args.threads, args.device), "rows": results})
    return 0
