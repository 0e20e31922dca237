"""Where a served request's CPU goes: every process on the serving path, under a steady load.

`python -m bench.served_path --http` says how far the HTTP endpoint falls behind the engine; this
says which process holds it back. It starts `tandem serve`'s stack (one backend), drives a
steady load through the real endpoint, and meanwhile

- reads each process's CPU time from /proc (Serve's HTTP proxy, the ingress replicas, the
  router actor, the backend actor, its engine core, the raylet and the GCS), so a process near
  100% of a core is the serial resource that caps the request rate;
- samples each Python process's stacks while it holds the GIL with py-spy (`pip install
  py-spy`; skipped with a note when it is missing or may not attach), and prints the functions
  that hold the most samples, by self time and by inclusive time.

Loads: `short` (prompt 32, max_tokens 1, not streamed: the per-request cost) at `--rate`
requests/s from several client processes, or `stream` (bursts of `--burst` streamed
516 -> 128 requests back to back: the per-token cost).

    python -m bench.served_profile --model qwen2.5-0.5b-random --device cuda --dtype bfloat16 \
        --load short --rate 1000 --seconds 6 --out out/served_profile

`--ingress direct|proxy` picks how HTTP reaches the ingress replica (`tandem serve --ingress`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.served_http import VOCAB_LOW, _free_port, _stream_one, collect_capacity, start_capacity_clients

ROLES = (  # (role, what its command line contains), first match wins
    ("proxy", "ray::ProxyActor"),
    ("ingress", "ray::ServeReplica"),
    ("router", "ray::RouterActor"),
    ("backend", "ray::BackendActor"),
    ("controller", "ray::ServeController"),
    ("raylet", "raylet"),
    ("gcs", "gcs_server"),
)
PY_ROLES = {"proxy", "ingress", "router", "backend", "engine-core"}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama-random")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads of a cpu backend")
    p.add_argument("--max-active", type=int, default=64)
    p.add_argument("--http-replicas", type=int, default=0, help="0: tandem serve's default")
    p.add_argument("--ingress", choices=("auto", "direct", "proxy"), default="auto")
    p.add_argument("--load", choices=("short", "stream"), default="short")
    p.add_argument("--rate", type=float, default=300.0, help="short: offered requests/s")
    p.add_argument("--clients", type=int, default=4, help="short: client processes")
    p.add_argument("--burst", type=int, default=48, help="stream: requests per burst")
    p.add_argument("--prompt-len", type=int, default=516, help="stream: prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="stream: output tokens")
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--seconds", type=float, default=6.0, help="measured window")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the window")
    p.add_argument("--py-spy-rate", type=int, default=200, help="samples/s per process (0: off)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path("out/served_profile"))
    return p.parse_args(argv)


# -- processes ------------------------------------------------------------------------------
def serving_processes() -> dict[int, str]:
    """pid -> role of every process on the serving path (this user's)."""
    found, parents = {}, {}
    for line in subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines():
        pid, ppid, cmd = line.split(None, 2)
        parents[int(pid)] = (int(ppid), cmd)
        for role, needle in ROLES:
            if needle in cmd:
                found[int(pid)] = role
                break
    for pid, (ppid, cmd) in parents.items():  # the engine core: a spawned child of a backend actor
        if found.get(ppid) == "backend" and "multiprocessing" in cmd:
            found[pid] = "engine-core"
    return found


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def start_py_spy(procs: dict[int, str], seconds: float, rate: int, out: Path) -> list[tuple[int, Path, Any]]:
    exe = shutil.which("py-spy")
    if exe is None or rate <= 0:
        print("py-spy: not installed or off; CPU shares only")
        return []
    runs = []
    for pid, role in procs.items():
        if role in PY_ROLES:
            path = out / f"stacks-{role}-{pid}.txt"
            cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", str(rate),
                   "--format", "raw", "--nonblocking", "--gil", "--output", str(path)]
            runs.append((pid, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    return runs


def summarize_stacks(path: Path, top: int) -> dict[str, Any]:
    """Self and inclusive sample counts per function from py-spy's collapsed stacks."""
    self_counts: collections.Counter = collections.Counter()
    incl_counts: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";")]
        total += n
        self_counts[frames[-1]] += n
        for frame in set(frames):
            incl_counts[frame] += n
    return {"samples": total, "self": self_counts.most_common(top), "inclusive": incl_counts.most_common(top)}


