"""`tandem bench router-scaling`: where one router actor stops keeping up, its CPU per placement and
per backend report, by the number of backends.

The router actor (actors/router.py) does two kinds of work: place each request (hash its prompt's
blocks, look every backend's prefix mirror up, score every backend, record the decision) and
apply each backend's report (progress of its running requests, step timings, prefix-cache
changes; a busy backend sends one every 20 ms). Both grow with the number of backends: a
placement scores each one, and each one reports. This times both on the real `RouterActor`
class, in this process without Ray (a Ray call adds its own overhead on top), with N backends
holding `--active` running requests each, and prompts of `--prompt-tokens` tokens that share a
tenant's prefix; `--routing-log` adds the routing log's line to each placement, as
`tandem serve --routing-log` (and every `tandem bench tenants` run) writes it. From the two costs
it gives the router's CPU share at `--rate` placements/s with every backend busy (reporting every
20 ms), and the placement rate at which it reaches one core. A placement is timed through
`place_many`, the batched path callers use.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench._machine import stamp
from bench.harness import ints, write_json

REPORT_INTERVAL_S = 0.02  # a busy backend's report interval (actors/backend.py's default)


def build_router(num_backends: int, active: int, prompt_tokens: int, seed: int, routing_log: str | None = None):
    from tandem.actors.messages import BackendInfo, PlaceRequest
    from tandem.actors.router import RouterActor

    # round-robin while filling: `active` requests on every backend; no health checks (no actors to ping)
    router = RouterActor(policy="round-robin", calibration_alpha=0.2, health_check_period_s=1e9,
                         routing_log=routing_log)
    rates = {"prefill_tok_s": 240000.0, "decode_tok_s": 900.0, "decode_tok_s_by_batch": {1: 900.0, 32: 25000.0}}
    loop = asyncio.new_event_loop()
    for i in range(num_backends):
        info = BackendInfo(f"sim{i}", "x", "sim", "sim", "sim", "float32", 1, 32, 16, "m", 8192, rates=rates,
                           emulated_kind="cuda")
        loop.run_until_complete(router.add_backend(info, handle=None))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(prompt_tokens - 64)] for _ in range(160)]
    placed: dict[str, list[str]] = {f"sim{i}": [] for i in range(num_backends)}
    for n in range(num_backends * active):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 30000) for _ in range(64)]
        [placement] = router.place_many([(PlaceRequest(f"a{n}", prompt, 32),)])
        placed[placement.backend_id].append(f"a{n}")
    loop.run_until_complete(router.set_policy("cost"))
    return router, loop, prefixes, placed


def time_placements(router, loop, prefixes, num: int, seed: int) -> list[float]:
    """Placements on the actor's event loop, as the live actor makes them (its gauge exports
    are batched on that loop, not made per decision); each is forgotten afterwards, untimed."""
    from tandem.actors.messages import PlaceRequest

    rng = random.Random(seed)
    prompts = [rng.choice(prefixes) + [rng.randrange(3, 30000) for _ in range(64)] for _ in range(num)]

    async def place_all() -> list[float]:
        samples = []
        for n, prompt in enumerate(prompts):
            request = [(PlaceRequest(f"t{n}", prompt, 32),)]
            start = time.perf_counter_ns()
            router.place_many(request)
            samples.append((time.perf_counter_ns() - start) / 1000)
            await router.forget(f"t{n}")
        return samples

    return loop.run_until_complete(place_all())


def time_reports(router, loop, placed: dict[str, list[str]], num: int) -> list[float]:
    from tandem.actors.messages import StepTiming
    from tandem.engine.outputs import RequestProgress

    backend_ids = list(placed)
    samples = []
    for n in range(num):
        backend_id = backend_ids[n % len(backend_ids)]
        tokens = 1 + n // len(backend_ids)
        progress = [RequestProgress(r, "running", 2112, 2048, 2112, tokens, 32) for r in placed[backend_id]]
        steps = [StepTiming(0, len(progress), len(progress), 0.0013)]
        changes = {hash((backend_id, n, j)): True for j in range(2)}
        start = time.perf_counter_ns()
        loop.run_until_complete(router.report(backend_id, "x", progress, steps, changes))
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def row(num_backends: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = f"{tmp}/routing.jsonl" if args.routing_log else None
        return _row(num_backends, args, build_router(num_backends, args.active, args.prompt_tokens, args.seed, log))


def _row(num_backends: int, args: argparse.Namespace, built: tuple) -> dict:
    router, loop, prefixes, placed = built
    place = sorted(time_placements(router, loop, prefixes, args.num_placements, args.seed + 1))
    report = sorted(time_reports(router, loop, placed, args.num_reports))
    place_us, report_us = statistics.median(place), statistics.median(report)
    reports_per_s = num_backends / REPORT_INTERVAL_S
    core_share = (args.rate * place_us + reports_per_s * report_us) / 1e6
    max_rate = max(0.0, (1e6 - reports_per_s * report_us) / place_us)
    return {"num_backends": num_backends, "place_p50_us": round(place_us, 1),
            "place_p99_us": round(place[int(0.99 * (len(place) - 1))], 1),
            "report_p50_us": round(report_us, 1), "report_p99_us": round(report[int(0.99 * (len(report) - 1))], 1),
            "reports_per_s": reports_per_s, "core_share_at_rate": round(core_share, 3),
            "max_placements_per_s": round(max_rate)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", type=ints, default=[16, 32, 64], help="backend counts (default 16,32,64)")
    parser.add_argument("--active", type=int, default=16, help="running requests per backend (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=2112, help="prompt tokens (default 2112)")
    parser.add_argument("--rate", type=float, default=2000.0, help="placements/s for the CPU share (default 2000)")
    parser.add_argument("--num-placements", type=int, default=2000)
    parser.add_argument("--num-reports", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routing-log", action="store_true",
                        help="placements also write the routing log (tandem serve --routing-log), to a temp file")
    parser.add_argument("--out", type=Path, default=Path("out/router_scaling.json"))


def run(args: argparse.Namespace) -> int:
    rows = [row(n, args) for n in args.backends]
    print(f"| backends | place p50 / p99 us | report p50 / p99 us | reports/s (busy) | router core share at "
          f"{args.rate:g}/s | placements/s at one core |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_backends']} | {r['place_p50_us']} / {r['place_p99_us']} | {r['report_p50_us']} / "
              f"{r['report_p99_us']} | {r['reports_per_s']:g} | {r['core_share_at_rate']} | {r['max_placements_per_s']} |")
    write_json(args.out, {**stamp(), "config": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {args.out}")
    return 0
