"""`tandem bench served-path`: what serving costs, against the engine's own speed in the same run.

Serving adds work per request and per streamed message (the router, the backend's hand-offs, the
channel, HTTP). The in-process engine, in a child process that exits before the server starts (so
both see the device's whole memory), runs the same workloads as `tandem serve`'s HTTP API with a
streaming client (sizes scale with `--scale`, for a CPU):
- burst rows: 48 x (516 -> 128) at max_active 4 and 64, and 256 requests of prompts in
  [64, 1024] and outputs in [32, 512] at 256 (bench/workload.py, ids from the model's
  vocabulary); output tok/s from the first send to the last token, best of `--repeats` after a
  warm-up, every repeat's rate and the ratio of the medians; the burst's TTFT p50 and max from
  its start, and the client's own CPU share;
- TTFT: one request at a time (516 -> 16, and a long prompt, 4160 -> 16), the median at each
  length: what the serving path adds per request, and per prompt token (a long prompt's ids
  pass through every hop);
- capacity: short requests (prompt 32, max_tokens 1, not streamed) at fixed rates from several
  client processes: achieved rate, p50 and p99 latency per offered rate.

`--device sim` runs both sides on the sim device (`--sim-profile`, default the H200's): the same
engine with the profiled device's step times instead of a forward pass, in process and behind
`tandem serve`, so what the serving stack costs at a GPU's token rates is measured on any machine.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench._machine import stamp
from bench.client import post_streamed
from bench.harness import burst, floats, ints, make_engine, start_cluster, step_work, write_json
from bench.soak_probe import CpuReading, cpu_used_by_role, read_cpu
from bench.workload import random_prompts, varied_requests

VOCAB_HIGH = 20000  # token ids are drawn from [3, min(vocab, VOCAB_HIGH))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama-random", help="model preset (default tiny-llama-random)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a cpu engine (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system after a warm-up; the best counts")
    parser.add_argument("--out", type=Path, default=Path("out/bench_served_path.json"), help="JSON output path")
    parser.add_argument("--device", default="cpu", help="engine device: cpu (default), cuda or sim")
    parser.add_argument("--sim-profile", default=None, metavar="NAME|FILE",
                        help="with --device sim: the device it emulates (default tandem serve's)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (default auto: bfloat16 on cuda)")
    parser.add_argument("--scale", type=float, default=1.0, help="scale every size (requests, lengths, max_active)")
    parser.add_argument("--ttft-requests", type=int, default=20, help="one-at-a-time requests for TTFT")
    parser.add_argument("--ttft-prompt-tokens", type=ints, default=[516, 4160],
                        help="prompt lengths of the one-at-a-time TTFT rows (default 516,4160; scaled)")
    parser.add_argument("--capacity-rates", type=floats, default=[250.0, 500.0, 1000.0, 1500.0],
                        help="request rates of short requests ('' skips)")
    parser.add_argument("--capacity-seconds", type=float, default=3.0, help="seconds per capacity rate")
    parser.add_argument("--capacity-clients", type=int, default=4, help="client processes for the capacity curve")
    parser.add_argument("--http-replicas", type=int, default=0, help="Serve ingress replicas (0: the default)")
    parser.add_argument("--ingress", choices=("auto", "direct", "proxy"), help="tandem serve --ingress (default auto)")
    parser.add_argument("--max-pending", type=int, default=4096, help="the ingress's pending-request limit")


def run(args: argparse.Namespace) -> int:
    write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, **run_http(args),
                          **stamp(args.threads, args.device)})
    return 0


# -- in-process against HTTP -----------------------------------------------------------------------
def workloads(scale: float, vocab: int) -> list[dict[str, Any]]:
    def n(x: int) -> int:
        return max(1, int(x * scale))

    burst_prompts = random_prompts(n(48), n(516), seed=0, high=vocab)
    mixed = varied_requests(n(256), (n(64), n(1024)), (n(32), n(512)), seed=1, high=vocab)
    return [{"name": f"{n(48)} x ({n(516)} -> {n(128)}), max_active {ma}", "max_active": ma, "prompts": burst_prompts,
             "max_tokens": [n(128)] * n(48)} for ma in (4, n(64))] + [
        {"name": f"{n(256)} x ([{n(64)}, {n(1024)}] -> [{n(32)}, {n(512)}]), max_active {n(256)}",
         "max_active": n(256), "prompts": [p for p, _ in mixed], "max_tokens": [m for _, m in mixed]}]


def ttft_spread(firsts: list[float]) -> list[float]:
    """A burst's time to first token, [p50, max] in ms from the burst's start: how long the last
    request waited to be admitted is what a burst's throughput pays on top of the engine."""
    firsts = sorted(firsts)
    return [round(1e3 * firsts[len(firsts) // 2], 1), round(1e3 * firsts[-1], 1)] if firsts else [0.0, 0.0]


def in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The in-process figures, in a child process: the server started next sizes its KV cache from
    the device's free memory, and only a process's exit gives back everything an engine held."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_in_process, args).result()


def _in_process(args: argparse.Namespace) -> dict[str, Any]:
    engine = make_engine(args.model, args.device, max(4, int(256 * args.scale)), args.dtype, args.threads,
                         **_sim_engine(args))
    vocab = min(engine.model_config.vocab_size, VOCAB_HIGH)
    results: dict[str, Any] = {"vocab": vocab}
    for w in workloads(args.scale, vocab):
        engine.set_max_active(w["max_active"])
        runs = [burst(engine, w["prompts"], w["max_tokens"], f"{rep}-{w['max_active']}") for rep in range(args.repeats + 1)]
        best = max(runs[1:], key=lambda r: r["tok_s"])  # the first run warms up (graphs, allocator)
        results[w["name"]] = {"best": best["tok_s"], "runs": [round(r["tok_s"], 1) for r in runs[1:]],
                              "ttft": ttft_spread(best["ttft_s"]),
                              "steps": [best["steps"], round(1e3 * best["wall_s"] / best["steps"], 3)],
                              "step_work": best["step_work"]}
    engine.set_max_active(4)
    results["ttft"] = {}
    for num_tokens in ttft_lengths(args):
        prompts = random_prompts(args.ttft_requests + 2, num_tokens, seed=2, high=vocab)
        ttfts = [burst(engine, [p], 16, f"ttft-{num_tokens}-{i}")["ttft_s"][0] for i, p in enumerate(prompts)][2:]
        results["ttft"][num_tokens] = statistics.median(ttfts)
    return results


def ttft_lengths(args: argparse.Namespace) -> list[int]:
    return [max(1, int(n * args.scale)) for n in args.ttft_prompt_tokens]



def _sim_engine(args: argparse.Namespace) -> dict[str, Any]:
    """A sim engine's step time and KV cache as `tandem serve` gives its sim backend (nothing off sim)."""
    if args.device != "sim":
        return {}
    import math

    from tandem.cluster.config import DEFAULT_SIM_PROFILE
    from tandem.engine.config import DEFAULT_BLOCK_SIZE
    from tandem.routing.step_time import load_sim_profile

    profile = load_sim_profile(args.sim_profile or DEFAULT_SIM_PROFILE)
    num_kv_blocks = math.ceil(profile.num_kv_tokens / DEFAULT_BLOCK_SIZE) + 1 if profile.num_kv_tokens else None
    return {"step_time": profile.step_time().step_s, "num_kv_blocks": num_kv_blocks,
            "max_num_batched_tokens": profile.max_num_batched_tokens}


def _body(model: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def http_rows(args: argparse.Namespace, url: str, model: str, vocab: int, handle: Any) -> dict[str, Any]:
    import aiohttp

    results: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        for w in workloads(args.scale, vocab):
            await handle.set_max_active.remote(w["max_active"])
            row = results[w["name"]] = {"best": 0.0, "runs": []}
            for rep in range(args.repeats + 1):
                server_cpu_start = read_cpu(os.getpid())
                stats_before = await handle.stats.remote()
                start, cpu_start = time.time(), time.process_time()
                done = await asyncio.gather(*(post_streamed(session, url, _body(model, ids, m))
                                              for ids, m in zip(w["prompts"], w["max_tokens"])))
                elapsed, cpu = time.time() - start, time.process_time() - cpu_start
                server_cpu = busiest(server_cpu_start, read_cpu(os.getpid()), elapsed)
                work = step_work(stats_before, await handle.stats.remote())
                if any(r["error"] or r["status"] != 200 for r in done):
                    raise RuntimeError(f"a request failed: {next(r for r in done if r['error'] or r['status'] != 200)}")
                rate = sum(r["tokens"] for r in done) / elapsed
                if rep:  # the first burst warms up, as in-process
                    row["runs"].append(round(rate, 1))
                if rep and rate > row["best"]:  # the client's own CPU: near 100% means the client set the pace
                    row.update(best=rate, client_cpu=round(cpu / elapsed, 2), server_cpu=server_cpu, step_work=work,
                               ttft=ttft_spread([r["sent"] - start + r["first_event"] for r in done]),
                               sent=round(1e3 * (max(r["sent"] for r in done) - start), 1))
        await handle.set_max_active.remote(4)
        results["ttft"], results["ttft_stages"] = {}, {}
        for num_tokens in ttft_lengths(args):
            prompts = random_prompts(args.ttft_requests + 2, num_tokens, seed=3, high=vocab)
            done = [await post_streamed(session, url, _body(model, ids, 16)) for ids in prompts][2:]
            results["ttft"][num_tokens] = statistics.median(r["first_event"] for r in done)
            results["ttft_stages"][num_tokens] = server_stages(done)
    return results


def server_stages(done: list[dict[str, Any]]) -> dict[str, float]:
    """Where lone requests' time to first token went, median milliseconds per part: each stage of
    the admission the server's `Server-Timing` names, its whole (`tandem`), and outside it, as the
    client saw: `to_headers`, from sending to the answer's headers less that whole (the client's
    request, the HTTP server's parsing and the headers' way back), and `to_first_chunk`, from the
    headers to the first chunk. Medians of parts need not add up to the median whole."""
    parts: dict[str, list[float]] = {}
    for r in done:
        for name, seconds in r["server_timing"].items():
            parts.setdefault(name, []).append(seconds)
        if "tandem" in r["server_timing"]:
            parts.setdefault("to_headers", []).append(r["headers"] - r["server_timing"]["tandem"])
            parts.setdefault("to_first_chunk", []).append(r["first_event"] - r["headers"])
    return {name: round(1e3 * statistics.median(values), 3) for name, values in parts.items()}


def _work(work: dict[str, float] | None) -> str:
    if not work:
        return "-"
    return f"{work['steps']} steps, {work['host_ms_per_step']:.3f} / {work['device_wait_ms_per_step']:.3f}"


def busiest(before: CpuReading, after: CpuReading, elapsed_s: float, top: int = 5) -> dict[str, float]:
    """The processes of the server (and the bench's own) that used the most CPU over a burst, as
    shares of one core: where a row is capped, the role near 1.0 is what caps it."""
    shares = {role: round(seconds / elapsed_s, 2) for role, seconds in cpu_used_by_role(before, after).items()}
    return dict(sorted(shares.items(), key=lambda item: -item[1])[:top])


def _capacity_client(url: str, model: str, vocab: int, rate: float, duration_s: float, start_at: float,
                     seed: int, queue: Any) -> None:
    """One client process: requests at `rate`/s (evenly spaced) for `duration_s`; latencies out."""
    import aiohttp

    async def run() -> tuple[list[float], int]:
        rng = random.Random(seed)
        latencies: list[float] = []
        errors = 0

        async def one(session: Any, due: float) -> None:
            nonlocal errors
            body = {"model": model, "prompt": [rng.randrange(3, vocab) for _ in range(32)], "max_tokens": 1,
                    "temperature": 0, "ignore_eos": True}
            await asyncio.sleep(max(0.0, due - time.time()))
            try:
                async with session.post(url, json=body) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.time() - due)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(one(session, start_at + i / rate) for i in range(int(rate * duration_s))))
        return latencies, errors

    queue.put(asyncio.run(run()))


def capacity(url: str, model: str, vocab: int, rate: float, duration_s: float, clients: int) -> dict[str, Any]:
    """`clients` processes sending `rate` short requests/s in all for `duration_s`: completed,
    errors, achieved rate and latency percentiles."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 2.0  # every client is up by then
    procs = [ctx.Process(target=_capacity_client, args=(url, model, vocab, rate / clients, duration_s, start_at,
                                                        k, queue)) for k in range(clients)]
    for p in procs:
        p.start()
    latencies, errors = [], 0
    for _ in procs:
        lat, err = queue.get()
        latencies, errors = latencies + lat, errors + err
    for p in procs:
        p.join()
    latencies.sort()
    done = len(latencies)
    span = duration_s + (latencies[-1] if latencies else 0.0)
    return {"offered_req_s": rate, "completed": done, "errors": errors,
            "achieved_req_s": round(done / span, 1) if done else 0.0,
            "p50_ms": round(1e3 * latencies[done // 2], 1) if done else None,
            "p99_ms": round(1e3 * latencies[min(done - 1, int(done * 0.99))], 1) if done else None}


def through_http(args: argparse.Namespace, vocab: int) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    import ray

    kind = "cuda" if args.device.startswith("cuda") else "sim" if args.device == "sim" else "cpu"
    max_active = max(w["max_active"] for w in workloads(args.scale, vocab))
    backend = {"device": kind, "dtype": args.dtype} if kind != "sim" else {"device": "sim", "profile": args.sim_profile}
    start = time.perf_counter()
    tandem = start_cluster(model=args.model, backends=[backend], max_active=max_active,
                           max_pending_requests=args.max_pending,
                           **({"cpu_threads": args.threads} if kind == "cpu" else {}),
                           **({"http_replicas": args.http_replicas} if args.http_replicas else {}),
                           **({"ingress": args.ingress} if args.ingress else {}))
    started_s = time.perf_counter() - start
    handle = next(iter(tandem.backends.values()))
    try:
        url = f"{tandem.url}/v1/completions"
        model = ray.get(handle.info.remote()).model_name
        results = asyncio.run(http_rows(args, url, model, vocab, handle))
        ray.get(handle.set_max_active.remote(max_active))
        curve = []
        for rate in args.capacity_rates:
            curve.append(capacity(url, model, vocab, rate, args.capacity_seconds, args.capacity_clients))
            print(f"  capacity {rate:>6.0f} req/s offered: {curve[-1]}", flush=True)
    finally:
        tandem.shutdown()
    return results, curve, started_s


def run_http(args: argparse.Namespace) -> dict[str, Any]:
    engine = in_process(args)
    http, curve, started_s = through_http(args, engine["vocab"])
    rows = []
    for name in (w["name"] for w in workloads(args.scale, engine["vocab"])):
        e, h = engine[name], http[name]
        rows.append({"workload": name, "in_process_tok_s": round(e["best"], 1), "http_tok_s": round(h["best"], 1),
                     "ratio": round(h["best"] / e["best"], 3), "in_process_tok_s_runs": e["runs"],
                     "http_tok_s_runs": h["runs"],  # the best alone flatters a noisy row
                     "ratio_of_medians": round(statistics.median(h["runs"]) / statistics.median(e["runs"]), 3),
                     "client_cpu": h.get("client_cpu"), "server_cpu": h.get("server_cpu"), "ttft_p50_max_ms": {"in_process": e["ttft"], "http": h["ttft"]},
                     "in_process_steps_mean_ms": e["steps"], "client_send_spread_ms": h.get("sent"),
                     "step_work": {"in_process": e["step_work"], "http": h.get("step_work")}})
    ttft = [{"workload": f"1 at a time ({n} -> 16), median TTFT", "prompt_tokens": n,
             "in_process_ms": round(1e3 * engine["ttft"][n], 2), "http_ms": round(1e3 * http["ttft"][n], 2),
             "difference_ms": round(1e3 * (http["ttft"][n] - engine["ttft"][n]), 2),
             "http_parts_ms": http["ttft_stages"][n]} for n in ttft_lengths(args)]
    print(f"model {args.model} on {args.device} ({args.dtype}), best of {args.repeats}; cluster up in {started_s:.1f} s")
    for r in rows:
        print(f"{r['workload']:<58} engine {r['in_process_tok_s']:>8.0f} tok/s, HTTP {r['http_tok_s']:>8.0f} "
              f"({r['ratio']:.2f}x, medians {r['ratio_of_medians']:.2f}x), client CPU {r['client_cpu'] or 0:.0%}; "
              f"TTFT p50/max ms {r['ttft_p50_max_ms']['in_process']} | {r['ttft_p50_max_ms']['http']}; "
              f"sent in {r['client_send_spread_ms']} ms")
        work = r["step_work"]
        print("  engine steps, host / device-wait ms per step: in process " + _work(work["in_process"])
              + ", behind HTTP " + _work(work["http"]))
        print(f"  busiest processes over the best HTTP burst, share of a core: "
              f"{', '.join(f'{role} {share:.2f}' for role, share in (r['server_cpu'] or {}).items())}")
    for t in ttft:
        print(f"{t['workload']}: engine {t['in_process_ms']:.2f} ms, HTTP {t['http_ms']:.2f} ms "
              f"({t['difference_ms']:+.2f})")
        print("  behind HTTP, median ms: " + ", ".join(f"{name} {ms:.2f}" for name, ms in t["http_parts_ms"].items()))
    for c in curve:
        print(f"capacity {c['offered_req_s']:.0f} req/s offered: {c['achieved_req_s']:.0f} achieved, "
              f"p50 {c['p50_ms']} ms, p99 {c['p99_ms']} ms, {c['errors']} errors")
    return {"rows": rows, "ttft": ttft, "capacity": curve, "setup": {"cluster_start_s": round(started_s, 1)}}