def _short(frame: str) -> str:
    """`fn (path/to/file.py:123)` -> `fn (file.py)`; thread-name frames stay as they are."""
    name, _, where = frame.partition(" (")
    file = where.split(":")[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


# -- loads ----------------------------------------------------------------------------------
def run_short(url: str, model: str, args: argparse.Namespace, vocab: int) -> Any:
    duration = args.warmup + args.seconds + 1.0
    start_at = time.time() + 2.0
    procs, queue = start_capacity_clients(url, model, vocab, args.rate, duration, args.clients, start_at)
    return start_at, lambda: collect_capacity(procs, queue, duration)


def run_stream(url: str, model: str, args: argparse.Namespace, vocab: int) -> Any:
    import threading

    result: dict[str, Any] = {}
    start_at = time.time() + 0.5
    stop_at = start_at + args.warmup + args.seconds + 1.0

    async def loop() -> None:
        import aiohttp

        rng = __import__("random").Random(0)
        tokens, bursts = 0, 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            while time.time() < stop_at:
                prompts = [[rng.randrange(VOCAB_LOW, vocab) for _ in range(args.prompt_len)]
                           for _ in range(args.burst)]
                t0 = time.perf_counter()
                done = await asyncio.gather(*(_stream_one(session, url, model, ids, args.max_tokens) for ids in prompts))
                tokens += sum(t for t, _, _ in done)
                bursts += 1
                result.setdefault("burst_s", []).append(round(time.perf_counter() - t0, 3))
        result.update(tokens=tokens, bursts=bursts)

    thread = threading.Thread(target=lambda: asyncio.run(loop()), daemon=True)
    thread.start()

    def collect() -> dict[str, Any]:
        thread.join()
        s = sorted(result.get("burst_s", [0.0]))
        result["median_burst_tok_s"] = round(args.burst * args.max_tokens / s[len(s) // 2], 1) if s[0] else 0.0
        return result

    return start_at, collect


# -- main -----------------------------------------------------------------------------------
def start_cluster(args: argparse.Namespace, tmp: Path) -> tuple[Any, str]:
    from tandem import cluster

    port = _free_port()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    (tmp / "rates.json").write_text(json.dumps({kind: {"prefill_tok_s": 20000.0, "decode_tok_s": 500.0}}))
    overrides = dict(model=args.model, backends=[{"device": kind, "dtype": args.dtype}], max_active=args.max_active,
                     serve_http=True, port=port, metrics_port=_free_port(), rates=str(tmp / "rates.json"),
                     rates_cache=str(tmp / "rc.json"), profile="never",
                     warmup_tokens=0, access_log=False, http_replicas=args.http_replicas, ingress=args.ingress,
                     log=lambda line: None)
    if kind == "cpu":
        overrides["cpu_threads"] = args.threads
    tandem = cluster.start(**overrides)
    return tandem, tandem.url


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-served-profile-"))
    tandem, url = start_cluster(args, tmp)
    try:
        handle = next(iter(tandem.backends.values()))
        info = ray.get(handle.info.remote())
        vocab = args.vocab
        load = run_short if args.load == "short" else run_stream
        start_at, collect = load(f"{url}/v1/completions", info.model_name, args, vocab)
        time.sleep(max(0.0, start_at + args.warmup - time.time()))
        procs = serving_processes()
        before = {pid: cpu_seconds(pid) for pid in procs}
        spies = start_py_spy(procs, args.seconds, args.py_spy_rate, args.out)
        t0 = time.time()
        time.sleep(args.seconds)
        elapsed = time.time() - t0
        after = {pid: cpu_seconds(pid) for pid in procs}
        for _, _, proc in spies:
            proc.wait(timeout=60)
        outcome = collect()
    finally:
        tandem.shutdown()
    report = build_report(args, procs, before, after, elapsed, spies, outcome)
    (args.out / "served_profile.json").write_text(json.dumps(report, indent=1))
    print_report(report)
    return 0


def build_report(args, procs, before, after, elapsed, spies, outcome) -> dict[str, Any]:
    cpu = []
    for pid, role in procs.items():
        if before.get(pid) is None or after.get(pid) is None:
            continue
        cpu.append({"role": role, "pid": pid, "cpu_pct": round(100 * (after[pid] - before[pid]) / elapsed, 1)})
    cpu.sort(key=lambda r: -r["cpu_pct"])
    stacks = {}
    for pid, path, proc in spies:
        if path.exists():
            stacks[f"{procs[pid]}-{pid}"] = summarize_stacks(path, args.top)
        else:
            stacks[f"{procs[pid]}-{pid}"] = {"error": proc.stderr.read().decode()[-300:]}
    return {"args": {k: str(v) for k, v in vars(args).items()}, "outcome": outcome, "cpu": cpu, "stacks": stacks}


def print_report(report: dict[str, Any]) -> None:
    print(f"load: {report['args']['load']}  outcome: {report['outcome']}")
    print(f"{'process':<14} {'pid':>7} {'CPU %':>7}")
    for r in report["cpu"]:
        print(f"{r['role']:<14} {r['pid']:>7} {r['cpu_pct']:>7.1f}")
    for name, s in report["stacks"].items():
        if "error" in s:
            print(f"\n{name}: py-spy failed: {s['error']}")
            continue
        print(f"\n{name}: {s['samples']} samples; self | inclusive (share of samples)")
        for (fs, ns), (fi, ni) in zip(s["self"], s["inclusive"]):
            print(f"  {100 * ns / s['samples']:5.1f}% {fs[:58]:<58} {100 * ni / s['samples']:5.1f}% {fi[:58]}")


if __name__ == "__main__":
    raise SystemExit(main())
