"""`tandem bench quant-accuracy`: what int8 / int4 weights cost in accuracy, perplexity and top-1
agreement against float32.

This repository's README (its first `--tokens` tokens) goes through the engine's own model,
quantized exactly as `LLMEngine` builds it, teacher-forced: the text's perplexity and how often
the top-1 token equals the first mode's. ggml's kernels (`-ggml` modes) compute a few rows as
decode does but 16 and more through a float32 GEMM, so `--chunk 8` feeds the text 8 tokens at a
time over the cached context: what decode's arithmetic costs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench._machine import stamp
from bench.harness import make_engine, write_json

REPO = Path(__file__).resolve().parent.parent


def text_logits(engine, ids: list[int], chunk: int | None = None):
    """float32 logits [T, vocab] of `ids` through the engine's model: one prompt, or `chunk`
    tokens at a time over the growing cached context."""
    import torch

    from tandem.engine.attention.metadata import AttentionMetadata

    runner = engine.model_runner
    num_tokens, block_size = len(ids), runner.block_size
    tables = torch.arange(-(-num_tokens // block_size), dtype=torch.int32)[None]
    step = chunk or num_tokens
    logits = []
    with torch.inference_mode():
        for start in range(0, num_tokens, step):
            end = min(start + step, num_tokens)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32), slot_mapping=torch.arange(start, end),
                block_tables=tables, query_lens_cpu=[end - start], seq_lens_cpu=[end], block_size=block_size)
            hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), runner.kv_caches, meta)
            logits.append(runner.model.compute_logits(hidden).float())
    return torch.cat(logits)


def measure(model: str, modes: list[str], num_tokens: int, threads: int, chunk: int | None = None) -> dict:
    import torch

    text = (REPO / "README.md").read_text()
    results, reference = {}, None
    for mode in modes:
        dtype, _, kernels = mode.partition("-")
        engine = make_engine(model, dtype=dtype, threads=threads, cpu_kernels=kernels or "torch")
        ids = engine.tokenizer.encode(text)[:num_tokens]
        logits = text_logits(engine, ids, chunk)
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        top1 = logits[:-1].argmax(-1)
        if reference is None:
            reference = top1
        results[mode] = {"perplexity": math.exp(nll), "top1_agreement_vs_first": (top1 == reference).float().mean().item(),
                         "tokens": len(ids)}
        print(mode, results[mode], flush=True)
        del engine
    return {"model": model, "text": "README.md", "reference": modes[0], "chunk": chunk, "modes": results}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", nargs="*", default=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, help="feed the text this many tokens at a time (default: one prompt)")
    p.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    result = measure(args.model, args.modes, args.tokens, args.threads, args.chunk)
    if args.out:
        write_json(Path(args.out), {**stamp(args.threads, "cpu"), **result})
    return 0
