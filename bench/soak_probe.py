"""What the soak bench samples from a running server, outside it: each Tandem process's resident
memory and open file descriptors, GPU memory, and the backends' KV blocks in use.

The processes are the tree under the `tandem serve` process (psutil): Ray's daemons and the
actors all descend from it. Ray names an actor's process `ray::<Class>`, a stable role across
samples; `ray::IDLE` pool workers come and go and are left out of the totals the checks use.
GPU memory comes from nvidia-smi, so this process holds no CUDA context. KV blocks come from the
server's /metrics: blocks in use = free x usage / (1 - usage).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.actors.metrics import BACKEND_METRICS

IDLE_ROLE = "ray::IDLE"
BACKEND_ROLE = "ray::BackendActor"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_BACKEND_LABEL = re.compile(r'backend="([^"]*)"')
_EXPORTED = {spec.name: spec.exported_name for spec in BACKEND_METRICS}
KV_USAGE = _EXPORTED["tandem_backend_kv_cache_usage"]
KV_FREE = _EXPORTED["tandem_backend_kv_cache_free_blocks"]
MIB = 1 << 20


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    role: str
    rss_mib: float
    num_fds: int


# -- the process tree --------------------------------------------------------------------------
def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every descendant alive now."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        return [root_pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def role_of(pid: int, root_pid: int, cmdline: list[str], parent_role: str | None = None) -> str:
    """A process's stable name: `serve` for the root, `ray::<Class>` for an actor, `<parent's
    role>/spawned` for a multiprocessing child (an engine core) and `/resource_tracker` for its
    helper, else its program (the script's name for an interpreter running one)."""
    if pid == root_pid:
        return "serve"
    if not cmdline:
        return "?"
    joined = " ".join(cmdline)
    for marker, suffix in (("multiprocessing.spawn", "spawned"), ("multiprocessing.resource_tracker",
                                                                   "resource_tracker")):
        if marker in joined:
            return f"{parent_role or '?'}/{suffix}"
    first = cmdline[0].split()[0] if cmdline[0] else "?"
    if first.startswith("ray::"):
        return first.split(".", 1)[0]
    scripts = [Path(arg).name for arg in cmdline[1:] if arg.endswith(".py")]
    return scripts[0] if scripts else Path(first).name


def _read_process(pid: int) -> tuple[list[str], int, float, int] | None:
    """(cmdline, parent pid, RSS MiB, open fds) or None if it is gone or not ours to read."""
    import psutil

    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.cmdline(), proc.ppid(), proc.memory_info().rss / MIB, proc.num_fds()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def sample_processes(root_pid: int) -> list[ProcessSample]:
    """Every process of the tree, parents before children (the tree walk's order)."""
    samples = []
    roles: dict[int, str] = {}
    for pid in process_tree(root_pid):
        read = _read_process(pid)
        if read is not None:
            cmdline, ppid, rss_mib, num_fds = read
            roles[pid] = role_of(pid, root_pid, cmdline, roles.get(ppid))
            samples.append(ProcessSample(pid, roles[pid], round(rss_mib, 1), num_fds))
    return samples


def by_role(samples: list[ProcessSample], values: dict[int, float]) -> dict[str, float]:
    """`values` (per pid) per role, roles that several processes share numbered in pid order
    (`ray::BackendActor#2`), IDLE workers summed into one; pids without a value left out."""
    out: dict[str, float] = {}
    counts: dict[str, int] = {}
    for sample in sorted(samples, key=lambda s: s.pid):
        counts[sample.role] = counts.get(sample.role, 0) + 1
        if sample.pid not in values:
            continue
        if sample.role == IDLE_ROLE:
            out[IDLE_ROLE] = round(out.get(IDLE_ROLE, 0) + values[sample.pid], 1)
            continue
        key = sample.role if counts[sample.role] == 1 else f"{sample.role}#{counts[sample.role]}"
        out[key] = values[sample.pid]
    return out


def total(samples: list[ProcessSample], value: str) -> float:
    """The sum the checks use: every process of the server but Ray's idle pool workers."""
    return round(sum(getattr(s, value) for s in samples if s.role != IDLE_ROLE), 1)


@dataclass(frozen=True)
class CpuReading:
    """The process tree and each process's CPU seconds so far (user + system, all threads)."""
    samples: list[ProcessSample]
    seconds: dict[int, float]  # pid -> CPU seconds


