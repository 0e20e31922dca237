"""`tandem bench fidelity`: a real engine against its sim, on the same workloads.

The sim device (engine/sim_runner.py) is only worth its results if an engine on it behaves as the
device it emulates. This measures that: it profiles the real engine as `tandem profile
--sim-profiles` does (rates, context cost, engine shape), builds a sim engine of the same model
with that profile and the real engine's KV cache size, and drives both through the same
workloads, in this process, with arrivals in real time:

- `nano`: nano-vllm's benchmark, every request at once: prompt and output lengths uniform in
  [100, 1024] (scaled by `--scale`), EOS ignored;
- `tenants`: tenants with long shared prefixes (Zipf popularity, Poisson arrivals), a cache that
  cannot hold them all (`--tenants-kv-share`), routing's own arrivals (bench/tenants.py);
- `closed`: 516 -> 128 tokens from `--clients` clients, each sending its next request when
  the last one finished.

Per workload and engine: TTFT p50 and p95, output tok/s (output tokens over the span from the
first arrival to the last finish) and the prefix-cache hit rate (cached over prompt tokens);
the table gives the sim's figure over the real one's. Engine-level on purpose: everything above
the engine is the same code for a sim backend and a real one, so the emulation is what differs.

    tandem bench fidelity --out out/fid --model smollm2-135m --device cpu --threads 2 --scale 0.25
    tandem bench fidelity --out out/fid --model qwen2.5-0.5b-random --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOADS = ("nano", "tenants", "closed")


@dataclass
class Req:
    arrival_s: float  # inf: sent by a closed-loop client when its previous request finishes
    prompt: list[int]
    max_tokens: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (fidelity.json, profile.json)")
    parser.add_argument("--model", default="smollm2-135m", help="model preset (default smollm2-135m)")
    parser.add_argument("--device", default="cpu", help="the real engine's device (default cpu)")
    parser.add_argument("--dtype", default="auto", help="the real engine's dtype (default auto)")
    parser.add_argument("--threads", type=int, help="torch threads of a cpu engine")
    parser.add_argument("--max-active", type=int, help="both engines' max_active (default: the device's)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)} (default all)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="scale request counts and lengths (e.g. 0.1 for a CPU; default 1)")
    parser.add_argument("--clients", type=int, default=64, help="closed: concurrent clients (default 64)")
    parser.add_argument("--tenants", type=int, default=64, help="tenants: number of tenants (default 64)")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="tenants: shared prefix tokens (default 4096)")
    parser.add_argument("--rate", type=float, default=40.0, help="tenants: Poisson arrivals per second (default 40)")
    parser.add_argument("--requests-per-tenant", type=int, default=10,
                        help="tenants: requests per tenant on average (default 10)")
    parser.add_argument("--tenants-kv-share", type=float, default=0.5,
                        help="tenants: KV cache sized to this share of all prefixes (default 0.5)")
    parser.add_argument("--profile", help="a sim profile to use instead of profiling the real engine first")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    real_kw = dict(model=args.model, device=args.device, dtype=args.dtype, num_threads=args.threads,
                   max_active=args.max_active)
    from tandem.engine.model.loader import load_model_meta

    vocab = load_model_meta(args.model).model_config.vocab_size
    rows = []
    for name in workloads:
        reqs, num_kv_blocks = build_workload(name, args, vocab)
        real = LLMEngine(EngineConfig(**real_kw, num_kv_blocks=num_kv_blocks))
        profile = load_or_measure_profile(real, args.profile, out / f"profile-{name}.json")
        sim = LLMEngine(EngineConfig(model=args.model, device="sim", max_active=real.config.max_active,
                                     num_kv_blocks=len(real.kv_cache_manager.block_pool.blocks),
                                     max_num_batched_tokens=real.config.resolved_max_num_batched_tokens),
                        step_time=profile.step_time().step_s)
        measured = {}
        for kind, engine in (("real", real), ("sim", sim)):
            warm_up(engine, args.seed)
            measured[kind] = drive(engine, reqs, args.clients)
            print(f"{name} {kind}: {format_metrics(measured[kind])}", flush=True)
        rows.append({"workload": name, "num_requests": len(reqs), "num_kv_blocks": num_kv_blocks, **measured})
        del real, sim
    report = {"command": vars(args), "rows": rows}
    (out / "fidelity.json").write_text(json.dumps(report, indent=1))
    print(render(rows))
    return 0


# -- workloads ---------------------------------------------------------------------------------
def build_workload(name: str, args: argparse.Namespace, vocab: int) -> tuple[list[Req], int | None]:
    """The requests and, for `tenants`, the KV blocks that hold `--tenants-kv-share` of the prefixes."""
    rng = random.Random(args.seed)
    scale = args.scale
    top = min(vocab, 20000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, top) for _ in range(max(1, n))]

    if name == "nano":
        lo, hi = max(8, int(100 * scale)), max(16, int(1024 * scale))
        return [Req(0.0, tokens(rng.randint(lo, hi)), rng.randint(lo, hi)) for _ in range(max(4, int(256 * scale)))], None
    if name == "closed":
        prompt, output = max(16, int(516 * scale)), max(4, int(128 * scale))
        return [Req(float("inf"), tokens(prompt), output) for _ in range(max(8, int(4 * args.clients * scale)))], None
    if name == "tenants":
        from bench.tenants import TenantsCell

        num_tenants, prefix = max(2, int(args.tenants * scale)), max(64, int(args.prefix_tokens * scale))
        cell = TenantsCell(num_tenants, prefix, args.rate * scale, max(16, args.requests_per_tenant * num_tenants),
                           suffix_tokens=64, max_tokens=max(8, int(64 * scale)))
        prefixes = [tokens(prefix) for _ in range(num_tenants)]
        reqs = [Req(arrival_s, prefixes[tenant] + tokens(cell.suffix_tokens), cell.max_tokens)
                for arrival_s, tenant in cell.arrivals(args.seed)]
        per_request = -(-(prefix + cell.suffix_tokens + cell.max_tokens) // 16)
        num_kv_blocks = max(int(args.tenants_kv_share * num_tenants * prefix / 16), 4 * per_request) + 1
        return reqs, num_kv_blocks
    raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def load_or_measure_profile(engine: Any, path: str | None, write_to: Path) -> Any:
    """The real engine's sim profile: `path`, else measured now as `tandem profile --sim-profiles` does."""
    from tandem.engine.profiler import measure_rates, measure_sim_extras
    from tandem.routing.step_time import load_sim_profile, sim_profile_from_dict

    if path:
        return load_sim_profile(path)
    entry = measure_rates(engine, engine.config.max_active)
    entry.pop("spread", None)
    entry.update(measure_sim_extras(engine), description=f"bench fidelity: {engine.model_name} on {engine.config.device}")
    write_to.write_text(json.dumps(entry, indent=1))
    return sim_profile_from_dict(entry)


