"""What machine a benchmark ran on and how it was run, recorded next to its numbers: a figure means
little without the CPU, GPU, threads, library versions and command line that produced it, so
every benchmark's JSON opens with `stamp()`. On a small shared machine another process's burst
can slow a run several-fold, so timed runs can also record the CPU others took (`CpuInterference`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever platform reports."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or platform.machine())


def memory_gib() -> float | None:
    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text().splitlines() if meminfo.is_file() else []
    return next((round(int(line.split()[1]) / (1 << 20), 1) for line in lines if line.startswith("MemTotal:")), None)


def git_revision(repo_dir: Path = REPO) -> str | None:
    """HEAD's short hash, with "+dirty" when tracked files differ from it; None outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_dir, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=repo_dir).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def source_digest(package_dir: Path) -> str:
    """sha256 (12 hex) over a package's .py files: names the exact code even when it is uncommitted."""
    digest = hashlib.sha256()
    for file in sorted(package_dir.rglob("*.py")):
        digest.update(str(file.relative_to(package_dir)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:12]


def gpu_names() -> list[str]:
    """The GPUs nvidia-smi lists. Not torch's: this process must not hold a CUDA context of its
    own while a server it started sizes its KV cache from the free memory."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(": ", 1)[1].split(" (UUID")[0] for line in listed.splitlines() if ": " in line]


def _version(package: str) -> str | None:
    dist = next(iter(importlib.metadata.distributions(name=package)), None)
    return None if dist is None else dist.version


def machine_info(threads: int | None = None, device: str | None = None) -> dict:
    gpus = gpu_names()
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gib": memory_gib(), "gpu": gpus[0] if gpus else None, "num_gpus": len(gpus),
            "platform": platform.platform(), "python": sys.version.split()[0], "torch_threads": threads,
            "device": device, "git_revision": git_revision(), "torch": _version("torch"),
            "transformers": _version("transformers")}


def command() -> str:
    """This run's command line, as `tandem bench MODE ...`."""
    argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else sys.argv[1:]
    return "tandem bench " + shlex.join(argv)


def stamp(threads: int | None = None, device: str | None = None) -> dict:
    """The command, the UTC time and the machine, so a table can be reproduced and dated."""
    return {"command": command(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "machine": machine_info(threads, device)}


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, steal) clock ticks summed over all CPUs since boot, from /proc/stat; None elsewhere."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal


class CpuInterference:
    """How much CPU *other* processes used while a run was timed, in cores (0.0 = had the box to itself).

    Machine-wide busy time comes from /proc/stat; this process's own share (all its threads) from
    `time.process_time`.
    """

    def __init__(self) -> None:
        self._start = (_cpu_ticks(), time.process_time(), time.perf_counter())

    def stop(self) -> dict:
        ticks, own, wall = _cpu_ticks(), time.process_time(), time.perf_counter()
        (ticks0, own0, wall0), elapsed = self._start, max(wall - self._start[2], 1e-9)
        if ticks is None or ticks0 is None:
            return {"other_cpu_cores": None, "steal_cpu_cores": None}
        hz = os.sysconf("SC_CLK_TCK")
        other = (ticks[0] - ticks0[0]) / hz - (own - own0)
        return {"other_cpu_cores": round(max(other, 0.0) / elapsed, 3),
                "steal_cpu_cores": round((ticks[1] - ticks0[1]) / hz / elapsed, 3)}


def wait_until_idle(max_other_cores: float, timeout_s: float, window_s: float = 2.0) -> float:
    """Block until other processes use under `max_other_cores` over a `window_s` window, or until
    `timeout_s` has passed; returns the seconds waited. Call it between runs, when we are idle."""
    start = time.perf_counter()
    while True:
        probe = CpuInterference()
        time.sleep(window_s)
        other = probe.stop()["other_cpu_cores"]
        waited = time.perf_counter() - start
        if other is None or other < max_other_cores or waited >= timeout_s:
            return waited
