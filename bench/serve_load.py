"""`tandem bench serve-load`: server configurations compared through the real HTTP endpoint.

Each `--config NAME='FLAGS'` is started as a user starts Tandem (bench/harness.py's `Server`),
loaded, and stopped with Ctrl-C (a clean exit is recorded), one after another on one port. The
load is a closed loop: C clients, each sending its next streamed request as soon as the last
finished, so it measures what a server sustains at that concurrency. One client process tops
out near 38k tokens/s, so the clients are spread over P processes drawing from one shared
counter (`--clients-procs`, default min(8, max(1, C // 32))), each row recording every
process's CPU share. A 429 is counted, not retried. Workloads (bench/workload.py): `fixed`,
max(256, 4 C) x (516 -> 128); `nanovllm`; `w`. Per row: output tok/s from the first send to the
last finish, requests ok, refused and failed, TTFT p50/p95 and E2E p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

from bench._machine import stamp
from bench.client import post_streamed
from bench.harness import Server, ints, served_model, write_json
from bench.metrics import percentile
from bench.workload import W, nanovllm_requests, random_prompts, varied_requests

WORKLOADS = ("fixed", "nanovllm", "w")
NOISE = ("pid=", "INFO", "Warning")  # log lines left out of the recorded start-up lines
MAX_ERROR_SAMPLES = 5
Request = tuple[list[int], int]  # (prompt token ids, max_tokens)


def make_workload(name: str, clients: int, num_requests: int | None = None, prompt_len: int = 516,
                  max_tokens: int = 128) -> list[Request]:
    if name == "fixed":
        num = num_requests if num_requests is not None else max(256, 4 * clients)
        # prompts of their own for each concurrency: a row must not hit the prefixes an earlier row cached
        return [(prompt, max_tokens) for prompt in random_prompts(num, prompt_len, seed=clients)]
    if name == "nanovllm":
        return nanovllm_requests(num_requests or 256)
    if name == "w":
        return varied_requests(num_requests or W[0], W[1], W[2], seed=0)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def default_client_procs(clients: int) -> int:
    return min(8, max(1, clients // 32))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's numbers from its requests (bench/client.py's `post_streamed` records). Succeeded:
    status 200 and no error; refused: 429; anything else failed. Wall time runs from the first
    send to the last finish, over every request; tokens count every request's."""
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    refused = sum(1 for r in records if r["status"] == 429)
    errors = [r for r in records if not (r["status"] == 200 and r["error"] is None) and r["status"] != 429]
    tokens = sum(r["tokens"] for r in records)
    wall = (max(r["sent"] + r["e2e"] for r in records) - min(r["sent"] for r in records)) if records else 0.0
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2es = [r["e2e"] for r in ok]
    # one stream's decode speed: its tokens after the first over the time after the first
    streams = [(r["tokens"] - 1) / (r["e2e"] - r["ttft"]) for r in ok
               if r["ttft"] is not None and r["tokens"] > 1 and r["e2e"] > r["ttft"]]
    samples: list[str] = []
    for r in errors:
        text = r["error"] or f"HTTP {r['status']}"
        if text not in samples and len(samples) < MAX_ERROR_SAMPLES:
            samples.append(text)
    return {"num_requests": len(records), "ok": len(ok), "refused_429": refused, "errors": len(errors),
            "output_tokens": tokens, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1) if wall > 0 else 0.0,
            "ttft_p50_ms": _round(percentile(ttfts, 50), 1, 1e3), "ttft_p95_ms": _round(percentile(ttfts, 95), 1, 1e3),
            "e2e_p50_s": _round(percentile(e2es, 50), 3), "stream_tok_s_p50": _round(percentile(streams, 50), 1),
            "error_samples": samples}


def _round(value: float | None, digits: int, scale: float = 1.0) -> float | None:
    return None if value is None else round(scale * value, digits)


# -- the clients ---------------------------------------------------------------------------------
async def _client_loop(url: str, model: str, headers: dict[str, str], requests: list[Request], num_clients: int,
                       next_index: Any, ready: Any, go: Any, timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    import aiohttp

    def take() -> int | None:
        with next_index.get_lock():
            index = next_index.value
            if index >= len(requests):
                return None
            next_index.value = index + 1
            return index

    records: list[dict[str, Any]] = []

    async def client(session: Any) -> None:
        while (index := take()) is not None:
            prompt, max_tokens = requests[index]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            record = await post_streamed(session, url, body, headers)
            record["index"] = index
            records.append(record)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        ready.put(os.getpid())
        go.wait()  # every client process starts together
        cpu = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(num_clients)))
        cpu_share = (time.process_time() - cpu) / max(time.perf_counter() - start, 1e-9)
    return records, cpu_share


