"""Cost of one `Sampler.sample` call on the CPU (or a GPU), by batch size and kind of batch.

The sampler runs once per engine step on every sampling row. This times it on random logits of
SmolLM2's vocabulary (49152) for: an all-greedy batch (the argmax fast path), plain sampling
(temperature 0.8, top-p 0.9, a quarter of the rows seeded), and the same with penalties, a
logit bias and 5 top logprobs on every row. Prints a table (median ms per call) and writes
`out/sampler_step.json`. Compare two versions of the sampler by running this on each, on the
same machine, in the same minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

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


def time_call(sampler, logits, rows, repeats: int, sync) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sampler.sample(logits, rows)
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="4,64,256")
    parser.add_argument("--kinds", default="greedy,sample,penalties")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="out/sampler_step.json")
    args = parser.parse_args()

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
            time_call(sampler, logits, rows, 3, sync)  # warm-up
            ms = time_call(sampler, logits, rows, args.repeats, sync)
            results.append({"kind": kind, "batch": batch, "ms": round(ms, 4), "device": args.device})
            print(f"{kind:<10} {batch:>6} {ms:>9.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
