"""`tandem bench router-decision`: router decision latency with a deep backlog, running sums against
walking the queue.

A Router over N backends (default one accelerator and one CPU at the design's rates) holds
`--num-pending` routed requests, some admitted and advanced; then `Router.route()` is timed for
`--num-decisions` new requests, each forgotten afterwards so the depth stays. In one process,
on the same ledgers: every policy; `cost` empty and at 10x the backlog (the running sums make
depth free); "walk the queue", the same score summed over every pending request (what the sums
avoid); and urgent requests among batch work past its starvation bound, whose projection walks
the ledger (routing/deadline.py). Median, p99 and mean microseconds per decision.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path
from typing import Callable

from bench._machine import stamp
from bench.harness import write_json
from tandem.routing import POLICIES, BackendSpec, ProgressEvent, RateProfile, RouteRequest, Router

SPEC_BACKENDS = [
    BackendSpec("cuda0", "cuda", RateProfile(2551, 293), max_active=4),
    BackendSpec("cpu0", "cpu", RateProfile(73, 45), max_active=4),
]


def backends(num_backends: int) -> list[BackendSpec]:
    extra = [BackendSpec(f"cuda{i}", "cuda", RateProfile(2551, 293), 4) for i in range(1, num_backends - 1)]
    return (SPEC_BACKENDS + extra)[:num_backends]


def random_request(rng: random.Random, req_id: str, backend_ids: list[str]) -> RouteRequest:
    prompt = rng.randint(16, 2048)
    cached = {b: rng.choice([0, prompt // 2, max(0, prompt - 20)]) for b in backend_ids}
    return RouteRequest(req_id, prompt, rng.choice([64, 128, 256, 512]), cached)


def build_router(policy: str, num_backends: int, num_pending: int, seed: int) -> Router:
    """A router whose ledgers hold `num_pending` requests, the first few per backend active."""
    specs = backends(num_backends)
    router = Router(specs, policy=policy)
    rng = random.Random(seed)
    ids = [s.backend_id for s in specs]
    for n in range(num_pending):
        router.route(random_request(rng, f"p{n}", ids))
    for backend_id in ids:
        active = list(router.ledger(backend_id).entries)[:4]
        router.on_progress(backend_id, [ProgressEvent(r, "generated", rng.randint(1, 60)) for r in active])
    return router


def build_mixed_router(num_backends: int, num_pending: int, seed: int) -> Router:
    """A router whose ledgers hold `num_pending` batch requests (priority 1, routed a millisecond
    apart, all past a 5 s starvation bound by t=100) with 3 of each backend's 4 slots active:
    an urgent request's projection then counts the batch request filling the free slot and
    the aged turn it takes, the walks that cost more than the running sums."""
    specs = [dataclasses.replace(spec, max_priority_wait_s=5.0) for spec in backends(num_backends)]
    router = Router(specs, policy="cost")
    rng = random.Random(seed)
    ids = [s.backend_id for s in specs]
    for n in range(num_pending):
        router.route(dataclasses.replace(random_request(rng, f"p{n}", ids), priority=1, arrival_s=n / 1000))
    for backend_id in ids:
        active = list(router.ledger(backend_id).entries)[:3]
        router.on_progress(backend_id, [ProgressEvent(r, "generated", rng.randint(1, 60)) for r in active])
    return router


def walk_the_queue_scores(router: Router, request: RouteRequest) -> dict[str, float]:
    """The cost score recomputed from every pending request: the baseline running sums avoid."""
    scores = {}
    for backend_id in router.backend_ids():
        rates = router.rates(backend_id)
        entries = router.ledger(backend_id).entries.values()
        prefill = sum(e.num_prefill_tokens_left() for e in entries) + request.num_prefill_tokens_on(backend_id)
        decode = sum(e.num_decode_tokens_left() for e in entries) + request.max_tokens
        scores[backend_id] = prefill / rates.prefill_tok_s + decode / rates.decode_tok_s
    return scores


def time_decisions(router: Router, decide: Callable[[RouteRequest], object], num_decisions: int,
                   seed: int) -> list[float]:
    """Microseconds per decision; each new request is forgotten afterwards (untimed)."""
    rng = random.Random(seed)
    ids = router.backend_ids()
    requests = [random_request(rng, f"new{n}", ids) for n in range(num_decisions)]
    samples = []
    for request in requests:
        start = time.perf_counter_ns()
        decide(request)
        samples.append((time.perf_counter_ns() - start) / 1000)
        router.forget(request.req_id)
    return samples


def row(name: str, num_pending: int, samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "method": name,
        "num_pending": num_pending,
        "num_decisions": len(samples),
        "median_us": round(statistics.median(ordered), 2),
        "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        "mean_us": round(statistics.fmean(ordered), 2),
    }


def run_all(args: argparse.Namespace) -> list[dict]:
    rows = []
    for policy in POLICIES:
        router = build_router(policy, args.num_backends, args.num_pending, args.seed)
        rows.append(row(f"route ({policy})", args.num_pending, time_decisions(router, router.route, args.num_decisions, 1)))
    for depth in (0, 10 * args.num_pending):
        router = build_router("cost", args.num_backends, depth, args.seed)
        rows.append(row("route (cost)", depth, time_decisions(router, router.route, args.num_decisions, 1)))
    for depth in (args.num_pending, 10 * args.num_pending):
        router = build_mixed_router(args.num_backends, depth, args.seed)
        urgent = lambda request, router=router: router.route(  # noqa: E731
            dataclasses.replace(request, priority=0, arrival_s=100.0))
        rows.append(row("route (cost, urgent vs batch)", depth, time_decisions(router, urgent, args.num_decisions, 1)))
    for depth in (args.num_pending, 10 * args.num_pending):
        router = build_router("cost", args.num_backends, depth, args.seed)
        walk = lambda request, router=router: walk_the_queue_scores(router, request)  # noqa: E731
        # A tenth of the decisions: the walk is ~100x slower and its numbers settle quickly.
        rows.append(row("walk the queue (cost)", depth, time_decisions(router, walk, args.num_decisions // 10, 1)))
    return rows


def format_table(rows: list[dict]) -> str:
    header = f"{'method':<30} {'pending':>8} {'median_us':>10} {'p99_us':>10} {'mean_us':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['method']:<30} {r['num_pending']:>8} {r['median_us']:>10.2f} "
                     f"{r['p99_us']:>10.2f} {r['mean_us']:>10.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-pending", type=int, default=1000)
    parser.add_argument("--num-decisions", type=int, default=20_000)
    parser.add_argument("--num-backends", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/router_decision.json"))


def run(args: argparse.Namespace) -> int:
    rows = run_all(args)
    print(f"Router decision latency, {args.num_backends} backends, {args.num_decisions} decisions per row")
    print(format_table(rows))
    write_json(args.out, {"benchmark": "router_decision", **stamp(),
                          "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                          "rows": rows})
    print(f"wrote {args.out}")
    return 0
