"""`python -m bench.served_path --http`: the in-process engine against the same workloads through
`tandem serve`'s HTTP API (a real HTTP client, streaming), in one run, with the ratio per row.

Rows (the sizes scale down with --scale for a CPU smoke run):
- burst rows: N requests at once, `prompt -> max_tokens` each, at a given max_active;
  output tok/s from the first request sent to the last token received, and the burst's TTFT
  p50 and max from its start (the last admission is what the burst pays over the engine);
- the mixed row: 256 requests, prompts uniform in [64, 1024], outputs uniform in [32, 512];
- TTFT: one request at a time (516 -> 16), median time to the first token (in-process: from
  `add_request` to the step that produced it; HTTP: from sending to the first SSE event);
- capacity: short requests (prompt 32, max_tokens 1, not streamed) at fixed arrival rates from
  several client processes; achieved rate, p50 and p99 latency per offered rate.

Token-id prompts, EOS ignored, greedy. The in-process engine is freed before the cluster starts,
so both see the same device memory.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_LOW = 3  # token ids are drawn from [VOCAB_LOW, min(vocab, VOCAB_HIGH))
VOCAB_HIGH = 20000


@dataclass
class Workload:
    name: str
    max_active: int
    prompts: list[list[int]]
    max_tokens: list[int]


def workloads(scale: float, vocab: int, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, vocab) for _ in range(n)]

    def n(x: int) -> int:
        return max(1, int(x * scale))

    burst = [prompt(n(516)) for _ in range(n(48))]
    mixed_len = [rng.randint(n(64), n(1024)) for _ in range(n(256))]
    return [
        Workload(f"{len(burst)} x ({n(516)} -> {n(128)}), max_active 4", 4, burst, [n(128)] * len(burst)),
        Workload(f"{len(burst)} x ({n(516)} -> {n(128)}), max_active {n(64)}", n(64), burst, [n(128)] * len(burst)),
        Workload(f"{len(mixed_len)} x ([{n(64)}, {n(1024)}] -> [{n(32)}, {n(512)}]), max_active {n(256)}", n(256),
                 [prompt(k) for k in mixed_len], [rng.randint(n(32), n(512)) for _ in mixed_len]),
    ]


# -- in-process -------------------------------------------------------------------------------
def in_process(args: Any) -> tuple[dict[str, Any], list[Workload], list[int], int]:
    """The in-process engine's figures, measured in a child process: the server started next
    sizes its KV cache from the device's free memory, and only a process's exit reliably gives
    back everything an engine held (cached allocator blocks, graph pools)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_in_process, args).result()