def _client_process(url: str, model: str, headers: dict[str, str], requests: list[Request], num_clients: int,
                    next_index: Any, ready: Any, go: Any, results: Any, timeout_s: float) -> None:
    """One client OS process: `num_clients` closed-loop clients drawing from the shared counter."""
    try:
        records, cpu_share = asyncio.run(_client_loop(url, model, headers, requests, num_clients, next_index,
                                                      ready, go, timeout_s))
        results.put((os.getpid(), records, cpu_share, None))
    except BaseException as exc:  # reported to the parent, which would otherwise wait for nothing
        ready.put(os.getpid())
        results.put((os.getpid(), [], 0.0, f"{type(exc).__name__}: {exc}"))


def split_clients(clients: int, procs: int) -> list[int]:
    """`clients` spread over `procs` processes as evenly as possible (none empty)."""
    procs = max(1, min(procs, clients))
    return [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]


def run_load(url: str, model: str, requests: list[Request], clients: int, procs: int, timeout_s: float,
             headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], list[float]]:
    """The closed loop: every request's record, and each client process's CPU share."""
    ctx = multiprocessing.get_context("spawn")
    next_index = ctx.Value("q", 0)
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(url, model, headers or {}, requests, n, next_index, ready, go, results, timeout_s))
               for n in split_clients(clients, procs)]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        go.set()
        records: list[dict[str, Any]] = []
        cpu_shares: list[float] = []
        failures: list[str] = []
        pending = len(workers)
        while pending:
            try:
                _, got, cpu_share, failure = results.get(timeout=1.0)
            except Exception:  # queue.Empty: check that no worker died without reporting
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process died (exit code {dead[0].exitcode})") from None
                continue
            pending -= 1
            records += got
            cpu_shares.append(round(cpu_share, 2))
            if failure:
                failures.append(failure)
        if failures:
            raise RuntimeError(f"a client process failed: {failures[0]}")
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    records.sort(key=lambda r: r["index"])
    return records, cpu_shares


def startup_lines(log_text: str) -> list[str]:
    """The console's lines that say something: not Ray's per-process lines or INFO or warnings."""
    return [line.rstrip() for line in log_text.splitlines()
            if line.strip() and not any(noise in line for noise in NOISE)]


def parse_config(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
        raise argparse.ArgumentTypeError(f"--config wants NAME='FLAGS' with NAME of letters, digits, . _ -; "
                                         f"got {text!r}")
    try:
        return name, shlex.split(flags)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--config {name}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", type=parse_config, required=True, metavar="NAME='FLAGS'",
                        help="a server configuration: `tandem serve` flags (shell-split); repeat to compare")
    parser.add_argument("--workload", type=lambda t: t.split(","), default=["fixed"],
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default fixed)")
    parser.add_argument("--clients", type=ints, default=[64, 256], help="closed-loop concurrencies (default 64,256)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (logs, serve_load.json)")
    parser.add_argument("--model", help="passed to every server as --model (default: the server's default)")
    parser.add_argument("--clients-procs", type=int, help="client OS processes (default min(8, max(1, C // 32)))")
    parser.add_argument("--port", type=int, default=8000, help="the servers' HTTP port (default 8000)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="one request's limit (default 600)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="how long a server may take to answer /health 200 (default 600)")
    parser.add_argument("--num-requests", type=ints, help="requests per run, one value or one per --clients "
                        "value (default: fixed max(256, 4 C), nanovllm 256, w 512)")
    parser.add_argument("--prompt-len", type=int, default=516, help="fixed workload's prompt tokens (516)")
    parser.add_argument("--max-tokens", type=int, default=128, help="fixed workload's output tokens (128)")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="sent as a bearer token (default $TANDEM_API_KEY, which the servers also see)")


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


TABLE_HEADER = (f"{'config':<16} {'workload':<9} {'C':>5} {'P':>2} {'N':>5} {'ok':>5} {'429':>5} {'err':>4} "
                f"{'tok/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'E2E p50':>8} {'stream':>7}")


def table_row(row: dict[str, Any]) -> str:
    if row.get("failed"):
        return f"{row['config']:<16} {row['workload']:<9} {row['clients']:>5}  {row['failed']}"
    return (f"{row['config']:<16} {row['workload']:<9} {row['clients']:>5} {row['client_procs']:>2} "
            f"{row['num_requests']:>5} {row['ok']:>5} {row['refused_429']:>5} {row['errors']:>4} "
            f"{row['output_tok_s']:>9.1f} {_fmt(row['ttft_p50_ms'], '.1f'):>7}ms {_fmt(row['ttft_p95_ms'], '.1f'):>7}ms "
            f"{_fmt(row['e2e_p50_s'], '.2f'):>7}s {_fmt(row.get('stream_tok_s_p50'), '.1f'):>7}")


