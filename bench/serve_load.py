"""`python -m bench.serve_load`: server configurations compared through the real HTTP endpoint.

Each `--config NAME='FLAGS'` is started as a new user starts Tandem, `python -m
tandem.cluster.cli serve [--model M] --port PORT FLAGS`, in a process group of its own with its
console in DIR/NAME.log; the bench waits for `/health` to answer 200, then loads it, then stops it
with SIGINT (Ctrl-C) to the group and records whether it exited cleanly. Configurations run one
after another on the same port, so each has the machine to itself.

The load is a closed loop: C concurrent clients, each sending its next request as soon as its
previous one finished, until the workload's requests are all done. Every request is a streamed
`POST /v1/completions` of token ids (`ignore_eos`, greedy, usage in the last chunk). Per
(config, workload, C) it reports output tokens/s (every completion token over the wall time from
the first request sent to the last one finished), requests that succeeded, requests refused with
HTTP 429 and other errors, TTFT p50/p95 (from sending to the first chunk carrying text) and E2E
p50.

Why this shape:
- A closed loop holds C requests in the server at all times, so it measures what the server
  sustains at that concurrency, not how fast a burst drains, and C is what a config is sized for.
- One Python client process parsing SSE tops out near 38k tokens/s, which a fast server passes:
  the clients are spread over P OS processes (`--clients-procs`, default min(8, max(1, C // 32)))
  that draw from one shared request counter, so the loop stays one closed loop. Each row records
  every client process's CPU share; near 1.0 means the client, not the server, set the pace.
- A refused request (429: the server's admission limit) is counted and not retried, so a config
  that sheds load shows it instead of hiding it behind client retries and a lower rate. Its
  client goes on to the next request at once, so refusals also use up the workload sooner; the
  row's tokens/s counts only the tokens the server produced.

Workloads (prompts are token ids uniform in [3, 250), which every vocabulary accepts, each request
its own prompt so prefix caching does not help):
- fixed: N requests of a 516-token prompt -> 128 output tokens; N = max(256, 4 C) unless
  --num-requests (--prompt-len / --max-tokens change the lengths, for smoke runs);
- nanovllm: nano-vllm's benchmark, 256 requests with prompt and output lengths each uniform in
  [100, 1024], seeded (random.Random(0)); --num-requests changes the count;
- w: workload W (bench/throughput.py), 512 requests, prompts uniform in [64, 2048] tokens and
  outputs in [32, 1024], seeded.

Writes DIR/serve_load.json (the command line, machine facts, each config's start-up lines, start
time and stop outcome, one row per config x workload x C; rewritten after every row) and each row's
per-request records to DIR/requests/. Example:

    python -m bench.serve_load --model qwen2.5-0.5b-random \\
        --config accel='--backends cuda --max-active 256' \\
        --config hybrid='--backends cpu,cuda --max-active 256' \\
        --workload fixed,nanovllm --clients 64,256 --out /tmp/serve-load

The bench owns --port (and --model, when given): put every other `tandem serve` flag in FLAGS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TOKEN_IDS = range(3, 250)  # as bench/throughput.py: every vocabulary has these ids
FIXED_PROMPT_LEN = 516
FIXED_MAX_TOKENS = 128
FIXED_MIN_REQUESTS = 256
NANOVLLM_NUM_REQUESTS = 256
NANOVLLM_RANGE = (100, 1024)  # prompt and output lengths, each uniform in it
W_NUM_REQUESTS = 512  # workload W (bench/throughput.py): long, varied requests
W_PROMPT_RANGE = (64, 2048)
W_OUTPUT_RANGE = (32, 1024)
WORKLOADS = ("fixed", "nanovllm", "w")
MAX_CLIENT_PROCS = 8
CLIENTS_PER_PROC = 32
NOISE = ("pid=", "INFO", "Warning")  # log lines left out of the recorded start-up lines
UP_LINE = "Ctrl-C stops the server"  # the console's last start-up line (cluster/serve_cli.py)
STOP_WAIT_S = 60.0
MAX_ERROR_SAMPLES = 5


# -- workloads ---------------------------------------------------------------------------------
Request = tuple[list[int], int]  # (prompt token ids, max_tokens)


def fixed_workload(num_requests: int, prompt_len: int = FIXED_PROMPT_LEN, max_tokens: int = FIXED_MAX_TOKENS,
                   seed: int = 0) -> list[Request]:
    """`num_requests` x (`prompt_len` -> `max_tokens`), each its own random prompt."""
    rng = random.Random(seed)
    return [(rng.choices(TOKEN_IDS, k=prompt_len), max_tokens) for _ in range(num_requests)]


def nanovllm_workload(num_requests: int = NANOVLLM_NUM_REQUESTS, seed: int = 0) -> list[Request]:
    """nano-vllm's bench.py: prompt lengths, then output lengths, each uniform in [100, 1024]."""
    rng = random.Random(seed)
    low, high = NANOVLLM_RANGE
    prompts = [rng.choices(TOKEN_IDS, k=rng.randint(low, high)) for _ in range(num_requests)]
    return [(prompt, rng.randint(low, high)) for prompt in prompts]