def warm_up(engine: Any, seed: int) -> None:
    from tandem.engine.sampling_params import SamplingParams

    rng = random.Random(seed + 1)
    top = min(engine.model_config.vocab_size, 20000)
    for i in range(4):
        engine.add_request(f"warm-{i}", [rng.randrange(3, top) for _ in range(64)],
                           SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.drain_progress()


# -- driving -------------------------------------------------------------------------------------
def drive(engine: Any, reqs: list[Req], num_clients: int) -> dict[str, Any]:
    """Run `reqs` in real time: timed arrivals at their time, closed-loop ones `num_clients` at a
    time; per request its arrival, first-token and finish time and its cached tokens."""
    from tandem.engine.sampling_params import SamplingParams

    timed = deque(sorted((i for i, r in enumerate(reqs) if r.arrival_s != float("inf")), key=lambda i: reqs[i].arrival_s))
    closed = deque(i for i, r in enumerate(reqs) if r.arrival_s == float("inf"))
    arrival, first, finish, cached = {}, {}, {}, {}
    start = time.perf_counter()
    tag = f"fid-{id(reqs)}-{start}"

    def add(i: int, now: float) -> None:
        arrival[i] = now
        engine.add_request(f"{tag}-{i}", reqs[i].prompt, SamplingParams(max_tokens=reqs[i].max_tokens, ignore_eos=True))

    for _ in range(min(num_clients, len(closed))):
        add(closed.popleft(), 0.0)
    while timed or closed or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while timed and reqs[timed[0]].arrival_s <= now:
            add(timed.popleft(), now)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[timed[0]].arrival_s - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            i = int(out.req_id.rsplit("-", 1)[1])
            if out.new_token_ids and i not in first:
                first[i] = now
            if out.finished:
                finish[i], cached[i] = now, out.usage.cached_tokens
                if closed:
                    add(closed.popleft(), now)
    return metrics(reqs, arrival, first, finish, cached)


def metrics(reqs: list[Req], arrival: dict, first: dict, finish: dict, cached: dict) -> dict[str, Any]:
    from tandem.routing.sim_report import percentile

    ttfts = [first[i] - arrival[i] for i in first]
    span = max(finish.values()) - min(arrival.values())
    prompt = sum(len(reqs[i].prompt) for i in finish)
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "output_tok_s": sum(reqs[i].max_tokens for i in finish) / span, "span_s": span,
            "hit_rate": sum(cached.values()) / prompt if prompt else 0.0, "num_finished": len(finish)}


def format_metrics(m: dict[str, Any]) -> str:
    return (f"TTFT p50 {1000 * m['ttft_p50_s']:.1f} ms, p95 {1000 * m['ttft_p95_s']:.1f} ms, "
            f"{m['output_tok_s']:.1f} tok/s, hit rate {100 * m['hit_rate']:.1f}%, span {m['span_s']:.2f} s")


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | requests | TTFT p50 ms real / sim | TTFT p95 ms real / sim | out tok/s real / sim | "
             "hit rate % real / sim |", "|---|---|---|---|---|---|"]
    for row in rows:
        r, s = row["real"], row["sim"]

        def pair(key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
            ratio = s[key] / r[key] if r[key] else float("nan")
            return f"{fmt.format(scale * r[key])} / {fmt.format(scale * s[key])} ({ratio:.2f}x)"

        lines.append(f"| {row['workload']} | {row['num_requests']} | {pair('ttft_p50_s', 1000)} | "
                     f"{pair('ttft_p95_s', 1000)} | {pair('output_tok_s')} | {pair('hit_rate', 100)} |")
    return "\n".join(lines)
