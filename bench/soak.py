"""`tandem bench soak`: one server under mixed traffic for a long time; does it lose requests,
leak memory or slow down?

It starts `tandem serve` (bench/harness.py's `Server`), then C clients send bench/soak_traffic.py's
mix back to back for `--duration-s`, optionally killing one backend's process at
`--kill-backend-at-s` as a crash would (Ray restarts it). Every `--interval-s` it records
(bench/soak_probe.py) each server process's RSS and open fds, GPU memory, the KV blocks in use,
and the interval's outcomes and p50/p99. bench/soak_report.py judges the run: nothing lost or
hung, memory and p99 of the last interval against the second (the first is warm-up), no KV
block in use at idle, the server still up. Writes OUT/STEM.json, .md and .png; exits 1 if a
check fails, 2 if the server did not start, 3 if the bench broke (the report has the traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from bench import soak_probe
from bench._machine import command, machine_info
from bench.harness import Server, served_model, write_json
from bench.metrics import percentile
from bench.soak_report import checks, markdown, write_report
from bench.soak_traffic import KIND_WEIGHTS, OUTCOMES, Planner, Record, monotonic_clock, send, timeouts

IDLE_POLL_S = 2.0
CLIENT_CONNECTIONS = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--stem", default="soak", help="output file names: STEM.json, STEM.md, STEM.png (soak)")
    parser.add_argument("--model", help="passed to the server as --model (default: the server's default)")
    parser.add_argument("--flags", default="", help="other `tandem serve` flags, shell-split; write it "
                        "--flags='--backends cpu*2' (the bench owns --port and --model)")
    parser.add_argument("--duration-s", type=float, default=600.0, help="seconds of traffic (default 600)")
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds between samples (default 60)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients, back to back (default 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="most output tokens a request asks (default 32)")
    parser.add_argument("--hang-s", type=float, default=60.0,
                        help="a request with no byte for this long is hung (default 60)")
    parser.add_argument("--kill-backend-at-s", type=float, help="kill one backend's process at this second")
    parser.add_argument("--kill-backend", metavar="ID",
                        help="which backend to kill (e.g. cuda0; default: the backend actor with the lowest pid)")
    parser.add_argument("--max-rss-growth-mib", type=float, default=256.0,
                        help="bound on the server's RSS, last interval minus the second (default 256)")
    parser.add_argument("--max-gpu-growth-mib", type=float, default=256.0,
                        help="bound on the server's GPU memory, last interval minus the second (default 256)")
    parser.add_argument("--max-rss-slope-mib-per-min", type=float, default=16.0,
                        help="bound on its RSS slope from the second interval on (default 16 MiB/min)")
    parser.add_argument("--max-p99-growth", type=float, default=0.20,
                        help="bound on the last interval's p99 over the second's, minus 1 (default 0.20)")
    parser.add_argument("--idle-wait-s", type=float, default=45.0,
                        help="how long to wait for the KV gauges to read idle after the traffic (default 45)")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="sent as a bearer token (default $TANDEM_API_KEY, which the server also sees)")
    parser.add_argument("--seed", type=int, default=0, help="traffic seed (default 0)")
    parser.add_argument("--port", type=int, default=8000, help="the server's HTTP port (default 8000)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="how long the server may take to answer /health 200 (default 600)")


# -- the run -------------------------------------------------------------------------------------
class Soak:
    """One run: the server's pid, the clients' records, the samples."""

    def __init__(self, args: argparse.Namespace, server: Server, model: str, max_model_len: int) -> None:
        self.args = args
        self.server = server
        self.model = model
        self.max_model_len = max_model_len
        self.records: list[Record] = []
        self.intervals: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.clock = monotonic_clock(time.monotonic())

    async def run(self) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=CLIENT_CONNECTIONS, max_keepalive_connections=self.args.clients)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=timeouts(self.args.hang_s),
                                     limits=limits, headers=auth_headers(self.args.api_key)) as client:
            idle_start = await self.idle_kv(client, self.args.idle_wait_s)
            self.clock = monotonic_clock(time.monotonic())
            end_s = self.args.duration_s
            tasks = [asyncio.create_task(self.client_loop(client, k, end_s)) for k in range(self.args.clients)]
            sampler = asyncio.create_task(self.sample_loop(client, end_s))
            killer = asyncio.create_task(self.kill_at(self.args.kill_backend_at_s)) \
                if self.args.kill_backend_at_s is not None else None
            await asyncio.gather(*tasks)
            await sampler
            if killer is not None:
                killer.cancel()
            drained_s = self.clock()
            idle_end = await self.idle_kv(client, self.args.idle_wait_s)
        return {"idle_kv": {"start": idle_start, "end": idle_end}, "drained_at_s": round(drained_s, 1)}

    async def client_loop(self, client: httpx.AsyncClient, index: int, end_s: float) -> None:
        planner = Planner(self.model, self.max_model_len, self.args.max_tokens, seed=self.args.seed * 1000 + index)
        while self.clock() < end_s:
            self.records.append(await send(client, planner.next(), self.clock))

    async def sample_loop(self, client: httpx.AsyncClient, end_s: float) -> None:
        """A sample at the end of each interval, the last one when the traffic stops."""
        start = 0.0
        while start < end_s - 1e-6:
            stop = min(start + self.args.interval_s, end_s)
            await asyncio.sleep(max(0.0, stop - self.clock()))
            self.intervals.append(await self.sample(client, start, stop))
            start = stop

    async def sample(self, client: httpx.AsyncClient, start: float, stop: float) -> dict[str, Any]:
        done = [r for r in self.records if start <= r.end_s < stop]
        ok = [r.latency_s for r in done if r.outcome == "ok"]
        processes = soak_probe.sample_processes(self.server.proc.pid)
        gpu = soak_probe.gpu_memory_mib({p.pid for p in processes})
        row: dict[str, Any] = {
            "index": len(self.intervals), "start_s": round(start, 1), "end_s": round(stop, 1),
            "num_finished": len(done), "outcomes": {o: sum(r.outcome == o for r in done) for o in OUTCOMES},
            "p50_ms": _ms(percentile(ok, 50)), "p99_ms": _ms(percentile(ok, 99)),
            "rss_mib": soak_probe.total(processes, "rss_mib"), "num_fds": int(soak_probe.total(processes, "num_fds")),
            "rss_mib_by_process": soak_probe.by_role(processes, {p.pid: p.rss_mib for p in processes}),
            "num_fds_by_process": soak_probe.by_role(processes, {p.pid: p.num_fds for p in processes}),
            "gpu_mib": _gpu_total(gpu),
            "gpu_mib_by_process": None if gpu is None else soak_probe.by_role(processes, gpu),
            "kv": await self.kv(client),
        }
        print(_progress(row), flush=True)
        return row

    async def kv(self, client: httpx.AsyncClient) -> dict[str, dict[str, float]] | None:
        try:
            response = await client.get("/metrics")
        except httpx.HTTPError:
            return None
        return soak_probe.kv_blocks(response.text) if response.status_code == 200 else None

    async def idle_kv(self, client: httpx.AsyncClient, wait_s: float) -> dict[str, Any]:
        """The KV gauges once every backend reads 0 blocks in use, or the last read after `wait_s`
        (Ray refreshes them every few seconds, so a drained server takes that long to read idle)."""
        deadline = time.monotonic() + wait_s
        while True:
            kv = await self.kv(client)
            idle = bool(kv) and all(b["blocks_in_use"] == 0 for b in kv.values())
            if idle or time.monotonic() > deadline:
                return {"kv": kv, "idle": idle}
            await asyncio.sleep(IDLE_POLL_S)

    async def kill_at(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self.clock()))
        pids = soak_probe.backend_pids(self.server.log_text())
        killed = soak_probe.kill_a_backend(self.server.proc.pid, pids.get(self.args.kill_backend or ""))
        if killed is not None:
            killed["backend"] = next((b for b, pid in pids.items() if pid == killed["pid"]), None)
        self.kills.append({"at_s": round(self.clock(), 1), "killed": killed})
        print(f"soak: killed {killed} at {self.clock():.0f} s", flush=True)


def _gpu_total(by_pid: dict[int, float] | None) -> float | None:
    """The server's GPU memory: its processes' sum, or the whole device's use where nvidia-smi
    names none of them (the bench is then assumed to be the device's only user)."""
    if by_pid is None:
        return None
    if by_pid:
        return round(sum(by_pid.values()), 1)
    device = soak_probe.gpu_device_used_mib()
    return None if device is None else round(device, 1)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1e3 * value, 1)


