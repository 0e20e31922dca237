"""`tandem bench engine-queue`: the engine's host time per step with a long queue, past saturation.

Past saturation a backend holds hundreds of waiting requests while its KV cache evicts on every
step. Whatever the step loop does per waiting request per step (or per progress drain) then
grows with the queue, and on a GPU whose steps take a few milliseconds the loop becomes the
bottleneck: the longer the queue, the slower the engine, and the queue never drains. This times
the loop alone: an in-process engine on the `sim` device with steps of ~0 s, tenants' long shared
prefixes, a KV cache too small for them, `--queued` requests added at once, and a progress drain
every `--steps-per-drain` steps (the engine core drains every 20 ms; a GPU step is a few ms).
It prints host milliseconds per step, per queue length, and writes JSON.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench._machine import stamp
from bench.harness import ints, write_json


def measure(queued: int, args: argparse.Namespace) -> dict:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device="sim", max_active=args.max_active,
                                    num_kv_blocks=args.num_kv_blocks, block_size=16),
                       step_time=lambda num_prefill, num_decode, num_context=0: 1e-6)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(300, 100_000) for _ in range(args.prefix_tokens)] for _ in range(args.tenants)]
    weights = [1 / (i + 1) for i in range(args.tenants)]  # Zipf popularity
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(queued):
        prefix = prefixes[rng.choices(range(args.tenants), weights)[0]]
        engine.add_request(f"r{i}", prefix + [rng.randrange(300, 100_000) for _ in range(64)], params)
    engine.drain_progress()
    steps = finished = 0
    start = time.perf_counter()
    while steps < args.steps and engine.has_unfinished_requests():
        finished += sum(1 for out in engine.step() if out.finished)
        steps += 1
        if steps % args.steps_per_drain == 0:
            engine.drain_progress()
            engine.drain_cache_changes()
    seconds = time.perf_counter() - start
    return {"queued": queued, "steps": steps, "finished": finished, "seconds": round(seconds, 3),
            "host_ms_per_step": round(seconds / steps * 1e3, 3), "waiting_at_end": len(engine.scheduler.waiting)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queued", type=ints, default=[100, 500, 1500], help="requests queued at once (100,500,1500)")
    parser.add_argument("--model", default="qwen2.5-0.5b-random", help="its tokenizer and shape (no weights load)")
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-active", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=4352, help="KV blocks: a quarter of the prefixes (4352)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--steps-per-drain", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/engine_queue.json"))


def run(args: argparse.Namespace) -> int:
    rows = [measure(n, args) for n in args.queued]
    print("| queued | steps | finished | host ms / step | waiting at the end |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['queued']} | {r['steps']} | {r['finished']} | {r['host_ms_per_step']} | {r['waiting_at_end']} |")
    write_json(args.out, {**stamp(), "config": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {args.out}")
    return 0
