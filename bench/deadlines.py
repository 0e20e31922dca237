"""`tandem bench deadlines`: deadlines and priorities under load, through the HTTP API.

Mixed traffic, open loop (bench/workload.py's `priority_mix`), at several arrival rates, in two
arms on one cluster: `deadline` (urgent requests carry priority 0 and a TTFT deadline, so the
router places them only where the projection meets it, else 429, and the engines admit them
ahead of batch work) and `fcfs` (the same requests without either). Both arms replay the same
arrivals and classes, each with prompts of its own. Per arm and rate: urgent TTFT p50/p95 and
the share within the deadline, batch output tok/s, refusal latency, the projection's error
(observed TTFT minus `x-tandem-projected-ttft-ms`, biased late by the HTTP hops) overall and per
backend, and how late the client sent (`--client-procs N` shares the arrivals among processes
when one falls behind). It drives `--url` or starts a cluster; with `--routing-log` each run is
also replayed through route-sim and the replayed TTFT p50 set beside the measured one. While each
run goes, every server process's CPU is sampled once a second (bench/soak_probe.py's
`CpuTimeline`, the started cluster's tree or `--server-pid`'s), so a run that stalls says which
process was out of CPU: the router, an engine core, Serve's proxy or the client.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.client import RequestResult, stream_completion
from bench.harness import floats, ints, start_cluster, write_json
from bench.metrics import percentile
from bench.soak_probe import CpuTimeline
from bench.workload import PriorityRequest, Traffic, priority_mix

ARMS = ("deadline", "fcfs")
MAX_CLIENT_LAG_S = 0.05  # a run whose client sent later than this (p99) says so


@dataclass
class Outcome(RequestResult):
    urgent: bool = False
    send_lag_s: float = 0.0  # how late the client sent it: a busy client delays every figure after


def request_body(model: str, request: PriorityRequest, arm: str, traffic: Traffic) -> dict[str, Any]:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if arm == "deadline":
        body["priority"] = 0 if request.urgent else 1
        if request.urgent:
            body["ttft_deadline_ms"] = traffic.deadline_ms
    return body


async def send(client: Any, start: float, model: str, request: PriorityRequest, arm: str,
               traffic: Traffic) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    out = Outcome(request.index, time.perf_counter() - start, urgent=request.urgent)
    out.send_lag_s = out.send_s - request.arrival_s
    try:
        await stream_completion(client, request_body(model, request, arm, traffic), start, out)
    except Exception as exc:  # a transport failure is a result, not a crash of the bench
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def run_load(url: str, model: str, requests: list[PriorityRequest], arm: str, traffic: Traffic,
             start: float | None = None, timeout_s: float = 600.0) -> list[Outcome]:
    """Send `requests` at their arrival times after `start` (a `time.perf_counter()` value, the
    same clock in every process of this machine; None: now) and read their streams."""
    import httpx

    async def load() -> list[Outcome]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
            at = time.perf_counter() if start is None else start
            return list(await asyncio.gather(*(send(client, at, model, r, arm, traffic) for r in requests)))

    return asyncio.run(load())


def _warm_up(_: int) -> None:
    import httpx  # noqa: F401  (so the first run does not pay the import)

    time.sleep(0.2)  # long enough that each worker takes one


def client_pool(num_procs: int) -> Any:
    """`num_procs` client processes, started and warm, or None for this process alone. One Python
    process reading hundreds of streams falls behind its own arrival schedule (each outcome's
    send lag shows it), and then every figure measures the client."""
    if num_procs < 2:
        return None
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(num_procs, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(_warm_up, range(num_procs)))
    return pool


def run_clients(pool: Any, num_procs: int, url: str, model: str, requests: list[PriorityRequest], arm: str,
                traffic: Traffic) -> list[Outcome]:
    """The run's arrivals, shared round-robin among the pool's processes, which all start 0.5 s
    from now (after they got their requests)."""
    if pool is None:
        return run_load(url, model, requests, arm, traffic)
    start = time.perf_counter() + 0.5
    parts = [pool.submit(run_load, url, model, requests[i::num_procs], arm, traffic, start) for i in range(num_procs)]
    return sorted((o for part in parts for o in part.result()), key=lambda o: o.index)


def summarize(outcomes: list[Outcome], traffic: Traffic) -> dict[str, Any]:
    """One arm at one rate (see the module doc for each figure)."""
    urgent = [o for o in outcomes if o.urgent]
    batch = [o for o in outcomes if not o.urgent]
    served = [o for o in urgent if o.status == 200 and o.ttft_s is not None]
    refused = [o for o in outcomes if o.status == 429]
    deadline_s = traffic.deadline_ms / 1000
    ttfts = [o.ttft_s for o in served]
    batch_done = [o for o in batch if o.status == 200 and o.end_s is not None]
    span_s = (max(o.end_s for o in batch_done) - min(o.send_s for o in batch)) if batch_done else 0.0
    placed = [o for o in outcomes if o.status == 200 and o.ttft_s is not None and o.projected_ttft_s is not None]
    errors = [o.ttft_s - o.projected_ttft_s for o in placed]
    return {
        "num_urgent": len(urgent), "num_batch": len(batch), "num_refused": len(refused),
        "num_failed": sum(1 for o in outcomes if o.status not in (200, 429) or (o.status == 200 and o.error)),
        "urgent_ttft_p50_s": percentile(ttfts, 50), "urgent_ttft_p95_s": percentile(ttfts, 95),
        "deadline_s": deadline_s,
        "urgent_within_deadline": sum(1 for t in ttfts if t <= deadline_s) / len(urgent) if urgent else None,
        "batch_output_tok_s": sum(o.num_output_tokens for o in batch_done) / span_s if span_s > 0 else None,
        "refusal_latency_p50_s": percentile([o.end_s - o.send_s for o in refused], 50),
        "refusal_latency_p95_s": percentile([o.end_s - o.send_s for o in refused], 95),
        # the server's part of it (Server-Timing: from the ingress receiving the request to its answer)
        "refusal_server_p50_s": percentile([o.server_s for o in refused if o.server_s is not None], 50),
        "refusal_server_p95_s": percentile([o.server_s for o in refused if o.server_s is not None], 95),
        "projection_error_p50_s": percentile(errors, 50), "projection_error_p95_s": percentile(errors, 95),
        "projection_abs_error_p95_s": percentile([abs(e) for e in errors], 95),
        "projection_error_by_backend": projection_error_by_backend(placed),
        "client_lag_p99_s": percentile([o.send_lag_s for o in outcomes], 99),
        "client_lag_max_s": max((o.send_lag_s for o in outcomes), default=None),
    }


def projection_error_by_backend(placed: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Observed minus projected TTFT of the requests each backend served: how many, the median
    error (its bias), the median and p90 of its absolute value (its spread)."""
    by_backend: dict[str, list[float]] = {}
    for o in placed:
        by_backend.setdefault(o.backend or "?", []).append(o.ttft_s - o.projected_ttft_s)
    return {backend: {"n": len(errors), "median_s": percentile(errors, 50),
                      "median_abs_s": percentile([abs(e) for e in errors], 50),
                      "p90_abs_s": percentile([abs(e) for e in errors], 90)}
            for backend, errors in sorted(by_backend.items())}


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("arm", "rate/s", "urgent", "batch", "refused", "urgent p50", "urgent p95", "deadline", "met",
              "batch tok/s", "refusal p95", "server p95", "proj err p50", "proj err p95", "client lag p99")

    def cell(value: Any, unit: str = "") -> str:
        if value is None:
            return "-"
        return f"{value:.3f}{unit}" if isinstance(value, float) else str(value)

    replays = any("replayed_ttft_p50_s" in r for r in rows)
    if replays:
        header += ("ttft p50", "replay p50")
    lines = [header] + [(
        r["arm"], cell(r["rate_per_s"]), str(r["num_urgent"]), str(r["num_batch"]), str(r["num_refused"]),
        cell(r["urgent_ttft_p50_s"]), cell(r["urgent_ttft_p95_s"]), cell(r["deadline_s"]),
        "-" if r["urgent_within_deadline"] is None else f"{100 * r['urgent_within_deadline']:.0f}%",
        "-" if r["batch_output_tok_s"] is None else f"{r['batch_output_tok_s']:.1f}",
        cell(r["refusal_latency_p95_s"]), cell(r.get("refusal_server_p95_s")), cell(r["projection_error_p50_s"]),
        cell(r["projection_error_p95_s"]), cell(r.get("client_lag_p99_s")),
    ) + ((cell(r.get("ttft_p50_s")), cell(r.get("replayed_ttft_p50_s"))) if replays else ()) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text += ["", "projection error (observed - projected TTFT) by backend: n, median, median |e|, p90 |e| (s)"]
    for r in rows:
        cells = [f"{backend} {e['n']} {e['median_s']:+.3f} {e['median_abs_s']:.3f} {e['p90_abs_s']:.3f}"
                 for backend, e in r.get("projection_error_by_backend", {}).items()]
        text.append(f"  {r['arm']} {r['rate_per_s']:g}/s: " + ("; ".join(cells) or "-"))
    behind = [f"{r['arm']} {r['rate_per_s']:g}/s" for r in rows if (r.get("client_lag_p99_s") or 0) > MAX_CLIENT_LAG_S]
    if behind:
        text += ["", f"the client sent late (p99 over {1e3 * MAX_CLIENT_LAG_S:.0f} ms) in: {', '.join(behind)}; "
                     "those rows measure the client too: run again with more --client-procs"]
    return "\n".join(text)


def run_all(url: str, model: str, rates: list[float], duration_s: float, traffic: Traffic, seed: int,
            arms: tuple[str, ...] = ARMS, routing_log: Path | None = None, client_procs: int = 1,
            server_pid: int | None = None) -> dict[str, Any]:
    rows, runs = [], []
    pool = client_pool(client_procs)
    try:
        for rate in rates:
            for arm in arms:
                workload = priority_mix(rate, duration_s, traffic, seed, prompts_of=arm)
                started = time.time()  # the routing log's clock
                with CpuTimeline(server_pid) if server_pid else nullcontext() as cpu:
                    outcomes = run_clients(pool, client_procs, url, model, workload, arm, traffic)
                span = (started, time.time())
                peaks = dict(list(cpu.peaks().items())[:4]) if cpu else {}
                rows.append({"arm": arm, "rate_per_s": rate, **summarize(outcomes, traffic), "cpu_peaks": peaks})
                runs.append({"arm": arm, "rate_per_s": rate, "span": span, "requests": [asdict(o) for o in outcomes],
                             **({"cpu_by_role": cpu.shares} if cpu else {})})
    finally:
        if pool is not None:
            pool.shutdown()
    if routing_log is not None:
        for row, run in zip(rows, runs):
            row.update(replayed(routing_log, run["span"], run["requests"]))
    return {"traffic": asdict(traffic), "duration_s": duration_s, "seed": seed, "summaries": rows, "runs": runs}


def replayed(routing_log: Path, span: tuple[float, float], requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's part of the routing log replayed under the policy that served it: its TTFT p50
    beside the measured one (every request served, from send to the first text)."""
    from tandem.cluster.engine_sim_backend import engine_backend_factory
    from tandem.routing.errors import ConfigError
    from tandem.routing.replay import first_decision_s, load_replay
    from tandem.routing.sim_report import summarize as summarize_sim
    from tandem.routing.simulator import simulate

    try:
        first = first_decision_s(routing_log)
        window = (span[0] - first, span[1] - first)
        replay = load_replay(routing_log, window)
    except (ConfigError, OSError) as exc:  # no log, or nothing placed in this run: the run's figures stand
        return {"replay_error": str(exc)}
    result = simulate(replay.scenario, replay.served_policy, engine_backend_factory())  # `tandem route-sim`'s model
    simulated = summarize_sim(result.policy, result.outcomes, [b.spec.backend_id for b in replay.scenario.backends])
    measured = percentile([r["first_text_s"] - r["send_s"] for r in requests
                           if r["status"] == 200 and r["first_text_s"] is not None], 50)
    return {"replay_window_s": [round(w, 3) for w in window], "replayed_ttft_p50_s": simulated.ttft_p50_s,
            "ttft_p50_s": measured}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server's base URL; without it, start one")
    parser.add_argument("--model", default="smollm2-135m", help="served model (its name, with --url)")
    parser.add_argument("--backends", default="cpu,auto", help="backends to start without --url (comma-separated)")
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--max-active", type=int, default=4)
    parser.add_argument("--max-pending-requests", type=int, default=1024)
    parser.add_argument("--rates", default=None, help="rates file for a started server (skips profiling)")
    parser.add_argument("--loads", type=floats, default=[2.0, 4.0, 8.0], help="arrival rates per second (2,4,8)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="arrivals per rate span this long")
    parser.add_argument("--deadline-ms", type=float, default=Traffic.deadline_ms)
    parser.add_argument("--urgent-share", type=float, default=Traffic.urgent_share)
    parser.add_argument("--urgent-lengths", type=ints, default=[64, 16], help="urgent prompt,max_tokens (64,16)")
    parser.add_argument("--batch-lengths", type=ints, default=[256, 128], help="batch prompt,max_tokens (256,128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-procs", type=int, default=1,
                        help="client processes sharing the arrivals (one falls behind at high rates: see the "
                             "client lag column)")
    parser.add_argument("--routing-log", type=Path, default=None,
                        help="the server's routing log (a started server writes it): replay each run from it "
                             "and report the replayed TTFT p50 beside the measured one")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: the server's pid (`tandem serve`'s), whose process tree's CPU is sampled "
                             "during each run; a started cluster's is sampled without it")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")


def run(args: argparse.Namespace) -> int:
    (urgent_prompt, urgent_max), (batch_prompt, batch_max) = args.urgent_lengths, args.batch_lengths
    traffic = Traffic(args.urgent_share, args.deadline_ms, urgent_prompt, urgent_max, batch_prompt, batch_max)
    server = None if args.url else start_cluster(
        model=args.model, backends=args.backends.split(","), cpu_threads=args.cpu_threads, max_active=args.max_active,
        max_pending_requests=args.max_pending_requests, rates=args.rates, profile="never" if args.rates else "auto",
        warmup_tokens=48, routing_log=None if args.routing_log is None else str(args.routing_log))
    try:
        report = run_all(args.url or server.url, args.model, args.loads, args.duration_s, traffic, args.seed,
                         routing_log=args.routing_log, client_procs=args.client_procs,
                         server_pid=args.server_pid if args.url else os.getpid())
    finally:
        if server is not None:
            server.shutdown()
    if args.out is not None:
        write_json(args.out, report)
    print(format_table(report["summaries"]))
    print(format_cpu_peaks(report["summaries"]))
    return 0


def format_cpu_peaks(rows: list[dict[str, Any]]) -> str:
    """Each run's busiest processes: the highest share of a core each used in any second."""
    lines = ["", "busiest processes (peak share of a core in any second):"]
    for row in rows:
        peaks = ", ".join(f"{role} {share:.2f}" for role, share in row.get("cpu_peaks", {}).items()) or "not sampled"
        lines.append(f"  {row['arm']} {row['rate_per_s']:g}/s: {peaks}")
    return "\n".join(lines)