def _progress(row: dict[str, Any]) -> str:
    outcomes = " ".join(f"{k}={v}" for k, v in row["outcomes"].items() if v)
    return (f"soak: [{row['start_s']:>6.0f}-{row['end_s']:>6.0f} s] {row['num_finished']} done ({outcomes}); "
            f"p50 {row['p50_ms']} ms p99 {row['p99_ms']} ms; RSS {row['rss_mib']:.0f} MiB; fds {row['num_fds']}; "
            f"GPU {row['gpu_mib']} MiB; KV {json.dumps(row['kv'])}")


def totals(records: list[Record]) -> dict[str, Any]:
    by_kind = {kind: {o: sum(r.kind == kind and r.outcome == o for r in records) for o in OUTCOMES}
               for kind in KIND_WEIGHTS}
    failures = [f"{r.kind} at {r.sent_s:.1f} s: {r.outcome}: {r.detail}" for r in records
                if r.outcome in ("lost", "hung")]
    return {"num_sent": len(records), "outcomes": {o: sum(r.outcome == o for r in records) for o in OUTCOMES},
            "by_kind": by_kind, "failure_samples": failures[:20]}


# -- the command -----------------------------------------------------------------------------------
_API_KEY_VALUE = re.compile(r"(--api-key[= ])([^\s'\"]+)")