def _in_process(args: Any) -> tuple[dict[str, Any], list[Workload], list[int], int]:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    max_active=max(4, int(256 * args.scale)), num_threads=args.threads))
    vocab = min(engine.model_config.vocab_size, VOCAB_HIGH)
    loads = workloads(args.scale, vocab)
    ttft_prompt = [VOCAB_LOW + (7 * j) % (vocab - VOCAB_LOW) for j in range(max(1, int(516 * args.scale)))]
    results: dict[str, Any] = {}
    for w in loads:
        engine.set_max_active(w.max_active)
        best, results[("runs", w.name)] = 0.0, []
        for rep in range(args.repeats + 1):  # the first run warms up (graphs, allocator)
            for i, (ids, m) in enumerate(zip(w.prompts, w.max_tokens)):
                engine.add_request(f"{rep}-{i}-{w.name}", ids, SamplingParams(max_tokens=m, temperature=0.0,
                                                                              ignore_eos=True))
            start, tokens, firsts, steps = time.perf_counter(), 0, {}, 0
            while engine.has_unfinished_requests():
                outs = engine.step()
                steps += 1
                now = time.perf_counter() - start
                for o in outs:
                    tokens += len(o.new_token_ids)
                    if o.new_token_ids:
                        firsts.setdefault(o.req_id, now)
            elapsed = time.perf_counter() - start
            rate = tokens / elapsed
            if rep:
                results[("runs", w.name)].append(round(rate, 1))
            if rep and rate > best:
                best, results[("ttft", w.name)] = rate, ttft_spread(list(firsts.values()))
                results[("steps", w.name)] = [steps, round(1e3 * elapsed / steps, 3)]
        results[w.name] = best
    ttfts = []
    engine.set_max_active(4)
    for i in range(args.ttft_requests + 2):
        ids = [VOCAB_LOW + (t + i) % (vocab - VOCAB_LOW) for t in ttft_prompt]  # no prefix hits between them
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.new_token_ids for o in outs):
                first = time.perf_counter() - start
        if i >= 2:
            ttfts.append(first)
    results["ttft"] = sorted(ttfts)[len(ttfts) // 2]
    return results, loads, ttft_prompt, vocab


def ttft_spread(firsts: list[float]) -> list[float]:
    """A burst's time to first token, [p50, max] in ms from the burst's start: how long the last
    request waited to be admitted is what a burst's throughput pays on top of the engine."""
    firsts = sorted(firsts)
    return [round(1e3 * firsts[len(firsts) // 2], 1), round(1e3 * firsts[-1], 1)] if firsts else [0.0, 0.0]


# -- through HTTP -----------------------------------------------------------------------------
async def _stream_one(session: Any, url: str, model: str, ids: list[int],
                      max_tokens: int) -> tuple[int, float, float]:
    """One streamed completion: (completion tokens, seconds to the first event, when it was sent)."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = None, 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if first is None:
                first = time.perf_counter() - start
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return tokens, first or 0.0, start


# Sums from the exact counters, counts from the histograms: Ray 2.60 exports a histogram's
# _sum from its bucket midpoints (a 1.15 ms step counts as 1.75 ms), so means need the counters.
STAGE_LINE = re.compile(r'^ray_tandem_http_stage_(time_seconds_total|seconds_count)\{[^}]*stage="([a-z_]+)"[^}]*\} (\S+)$')
STEP_LINE = re.compile(r'^ray_tandem_backend_(step_seconds_total|step_time_seconds_count)\{[^}]*\} (\S+)$')
STAGE_WAIT_S = 15.0  # for the ingress replicas' last observations to reach the scrape
STAGE_SETTLE_S = 1.5  # between two scrapes that must agree on the engine's step count


def scrape_stages(metrics_url: str) -> dict[str, list[float]]:
    """stage -> [seconds, count] of the admission stages over every replica, and "engine_step"
    -> the same of the backends' engine steps (sums from the exact counters)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    stages: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = STAGE_LINE.match(line)
        if match:
            kind, stage, value = match.groups()
            stages.setdefault(stage, [0.0, 0.0])[kind.endswith("count")] += float(value)
        elif (match := STEP_LINE.match(line)) is not None:
            kind, value = match.groups()
            stages.setdefault("engine_step", [0.0, 0.0])[kind.endswith("count")] += float(value)
    return stages


async def settled_scrape(metrics_url: str, num_routes: float) -> dict[str, list[float]]:
    """`scrape_stages` once it holds `num_routes` route observations and the engine's step
    count stopped moving (each process exports its metrics about once a second, so a burst's
    last steps reach the scrape after the burst ended); {} if it never does."""
    deadline = time.monotonic() + STAGE_WAIT_S
    last = None
    while time.monotonic() < deadline:
        now = await asyncio.to_thread(scrape_stages, metrics_url)
        steps = now.get("engine_step", [0.0, 0.0])[1]
        if now.get("route", [0.0, 0.0])[1] >= num_routes and steps == last:
            return now
        last = steps
        await asyncio.sleep(STAGE_SETTLE_S)
    return {}


def stage_means(before: dict[str, list[float]],
                after: dict[str, list[float]]) -> tuple[dict[str, float], list | None]:
    """Between two settled scrapes: mean ms per admission stage (cluster/dispatch.py's
    `admission_stages`), and [engine steps, mean ms per step]; ({}, None) without them."""
    if not before or not after:
        return {}, None
    delta = {k: [x - y for x, y in zip(v, before.get(k, (0.0, 0.0)))] for k, v in after.items()}
    step_total, num_steps = delta.pop("engine_step", (0.0, 0.0))
    stages = {k: round(1e3 * total / n, 2) for k, (total, n) in delta.items() if n}
    return stages, ([int(num_steps), round(1e3 * step_total / num_steps, 2)] if num_steps else None)


async def _http_rows(args: Any, url: str, model: str, loads: list[Workload], ttft_prompt: list[int],
                     vocab: int, set_max_active: Any, metrics_url: str) -> dict[str, Any]:
    import aiohttp

    results: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        results["client_cpu"] = {}
        for w in loads:
            await set_max_active(w.max_active)
            best, results[("runs", w.name)] = 0.0, []
            before = await settled_scrape(metrics_url, 0)
            for rep in range(args.repeats + 1):
                start, cpu_start = time.perf_counter(), time.process_time()
                done = await asyncio.gather(*(_stream_one(session, url, model, ids, m)
                                              for ids, m in zip(w.prompts, w.max_tokens)))
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                rate = sum(t for t, _, _ in done) / elapsed
                if rep:  # the first burst warms up, as in-process
                    results[("runs", w.name)].append(round(rate, 1))
                after = await settled_scrape(metrics_url, before.get("route", [0.0, 0.0])[1] + len(w.prompts))
                if rep and rate > best:  # the client's own CPU: near 100% means the client sets the pace
                    best, results["client_cpu"][w.name] = rate, round(cpu / elapsed, 2)
                    results[("ttft", w.name)] = ttft_spread([sent - start + first for _, first, sent in done])
                    # how long this one client took to send the burst: a part of the TTFTs above
                    # that is the client's, not the server's
                    results[("sent", w.name)] = round(1e3 * (max(sent for _, _, sent in done) - start), 1)
                    results[("stages", w.name)], results[("steps", w.name)] = stage_means(before, after)
                before = after
            results[w.name] = best
        await set_max_active(4)
        ttfts = []
        for i in range(args.ttft_requests + 2):
            ids = [VOCAB_LOW + (t + i + 7919) % (vocab - VOCAB_LOW) for t in ttft_prompt]
            _, first, _ = await _stream_one(session, url, model, ids, 16)
            if i >= 2:
                ttfts.append(first)
        results["ttft"] = sorted(ttfts)[len(ttfts) // 2]
    return results


async def ttft_parts(router: Any, backend: Any, prompt: list[int], vocab: int, num: int) -> dict[str, float]:
    """Where a lone request's TTFT goes outside the engine, median ms of `num` requests, from
    this process (no HTTP): Ray's round trip to the backend actor (`ping`), to the router
    (`router_ping`) and on through the pipe to the backend's engine core (`stats`), then one
    request's route (`place`), admission (which returns with its prefill step) and first output
    over the backend's channel."""
    from tandem.actors.channel import open_stream
    from tandem.actors.messages import PlaceRequest
    from tandem.engine.sampling_params import SamplingParams

    def median_ms(xs: list[float]) -> float:
        return round(1e3 * sorted(xs)[len(xs) // 2], 3)

    parts: dict[str, list[float]] = {k: [] for k in ("ping", "router_ping", "core_call", "place", "admit",
                                                      "first_output")}
    for i in range(num + 2):  # the first two of each are warm-ups, left out
        for key, call in (("ping", backend.ping), ("router_ping", router.ping), ("core_call", backend.stats)):
            t0 = time.perf_counter()
            await call.remote()
            if i >= 2:
                parts[key].append(time.perf_counter() - t0)
    for i in range(num + 2):
        ids = [VOCAB_LOW + (t + i + 104729) % (vocab - VOCAB_LOW) for t in prompt]
        req_id = f"ttft-parts-{i}"
        t0 = time.perf_counter()
        await router.place_many.remote([(PlaceRequest(req_id, ids, 16),)])
        t1 = time.perf_counter()
        stream = open_stream(backend, req_id, ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                             time.time())
        await stream.next()
        t2 = time.perf_counter()
        out = await stream.next()
        t3 = time.perf_counter()
        while not out.finished:
            out = await stream.next()
        router.forget.remote(req_id)
        if i >= 2:
            for key, value in (("place", t1 - t0), ("admit", t2 - t1), ("first_output", t3 - t2)):
                parts[key].append(value)
    return {k: median_ms(v) for k, v in parts.items()}


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
            body = {"model": model, "prompt": [rng.randrange(VOCAB_LOW, vocab) for _ in range(32)],
                    "max_tokens": 1, "temperature": 0, "ignore_eos": True}
            delay = due - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
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

        count = int(rate * duration_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(one(session, start_at + i / rate) for i in range(count)))
        return latencies, errors

    queue.put(asyncio.run(run()))


def start_capacity_clients(url: str, model: str, vocab: int, rate: float, duration_s: float,
                           clients: int, start_at: float) -> tuple[list, Any]:
    """`clients` processes sending `rate` short requests/s in all from `start_at` for `duration_s`."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_capacity_client, args=(url, model, vocab, rate / clients, duration_s, start_at,
                                                        k, queue)) for k in range(clients)]
    for p in procs:
        p.start()
    return procs, queue


def collect_capacity(procs: list, queue: Any, duration_s: float) -> dict[str, Any]:
    """Wait for the clients; completed, errors, achieved rate and latency percentiles."""
    latencies, errors = [], 0
    for _ in procs:
        lat, err = queue.get()
        latencies += lat
        errors += err
    for p in procs:
        p.join()
    latencies.sort()
    done = len(latencies)
    span = duration_s + (latencies[-1] if latencies else 0.0)
    return {"completed": done, "errors": errors,
            "achieved_req_s": round(done / span, 1) if done else 0.0,
            "p50_ms": round(1e3 * latencies[done // 2], 1) if done else None,
            "p99_ms": round(1e3 * latencies[min(done - 1, int(done * 0.99))], 1) if done else None}


def capacity(url: str, model: str, vocab: int, rates: list[float], duration_s: float,
             clients: int) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        start_at = time.time() + 2.0  # every client is up by then
        procs, queue = start_capacity_clients(url, model, vocab, rate, duration_s, clients, start_at)
        rows.append({"offered_req_s": rate, **collect_capacity(procs, queue, duration_s)})
        print(f"  capacity {rate:>6.0f} req/s offered: {rows[-1]}", flush=True)
    return rows


def through_http(args: Any, loads: list[Workload], ttft_prompt: list[int],
                 vocab: int) -> tuple[dict[str, Any], list, dict]:
    import ray

    from tandem import cluster

    # The admission stages are read from the metrics page after each row: Ray's agent exports
    # every 10 s by default, which would be a 10 s wait per row.
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    tmp = Path(tempfile.mkdtemp(prefix="tandem-served-http-"))
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    (tmp / "rates.json").write_text(json.dumps({kind: {"prefill_tok_s": 20000.0, "decode_tok_s": 500.0}}))
    port = args.port or _free_port()
    overrides = dict(model=args.model, backends=[{"device": kind, "dtype": args.dtype}],
                     max_active=max(w.max_active for w in loads), serve_http=True, port=port,
                     metrics_port=_free_port(), rates=str(tmp / "rates.json"), rates_cache=str(tmp / "rc.json"),
                     profile="never", warmup_tokens=0,  # no routing log: `tandem serve`'s default
                     max_pending_requests=args.max_pending, access_log=False, log=lambda line: None)
    if kind == "cpu":
        overrides["cpu_threads"] = args.threads
    if args.http_replicas:
        overrides["http_replicas"] = args.http_replicas
    if getattr(args, "ingress", None):
        overrides["ingress"] = args.ingress
    start = time.perf_counter()
    tandem = cluster.start(**overrides)
    setup = {"cluster_start_s": round(time.perf_counter() - start, 1)}
    handle = next(iter(tandem.backends.values()))

    async def set_max_active(n: int) -> None:
        await handle.set_max_active.remote(n)

    try:
        url = f"{tandem.url}/v1/completions"
        model = ray.get(handle.info.remote()).model_name
        results = asyncio.run(_http_rows(args, url, model, loads, ttft_prompt, vocab, set_max_active,
                                         f"{tandem.url}/metrics"))
        results["ttft_parts"] = asyncio.run(ttft_parts(tandem.router, handle, ttft_prompt, vocab, args.ttft_requests))
        curve = []
        if args.capacity_rates:
            ray.get(handle.set_max_active.remote(max(w.max_active for w in loads)))
            rates = [float(r) for r in args.capacity_rates.split(",")]
            curve = capacity(url, model, vocab, rates, args.capacity_seconds, args.capacity_clients)
    finally:
        tandem.shutdown()
    return results, curve, setup


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: Any) -> dict[str, Any]:
    engine, loads, ttft_prompt, vocab = in_process(args)
    http, curve, setup = through_http(args, loads, ttft_prompt, vocab)
    rows = [{"workload": w.name, "in_process_tok_s": round(engine[w.name], 1), "http_tok_s": round(http[w.name], 1),
             "ratio": round(http[w.name] / engine[w.name], 3),
             # every repeat's rate, and the ratio of the medians: the best alone flatters a noisy row
             "in_process_tok_s_runs": engine[("runs", w.name)], "http_tok_s_runs": http[("runs", w.name)],
             "ratio_of_medians": round(statistics.median(http[("runs", w.name)])
                                       / statistics.median(engine[("runs", w.name)]), 3),
             "client_cpu": http["client_cpu"].get(w.name),
             "ttft_p50_max_ms": {"in_process": engine[("ttft", w.name)], "http": http[("ttft", w.name)]},
             "admission_stages_mean_ms": http.get(("stages", w.name), {}),
             # [engine steps, mean ms per step] of the burst: more or slower steps behind HTTP
             # than in-process are what the stream phase, not the admission, pays
             "engine_steps_mean_ms": {"in_process": engine.get(("steps", w.name)), "http": http.get(("steps", w.name))},
             "client_send_spread_ms": http.get(("sent", w.name))}
            for w in loads]
    ttft = {"workload": f"1 at a time ({len(ttft_prompt)} -> 16), median TTFT",
            "in_process_ms": round(1e3 * engine["ttft"], 2), "http_ms": round(1e3 * http["ttft"], 2),
            "difference_ms": round(1e3 * (http["ttft"] - engine["ttft"]), 2), "parts_ms": http["ttft_parts"]}
    print(f"model {args.model} on {args.device} ({args.dtype}), best of {args.repeats}; {setup}")
    print(f"{'workload':<58} {'engine tok/s':>12} {'HTTP tok/s':>11} {'ratio':>6} {'median':>6} {'client CPU':>10} "
          f"{'TTFT p50/max ms: engine':>24} {'HTTP':>11}")
    for r in rows:
        spread = r["ttft_p50_max_ms"]
        print(f"{r['workload']:<58} {r['in_process_tok_s']:>12.0f} {r['http_tok_s']:>11.0f} {r['ratio']:>6.2f} "
              f"{r['ratio_of_medians']:>6.2f} {r['client_cpu'] or 0:>9.0%} {'/'.join(map(str, spread['in_process'])):>24} "
              f"{'/'.join(map(str, spread['http'])):>11}")
    print("  HTTP arrival to admission, mean ms per stage (tandem_http_stage_time_seconds), and the client's own")
    print("  time to send the burst:")
    for r in rows:
        stages = r["admission_stages_mean_ms"]
        print(f"    {r['workload']:<56} " + (", ".join(f"{k} {v:.1f}" for k, v in stages.items()) or "not scraped")
              + f"; sent in {r['client_send_spread_ms']} ms")
    print("  engine steps of the burst and mean ms per step, in-process | behind HTTP:")
    for r in rows:
        steps = r["engine_steps_mean_ms"]
        print(f"    {r['workload']:<56} " + " | ".join("-" if v is None else f"{v[0]} steps, {v[1]:.3f} ms"
                                                      for v in (steps["in_process"], steps["http"])))
    print(f"{ttft['workload']:<58} {ttft['in_process_ms']:>9.2f} ms {ttft['http_ms']:>8.2f} ms "
          f"{ttft['difference_ms']:>+6.2f} ms")
    print("  TTFT parts outside the engine, median ms (Python driver, no HTTP): "
          + ", ".join(f"{k} {v:.2f}" for k, v in ttft["parts_ms"].items()))
    if curve:
        print(f"capacity (prompt 32, max_tokens 1, {args.capacity_clients} client processes, "
              f"{args.capacity_seconds:g} s per rate):")
        print(f"{'offered req/s':>14} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
        for c in curve:
            print(f"{c['offered_req_s']:>14.0f} {c['achieved_req_s']:>9.0f} {c['p50_ms'] or 0:>8.1f} "
                  f"{c['p99_ms'] or 0:>8.1f} {c['errors']:>7}")
    return {"rows": rows, "ttft": ttft, "capacity": curve, "setup": setup}