def read_cpu(root_pid: int) -> CpuReading:
    import psutil

    samples, seconds = sample_processes(root_pid), {}
    for sample in samples:
        try:
            times = psutil.Process(sample.pid).cpu_times()
            seconds[sample.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return CpuReading(samples, seconds)


def cpu_used_by_role(before: CpuReading, after: CpuReading) -> dict[str, float]:
    """CPU seconds each process used between two readings, per role as `after` names them. The
    difference is taken per pid: a role's number (`#2`) shifts when a process of that role comes
    or goes between readings, and per role it would compare two different processes."""
    used = {pid: seconds - before.seconds.get(pid, 0.0) for pid, seconds in after.seconds.items()}
    return by_role(after.samples, used)


class CpuTimeline:
    """Each role's share of a core, interval by interval, sampled on a thread while a run goes:
    past saturation it says which process ran out of CPU (the router, an engine core, Serve's
    proxy, the client) where a client-side view cannot. Use as a context manager."""

    def __init__(self, root_pid: int, interval_s: float = 1.0) -> None:
        import threading

        self.root_pid, self.interval_s = root_pid, interval_s
        self.shares: dict[str, list[float]] = {}  # role -> share of one core in each interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)

    def __enter__(self) -> CpuTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import time

        last, last_t, num = read_cpu(self.root_pid), time.monotonic(), 0
        while not self._stop.wait(self.interval_s):
            now, now_t = read_cpu(self.root_pid), time.monotonic()
            for role, seconds in cpu_used_by_role(last, now).items():
                series = self.shares.setdefault(role, [0.0] * num)
                series.append(round(max(0.0, seconds) / (now_t - last_t), 3))
            num += 1
            for series in self.shares.values():  # a role gone this interval used nothing in it
                series.extend([0.0] * (num - len(series)))
            last, last_t = now, now_t

    def peaks(self) -> dict[str, float]:
        """Each role's busiest interval, busiest role first."""
        return dict(sorted(((role, max(series)) for role, series in self.shares.items() if series),
                           key=lambda item: -item[1]))


# Ray prefixes a worker's console lines with its pid; a backend names itself in its ready line.
_BACKEND_LINE = re.compile(r"\(BackendActor pid=(\d+)\)(?:\x1b\[[0-9;]*m)?\s+backend (\S+): device")


def backend_pids(server_log: str) -> dict[str, int]:
    """Each backend's actor pid, from the server's console: the latest ready line of each (a
    restarted backend logs a new one)."""
    return {backend_id: int(pid) for pid, backend_id in _BACKEND_LINE.findall(server_log)}


def kill_a_backend(root_pid: int, backend_pid: int | None = None) -> dict[str, Any] | None:
    """SIGKILL a backend actor's process, as a crash would end it (Ray restarts the actor):
    `backend_pid` if it is a backend of this tree, else the lowest-pid one; what was killed, or
    None if the tree has no backend."""
    backends = [s for s in sample_processes(root_pid) if s.role == BACKEND_ROLE]
    if not backends:
        return None
    chosen = [s for s in backends if s.pid == backend_pid]
    victim = chosen[0] if chosen else min(backends, key=lambda s: s.pid)
    os.kill(victim.pid, signal.SIGKILL)
    return {"pid": victim.pid, "role": victim.role, "rss_mib": victim.rss_mib}


# -- GPU memory ----------------------------------------------------------------------------------
def gpu_memory_mib(pids: set[int]) -> dict[int, float] | None:
    """MiB of GPU memory each of `pids` holds, per nvidia-smi; None where there is no nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    used: dict[int, float] = {}
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            try:
                used[int(parts[0])] = used.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return used


def gpu_device_used_mib() -> float | None:
    """MiB in use on all GPUs together, per nvidia-smi: the fallback where the per-process query
    cannot name the tree's processes (a container whose pid namespace nvidia-smi does not see)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
        return sum(float(line) for line in done.stdout.split()) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


# -- KV blocks from /metrics ---------------------------------------------------------------------
def kv_blocks(page: str) -> dict[str, dict[str, float]]:
    """Per backend: `usage` (0-1), `free_blocks` and `blocks_in_use`, from a Prometheus page. A
    backend that Ray exports from several workers (a killed one's series lingers a few seconds)
    reports the series with the most blocks in use."""
    series: dict[str, dict[str, float]] = {}
    for line in page.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in (KV_USAGE, KV_FREE):
            continue
        labels = match.group(2) or ""
        backend = _BACKEND_LABEL.search(labels)
        if backend is None:
            continue
        entry = series.setdefault(labels, {"backend": backend.group(1)})
        entry["usage" if match.group(1) == KV_USAGE else "free_blocks"] = float(match.group(3))
    out: dict[str, dict[str, float]] = {}
    for entry in series.values():
        if "usage" not in entry or "free_blocks" not in entry:
            continue
        usage, free = entry["usage"], entry["free_blocks"]
        in_use = round(free * usage / (1 - usage)) if usage < 1 else None
        row = {"usage": round(usage, 4), "free_blocks": free, "blocks_in_use": in_use}
        current = out.get(entry["backend"])
        if current is None or (in_use or 0) > (current["blocks_in_use"] or 0):
            out[entry["backend"]] = row
    return dict(sorted(out.items()))