def redacted(command: str) -> str:
    """`command` without the value of any --api-key in it (the bench's or the server's)."""
    return _API_KEY_VALUE.sub(r"\1***", command)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def run(args: argparse.Namespace) -> int:
    if args.interval_s <= 0 or args.duration_s <= 0 or args.clients < 1:
        raise SystemExit("error: --duration-s and --interval-s must be positive and --clients at least 1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": redacted(command()), "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {k: (redacted(v) if k == "flags" else str(v) if isinstance(v, Path) else v)
                     for k, v in vars(args).items()
                     if not k.startswith("_") and k not in ("bench_command", "command", "api_key")},
        "mix": KIND_WEIGHTS,
    }
    try:
        return soak_and_report(args, report, out)
    except Exception:  # noqa: BLE001 -- the report says where the bench itself broke, and the exit code is 3
        report["error"] = traceback.format_exc()
        write_json(out / f"{args.stem}.json", report)
        print(f"soak: the bench failed:\n{report['error']}", flush=True)
        return 3


def soak_and_report(args: argparse.Namespace, report: dict[str, Any], out: Path) -> int:
    soak_a_server(args, report, out)
    if "error" in report["server"]:
        write_json(out / f"{args.stem}.json", report)
        print(f"soak: the server did not serve: {report['server']['error']}; see {out / args.stem}.log", flush=True)
        return 2
    report["checks"] = checks(report, args)
    report["passed"] = all(c["passed"] is not False for c in report["checks"])
    print(markdown(report), flush=True)
    for path in write_report(report, out, args.stem):
        print(f"soak: wrote {path}", flush=True)
    return 0 if report["passed"] else 1


def soak_a_server(args: argparse.Namespace, report: dict[str, Any], out: Path) -> None:
    """Start the server, soak it, stop it; the report gets the run, or `server.error`."""
    server = Server(shlex.split(args.flags), args.port, out / f"{args.stem}.log", args.model)
    report["server"] = {"command": redacted(shlex.join(server.command))}
    print(f"soak: {report['server']['command']}", flush=True)
    server.start()
    try:
        failure = server.wait_ready(args.start_timeout_s, auth_headers(args.api_key))
        report["server"]["start_s"] = round(time.perf_counter() - server.started_at, 1)
        if failure is not None:
            report["server"]["error"] = failure
            return
        try:
            card = served_model(server.url, auth_headers(args.api_key))
            model, max_model_len = card["id"], int(card["max_model_len"])
        except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
            report["server"]["error"] = f"GET /v1/models (this bench needs the card's max_model_len): {exc}"
            return
        report.update(model=model, max_model_len=max_model_len)
        print(f"soak: up in {report['server']['start_s']} s, {model!r} (context {max_model_len}); "
              f"{args.clients} clients for {args.duration_s:.0f} s", flush=True)
        soak = Soak(args, server, model, max_model_len)
        report.update(asyncio.run(soak.run()))
        report["server"]["alive_at_end"] = server.proc.poll() is None
        report.update(intervals=soak.intervals, kills=soak.kills, totals=totals(soak.records))
    finally:
        report["server"]["stop"] = server.stop()
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
