"""`tandem profile`: measure each backend alone and write the rates file the router loads.

Backends are profiled in this process, one after another, each with the machine to itself (no
Ray, no server), which is what "isolated profile" means in the design. The output maps backend id
to routing's RateProfile fields and is what `tandem serve --rates FILE` reads; the same numbers
go into the profile cache that `tandem serve` consults on start-up.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from tandem.cluster.config import ConfigError
from tandem.cluster.serve_cli import add_cluster_arguments, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--output", default="tandem-rates.json", help="rates file to write (default tandem-rates.json)")
    parser.add_argument("--prompt-len", type=int, default=512, help="uncached prompt tokens for prefill (default 512)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens per decode run (default 16)")


def run(args: argparse.Namespace) -> int:
    from tandem.cluster.plan import plan_backends
    from tandem.cluster.profile import profile_key, store_in_cache, write_rates_file
    from tandem.engine.profiler import measure_rates

    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    num_gpus, mps = _local_accelerators()
    rates, num_cuda = {}, 0
    for plan in plan_backends(config, num_gpus, mps):
        engine = _load_engine(config, plan, cuda_index=num_cuda)
        num_cuda += plan.device == "cuda"
        key = profile_key(engine.model_name, engine.device.type, str(engine.dtype).removeprefix("torch."), plan.threads)
        start = time.perf_counter()
        found = measure_rates(engine, plan.max_active, prompt_len=args.prompt_len, decode_tokens=args.decode_tokens)
        by_batch = ", ".join(f"{b}: {r:.1f}" for b, r in found["decode_tok_s_by_batch"].items())
        print(f"{plan.backend_id:8s} {key}: prefill {found['prefill_tok_s']:.0f} tok/s; decode tok/s by batch "
              f"{{{by_batch}}} ({time.perf_counter() - start:.1f} s)", flush=True)
        store_in_cache(config.rates_cache, key, found)
        rates[plan.backend_id] = found
        del engine
        gc.collect()
    write_rates_file(args.output, rates)
    print(f"wrote {args.output}; use it with: tandem serve --rates {args.output}")
    return 0


def _load_engine(config, plan, cuda_index: int):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    device = f"cuda:{cuda_index}" if plan.device == "cuda" else plan.device
    return LLMEngine(EngineConfig(
        model=config.model, device=device, dtype=plan.dtype, max_active=plan.max_active,
        block_size=config.block_size, num_kv_blocks=plan.num_kv_blocks, max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, num_threads=plan.threads, seed=config.seed))


def _local_accelerators() -> tuple[int, bool]:
    import torch

    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), mps