def run(args: argparse.Namespace) -> int:
    names = [name for name, _ in args.config]
    unknown = [w for w in args.workload if w not in WORKLOADS]
    if len(set(names)) != len(names) or unknown:
        raise SystemExit(f"error: --config names must differ; workloads are {', '.join(WORKLOADS)}")
    out: Path = args.out
    (out / "requests").mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report: dict[str, Any] = {
        **stamp(), "settings": {k: getattr(args, k) for k in ("workload", "clients", "model", "num_requests",
                                                             "prompt_len", "max_tokens", "timeout_s", "port")},
        "configs": [], "rows": []}
    for name, flags in args.config:
        server = Server(flags, args.port, out / f"{name}.log", args.model)
        entry: dict[str, Any] = {"name": name, "flags": shlex.join(flags), "command": shlex.join(server.command)}
        report["configs"].append(entry)
        print(f"\n[{name}] {entry['command']}", flush=True)
        server.start()
        try:
            failure = server.wait_ready(args.start_timeout_s, headers)
            entry["start_s"] = round(time.perf_counter() - server.started_at, 1)
            entry["startup_lines"] = startup_lines(server.log_text())
            if failure is None:
                try:
                    entry["model"] = served_model(server.url, headers)["id"]
                except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                    failure = str(exc)
            entry["started"] = failure is None
            if failure is not None:
                entry["error"] = failure
                print(f"[{name}] failed to start: {failure}; the log's last lines:\n    "
                      + "\n    ".join(entry["startup_lines"][-15:]), flush=True)
                report["rows"] += [{"config": name, "workload": w, "clients": c, "failed": f"server did not start: {failure}"}
                                   for w in args.workload for c in args.clients]
                write_json(out / "serve_load.json", report)
                continue
            print(f"[{name}] up in {entry['start_s']} s, model {entry['model']!r}", flush=True)
            for workload in args.workload:
                for clients in args.clients:
                    report["rows"].append(load_row(args, server, entry, workload, clients, headers))
                    write_json(out / "serve_load.json", report)
                    print(TABLE_HEADER + "\n" + table_row(report["rows"][-1]), flush=True)
        finally:
            entry["stop"] = server.stop()
            entry["shutdown_lines"] = startup_lines(server.log_text())[len(entry.get("startup_lines", [])):][-30:]
            write_json(out / "serve_load.json", report)
            print(f"[{name}] stopped: {'cleanly' if entry['stop']['clean'] else 'NOT cleanly'} ({entry['stop']})",
                  flush=True)
    print("\n" + "\n".join([TABLE_HEADER] + [table_row(row) for row in report["rows"]]))
    print(f"\nwrote {out / 'serve_load.json'}")
    return 1 if any(r.get("failed") for r in report["rows"]) else 0


def num_requests_for(args: argparse.Namespace, clients: int) -> int | None:
    """--num-requests for this concurrency: its one value, or the one at the concurrency's place."""
    counts = args.num_requests
    if not counts:
        return None
    if len(counts) == 1:
        return counts[0]
    if len(counts) != len(args.clients):
        raise SystemExit("error: --num-requests takes one value or one per --clients value")
    return counts[args.clients.index(clients)]


def load_row(args: argparse.Namespace, server: Server, entry: dict[str, Any], workload: str, clients: int,
             headers: dict[str, str]) -> dict[str, Any]:
    requests = make_workload(workload, clients, num_requests_for(args, clients), args.prompt_len, args.max_tokens)
    procs = min(args.clients_procs or default_client_procs(clients), clients)
    print(f"[{entry['name']}] {workload}: {len(requests)} requests, {clients} clients over {procs} process(es) ...",
          flush=True)
    row: dict[str, Any] = {"config": entry["name"], "workload": workload, "clients": clients, "client_procs": procs}
    try:
        records, cpu_shares = run_load(server.url + "/v1/completions", entry["model"], requests, clients, procs,
                                       args.timeout_s, headers)
    except RuntimeError as exc:
        row["failed"] = str(exc)
    else:
        path = args.out / "requests" / f"{entry['name']}-{workload}-c{clients}.json"
        path.write_text(json.dumps(records))
        row.update(summarize(records), client_cpu_share=cpu_shares, prompt_tokens=sum(len(p) for p, _ in requests),
                   max_tokens=sum(m for _, m in requests), requests_file=str(path))
    row["server_alive"] = server.proc.poll() is None
    return row