def w_workload(num_requests: int = W_NUM_REQUESTS, seed: int = 0) -> list[Request]:
    """Workload W: prompt lengths uniform in [64, 2048], output lengths in [32, 1024]."""
    rng = random.Random(seed)
    return [(rng.choices(TOKEN_IDS, k=rng.randint(*W_PROMPT_RANGE)), rng.randint(*W_OUTPUT_RANGE))
            for _ in range(num_requests)]


def default_num_requests(workload: str, clients: int) -> int:
    if workload == "fixed":
        return max(FIXED_MIN_REQUESTS, 4 * clients)
    return W_NUM_REQUESTS if workload == "w" else NANOVLLM_NUM_REQUESTS


def default_client_procs(clients: int) -> int:
    return min(MAX_CLIENT_PROCS, max(1, clients // CLIENTS_PER_PROC))


def make_workload(name: str, clients: int, num_requests: int | None = None, prompt_len: int | None = None,
                  max_tokens: int | None = None) -> list[Request]:
    num = num_requests if num_requests is not None else default_num_requests(name, clients)
    if name == "fixed":
        return fixed_workload(num, prompt_len or FIXED_PROMPT_LEN, max_tokens or FIXED_MAX_TOKENS)
    if name == "nanovllm":
        return nanovllm_workload(num)
    if name == "w":
        return w_workload(num)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# -- summary -----------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least p% of them at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(len(ordered) * p / 100 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's numbers from its per-request records.

    A record: `sent` (time.time() when sent), `e2e` (seconds to the end of the response or the
    failure), `ttft` (seconds to the first chunk with text, None without one), `status` (the HTTP
    status, 0 without a response), `tokens` (usage's completion_tokens), `error` (None if it
    succeeded). Succeeded: status 200 and no error; refused: status 429; anything else is an error.
    Wall time runs from the first send to the last finish, over every request."""
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    refused = sum(1 for r in records if r["status"] == 429)
    errors = [r for r in records if not (r["status"] == 200 and r["error"] is None) and r["status"] != 429]
    tokens = sum(r["tokens"] for r in records)
    wall = (max(r["sent"] + r["e2e"] for r in records) - min(r["sent"] for r in records)) if records else 0.0
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2es = [r["e2e"] for r in ok]
    samples: list[str] = []
    for r in errors:
        text = r["error"] or f"HTTP {r['status']}"
        if text not in samples and len(samples) < MAX_ERROR_SAMPLES:
            samples.append(text)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1e3 * value, 1)

    p50_e2e = percentile(e2es, 50)
    return {
        "num_requests": len(records), "ok": len(ok), "refused_429": refused, "errors": len(errors),
        "output_tokens": tokens, "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p95_ms": ms(percentile(ttfts, 95)),
        "e2e_p50_s": None if p50_e2e is None else round(p50_e2e, 3),
        "error_samples": samples,
    }


# -- the clients ---------------------------------------------------------------------------------
async def _one_request(session: Any, url: str, model: str, prompt: list[int], max_tokens: int,
                       headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    record: dict[str, Any] = {"sent": time.time(), "e2e": None, "ttft": None, "status": 0, "tokens": 0, "error": None}
    start = time.perf_counter()
    first_choice = None
    try:
        async with session.post(url, json=body, headers=headers) as response:
            record["status"] = response.status
            if response.status != 200:
                text = (await response.text())[:300]
                if response.status != 429:
                    record["error"] = f"HTTP {response.status}: {text}"
            else:
                done = False
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        done = True
                        break
                    # Parse only what is needed: chunks until the first text (TTFT), then only
                    # those that are not plain text chunks (Tandem's carry `"usage":null`): the
                    # usage chunk and error events. Quotes inside a JSON string are escaped, so
                    # generated text cannot fake the marker.
                    if record["ttft"] is not None and b'"usage":null' in line:
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["error"] = f"stream error: {json.dumps(event['error'])[:300]}"
                        continue
                    if event.get("usage"):
                        record["tokens"] = event["usage"].get("completion_tokens", 0)
                    choices = event.get("choices") or []
                    if choices and record["ttft"] is None:
                        now = time.perf_counter() - start
                        first_choice = first_choice if first_choice is not None else now
                        if any(c.get("text") for c in choices):
                            record["ttft"] = now
                if not done and record["error"] is None:
                    record["error"] = "stream ended without [DONE]"
                if record["ttft"] is None:
                    record["ttft"] = first_choice  # a stream whose text was all empty: its first chunk
    except Exception as exc:  # aiohttp.ClientError, a timeout, a malformed event: this request failed
        record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    record["e2e"] = time.perf_counter() - start
    return record


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
            record = await _one_request(session, url, model, prompt, max_tokens, headers)
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


# -- the server ----------------------------------------------------------------------------------
def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


def startup_lines(log_text: str) -> list[str]:
    """The console's lines that say something: not Ray's per-process lines or INFO or warnings."""
    return [line.rstrip() for line in log_text.splitlines()
            if line.strip() and not any(noise in line for noise in NOISE)]


class Server:
    """One `tandem serve` subprocess in its own process group, its console in `log_path`."""

    def __init__(self, flags: list[str], port: int, log_path: Path, model: str | None = None) -> None:
        self.port = port
        self.log_path = log_path
        self.command = [sys.executable, "-m", "tandem.cluster.cli", "serve", *(["--model", model] if model else []),
                        "--port", str(port), *flags]
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The checkout's `tandem` package wins over any other on the path (tandem/__init__.py).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=ROOT, env=env, start_new_session=True)
        self.started_at = time.perf_counter()

    def wait_ready(self, timeout_s: float, headers: dict[str, str] | None = None) -> str | None:
        """None once /health answers 200 (and the console printed its last start-up line, or 10 s
        passed); else why not."""
        assert self.proc is not None
        deadline = self.started_at + timeout_s
        while True:
            if self.proc.poll() is not None:
                return f"the server exited with code {self.proc.returncode} before it was ready"
            if http_get(self.url + "/health", headers, timeout=5.0)[0] == 200:
                break
            if time.perf_counter() > deadline:
                return f"/health did not answer 200 within {timeout_s:.0f} s"
            time.sleep(1.0)
        until = time.perf_counter() + 10.0
        while UP_LINE not in self.log_text() and time.perf_counter() < until:
            time.sleep(0.2)
        return None

    def _group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of the group runs as someone else: still there
            return True
        return True

    def _signal_group(self, signum: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signum)  # the group this bench created (start_new_session)
        except ProcessLookupError:
            pass

    def stop(self, wait_s: float = STOP_WAIT_S) -> dict[str, Any]:
        """Ctrl-C to the group, as a terminal sends it; SIGTERM then SIGKILL if it does not exit.
        Clean: the server exited with code 0 after SIGINT alone."""
        assert self.proc is not None
        outcome: dict[str, Any] = {"signals": []}
        start = time.perf_counter()
        for signum, wait in ((signal.SIGINT, wait_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            outcome["signals"].append(signal.Signals(signum).name)
            self._signal_group(signum)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        outcome["returncode"] = self.proc.poll()
        # What else of the group (Ray's processes) outlives the server: a few seconds' grace, then killed.
        until = time.perf_counter() + 10.0
        while self._group_alive() and time.perf_counter() < until:
            time.sleep(0.2)
        outcome["group_left_over"] = self._group_alive()
        if outcome["group_left_over"]:
            self._signal_group(signal.SIGKILL)
        outcome["stop_s"] = round(time.perf_counter() - start, 1)
        outcome["clean"] = (outcome["signals"] in (["SIGINT"], []) and outcome["returncode"] == 0
                            and not outcome["group_left_over"])
        return outcome


def served_model(url: str, headers: dict[str, str]) -> str:
    status, body = http_get(url + "/v1/models", headers, timeout=10.0)
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:300]!r}")
    return json.loads(body)["data"][0]["id"]


# -- machine facts -------------------------------------------------------------------------------
def machine_facts() -> dict[str, Any]:
    from bench._machine import cpu_model, git_revision, memory_gib

    facts: dict[str, Any] = {
        "platform": platform.platform(), "python": sys.version.split()[0], "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "memory_gib": memory_gib(), "hostname": platform.node(),
        "git_revision": git_revision(ROOT),
    }
    if hasattr(os, "sched_getaffinity"):
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import aiohttp

        facts["aiohttp"] = aiohttp.__version__
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            facts["nvidia_smi_l"] = done.stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            pass
    # torch in a child process, so this one never holds a CUDA context while servers run.
    probe = ("import json, torch\n"
             "cuda = torch.cuda.is_available()\n"
             "print(json.dumps({'torch': torch.__version__, 'cuda_available': cuda,\n"
             "  'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}))")
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            facts.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return facts


# -- the command ---------------------------------------------------------------------------------
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_config(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not NAME.match(name):
        raise argparse.ArgumentTypeError(f"--config wants NAME='FLAGS' with NAME of letters, digits, . _ -; "
                                         f"got {text!r}")
    try:
        return name, shlex.split(flags)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--config {name}: {exc}") from None


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want positive integers, got {text!r}")
    return values


def workload_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"workloads are {', '.join(WORKLOADS)}; got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", type=parse_config, required=True, metavar="NAME='FLAGS'",
                        help="a server configuration: `tandem serve` flags (shell-split); repeat to compare")
    parser.add_argument("--workload", type=workload_list, default=["fixed"],
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default fixed)")
    parser.add_argument("--clients", type=int_list, default=[64, 256],
                        help="comma-separated closed-loop concurrencies (default 64,256)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (logs, serve_load.json)")
    parser.add_argument("--model", help="passed to every server as --model (default: the server's default)")
    parser.add_argument("--clients-procs", type=int,
                        help="client OS processes (default min(8, max(1, C // 32)) per concurrency C)")
    parser.add_argument("--port", type=int, default=8000, help="the servers' HTTP port (default 8000)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="one request's limit, connection to last byte (default 600)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="how long a server may take to answer /health 200 (default 600)")
    parser.add_argument("--num-requests", type=int,
                        help="requests per run (default: fixed max(256, 4 C), nanovllm 256)")
    parser.add_argument("--prompt-len", type=int, help=f"fixed workload's prompt tokens (default {FIXED_PROMPT_LEN})")
    parser.add_argument("--max-tokens", type=int, help=f"fixed workload's output tokens (default {FIXED_MAX_TOKENS})")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="sent as a bearer token (default $TANDEM_API_KEY, which the servers also see)")
    return parser


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


TABLE_HEADER = (f"{'config':<16} {'workload':<9} {'C':>5} {'P':>2} {'N':>5} {'ok':>5} {'429':>5} {'err':>4} "
                f"{'tok/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'E2E p50':>8}")


def table_row(row: dict[str, Any]) -> str:
    if row.get("failed"):
        return f"{row['config']:<16} {row['workload']:<9} {row['clients']:>5}  {row['failed']}"
    return (f"{row['config']:<16} {row['workload']:<9} {row['clients']:>5} {row['client_procs']:>2} "
            f"{row['num_requests']:>5} {row['ok']:>5} {row['refused_429']:>5} {row['errors']:>4} "
            f"{row['output_tok_s']:>9.1f} {_fmt(row['ttft_p50_ms'], '.1f'):>7}ms {_fmt(row['ttft_p95_ms'], '.1f'):>7}ms "
            f"{_fmt(row['e2e_p50_s'], '.2f'):>7}s")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(TABLE_HEADER)
    for row in rows:
        print(table_row(row))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [name for name, _ in args.config]
    if len(set(names)) != len(names):
        raise SystemExit("error: --config names must differ")
    out: Path = args.out
    (out / "requests").mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, "-m", "bench.serve_load", *(sys.argv[1:] if argv is None else argv)]),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "machine": machine_facts(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {"workloads": args.workload, "clients": args.clients, "model": args.model,
                     "num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "timeout_s": args.timeout_s, "port": args.port},
        "configs": [], "rows": [],
    }
    json_path = out / "serve_load.json"

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1))

    print(f"serve_load: {len(args.config)} config(s) x {args.workload} x clients {args.clients}; "
          f"output in {out}", flush=True)
    for name, flags in args.config:
        server = Server(flags, args.port, out / f"{name}.log", args.model)
        entry: dict[str, Any] = {"name": name, "flags": shlex.join(flags), "command": shlex.join(server.command),
                                 "log": str(server.log_path)}
        report["configs"].append(entry)
        print(f"\n[{name}] {entry['command']}", flush=True)
        server.start()
        try:
            failure = server.wait_ready(args.start_timeout_s, headers)
            entry["start_s"] = round(time.perf_counter() - server.started_at, 1)
            entry["startup_lines"] = startup_lines(server.log_text())
            if failure is None:
                try:
                    entry["model"] = served_model(server.url, headers)
                except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                    failure = str(exc)
            entry["started"] = failure is None
            if failure is not None:
                entry["error"] = failure
                print(f"[{name}] failed to start: {failure}; the log's last lines:", flush=True)
                for line in entry["startup_lines"][-15:]:
                    print(f"    {line}")
                for workload in args.workload:
                    for clients in args.clients:
                        report["rows"].append({"config": name, "workload": workload, "clients": clients,
                                               "failed": f"server did not start: {failure}"})
                save()
                continue
            print(f"[{name}] up in {entry['start_s']} s, model {entry['model']!r}", flush=True)
            save()
            for workload in args.workload:
                for clients in args.clients:
                    requests = make_workload(workload, clients, args.num_requests, args.prompt_len, args.max_tokens)
                    procs = min(args.clients_procs or default_client_procs(clients), clients)
                    print(f"[{name}] {workload}: {len(requests)} requests, {clients} clients over {procs} "
                          f"process(es) ...", flush=True)
                    row: dict[str, Any] = {"config": name, "workload": workload, "clients": clients,
                                           "client_procs": procs}
                    try:
                        records, cpu_shares = run_load(server.url + "/v1/completions", entry["model"], requests,
                                                       clients, procs, args.timeout_s, headers)
                    except RuntimeError as exc:
                        row["failed"] = str(exc)
                    else:
                        row.update(summarize(records))
                        row["client_cpu_share"] = cpu_shares
                        row["prompt_tokens"] = sum(len(p) for p, _ in requests)
                        row["max_tokens"] = sum(m for _, m in requests)
                        records_path = out / "requests" / f"{name}-{workload}-c{clients}.json"
                        records_path.write_text(json.dumps(records))
                        row["requests_file"] = str(records_path)
                    row["server_alive"] = server.proc.poll() is None
                    report["rows"].append(row)
                    save()
                    print(TABLE_HEADER + "\n" + table_row(row), flush=True)
        finally:
            entry["stop"] = server.stop()
            entry["shutdown_lines"] = startup_lines(server.log_text())[len(entry.get("startup_lines", [])):][-30:]
            save()
            print(f"[{name}] stopped: {'cleanly' if entry['stop']['clean'] else 'NOT cleanly'} "
                  f"({entry['stop']})", flush=True)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save()
    print()
    print_table(report["rows"])
    print(f"\nwrote {json_path}")
    failed = [r for r in report["rows"] if r.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
