"""Turn the configured backends into concrete ones: expand counts, resolve `auto`, name them,
size threads.

Several accelerators are one shape among others: `cuda*2` (YAML `count: 2`) is two cuda
backends, each taking one GPU; `cuda*all` is one cuda backend per GPU the Ray cluster has left
once the explicit cuda backends took theirs, and `auto*all` the same, or one `auto` backend when
no GPU is left. Asking for more cuda backends than the Ray cluster has GPUs is an error here,
at once, rather than backend actors Ray can never place.

`auto` means "the accelerator if there is one": cuda when the Ray cluster has a GPU that no
explicit cuda backend already claims, else mps when this machine has Apple's GPU, else a second
cpu backend. The decision is made once, in the launcher, from what the Ray cluster reports
(so a GPU on another node counts), and each backend actor logs it again at start-up.

CPU threads: the cpu backends share this machine's cores, less one core for the serving path
(HTTP ingress, router, Ray) and one per accelerator backend, whose step loop launches kernels
from Python and stalls when it has to wait for a core: each cpu backend gets
`(cores - 1 - num_accelerators) // num_cpu` torch threads (at least 1) unless told otherwise.
On the H200's 16 cores that is 14; oversubscribed OpenMP threads of a cpu backend had slowed
both backends down. Accelerator backends only need a thread for the host-side Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tandem.cluster.config import BackendConfig, ConfigError, TandemConfig


@dataclass(frozen=True)
class BackendPlan:
    backend_id: str
    device: str  # cpu | cuda | mps
    requested: str  # as configured: cpu | cuda | mps | auto
    reason: str  # why this device, for the start-up log
    dtype: str
    threads: int
    max_active: int
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    cpu_compile: bool = False  # cpu: decode through torch.compile'd graphs (EngineConfig.cpu_compile)
    cpu_kernels: str = "torch"  # cpu int8/int4: torch or ggml kernels (EngineConfig.cpu_kernels)

    @property
    def num_gpus(self) -> float:
        return 1.0 if self.device == "cuda" else 0.0


def resolve_auto(num_free_gpus: int, mps_available: bool) -> tuple[str, str]:
    if num_free_gpus > 0:
        return "cuda", "auto -> cuda (the Ray cluster has a free GPU)"
    if mps_available:
        return "mps", "auto -> mps (Apple GPU found)"
    return "cpu", "auto -> cpu (no cuda GPU in the Ray cluster and no mps): a second cpu backend"


def plan_backends(config: TandemConfig, num_gpus: int, mps_available: bool,
                  num_cores: int | None = None) -> list[BackendPlan]:
    num_cores = num_cores or os.cpu_count() or 1
    resolved = _resolve_devices(config.backends, num_gpus, mps_available)
    num_cpu = sum(device == "cpu" for _, device, _ in resolved)
    num_reserved = 1 + (len(resolved) - num_cpu)  # serving, and each accelerator's step loop
    default_cpu_threads = config.cpu_threads or max(1, (num_cores - num_reserved) // max(1, num_cpu))
    used_ids = {b.id for b, _, _ in resolved if b.id}
    counters: dict[str, int] = {}
    plans = []
    for backend, device, reason in resolved:
        backend_id = backend.id or _next_id(device, counters, used_ids)
        threads = backend.threads or (default_cpu_threads if device == "cpu" else 1)
        plans.append(BackendPlan(
            backend_id=backend_id, device=device, requested=backend.device, reason=reason,
            dtype=backend.dtype, threads=threads,
            max_active=backend.max_active or config.max_active,
            num_kv_blocks=backend.num_kv_blocks, kv_cache_memory_gb=backend.kv_cache_memory_gb,
            cpu_compile=backend.cpu_compile, cpu_kernels=backend.cpu_kernels))
    return plans


def _resolve_devices(backends: list[BackendConfig], num_gpus: int,
                     mps_available: bool) -> list[tuple[BackendConfig, str, str]]:
    """Each backend that will run, with its device and why; counts expanded, in config order."""
    num_explicit = sum(b.count for b in backends if b.device == "cuda" and b.count != "all")
    if num_explicit > num_gpus:
        raise ConfigError(f"backends: {num_explicit} cuda backend{'s' if num_explicit > 1 else ''} asked for, but "
                          f"there {'is' if num_gpus == 1 else 'are'} {_gpus(num_gpus)} (each cuda backend takes one); "
                          "use cuda*all for one per GPU")
    num_free_gpus = num_gpus - num_explicit
    resolved: list[tuple[BackendConfig, str, str]] = []
    for backend in backends:
        if backend.device == "cuda" and backend.count == "all":
            if num_free_gpus == 0:
                raise ConfigError(f"backends: cuda*all found no free GPU ({_gpus(num_gpus)} in all, "
                                  f"{num_explicit} taken by explicit cuda backends)")
            resolved += [(backend, "cuda", f"cuda*all -> cuda (GPU {i + 1} of {num_free_gpus} free)")
                         for i in range(num_free_gpus)]
            num_free_gpus = 0
        elif backend.device == "auto" and backend.count == "all" and num_free_gpus > 0:
            resolved += [(backend, "cuda", f"auto*all -> cuda (GPU {i + 1} of {num_free_gpus} free)")
                         for i in range(num_free_gpus)]
            num_free_gpus = 0
        elif backend.device == "auto":
            for _ in range(1 if backend.count == "all" else backend.count):
                device, reason = resolve_auto(num_free_gpus, mps_available)
                num_free_gpus -= device == "cuda"
                resolved.append((backend, device, reason))
        else:
            resolved += [(backend, backend.device, f"configured {backend.device}")] * backend.count
    return resolved


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _next_id(device: str, counters: dict[str, int], used_ids: set[str]) -> str:
    while True:
        index = counters.get(device, 0)
        counters[device] = index + 1
        candidate = f"{device}{index}"
        if candidate not in used_ids:
            used_ids.add(candidate)
            return candidate
