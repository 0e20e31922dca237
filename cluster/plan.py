"""Turn the configured backends into concrete ones: expand counts, resolve `auto`, name them,
size threads.

Several accelerators are one shape among others: `cuda*2` (YAML `count: 2`) is two cuda
backends, each taking one GPU; `cuda*all` is one cuda backend per GPU the Ray cluster has left
once the explicit cuda backends took theirs, and `auto*all` the same, or one `auto` backend when
no GPU is left.

More cuda backends than GPUs share them: `cuda*2` on one GPU is two engines on it, each in its
own engine-core process with its own scheduler and KV cache. Engines are spread evenly, k =
ceil(cuda backends / GPUs) to a GPU at most, and each asks Ray for 1/k of a GPU, so Ray's
accounting places them (and never a (k+1)-th) on one device. The device's memory is split
explicitly rather than left to whoever allocates first: each engine owns
`gpu_memory_utilization / k` of its GPU's total memory (or its own `gpu_memory_share`), sizes its
KV cache from that share (engine/memory.py), and runs `256 / k` requests at once unless told
(so one engine at 256 and two at 128 hold the same total batch). Shares that add up to more
than the device are an error here; a share the device cannot give is the engine's start-up
error. For a small model an engine's step loop is host-bound, so two engines on one GPU can
deliver more than one.

`auto` means "the accelerator if there is one": cuda when the Ray cluster has a GPU that no
explicit cuda backend already claims, else mps when this machine has Apple's GPU, else a second
cpu backend. The decision is made once, in the launcher, from what the Ray cluster reports
(so a GPU on another node counts), and each backend actor logs it again at start-up.

CPU threads: the cpu backends share this machine's cores, less one core for the serving path
(HTTP ingress, router, Ray) and one per accelerator backend, whose step loop launches kernels
from Python and stalls when it has to wait for a core: each cpu backend gets
`(cores - 1 - num_accelerators) // num_cpu` torch threads (at least 1) unless told otherwise:
oversubscribed OpenMP threads of a cpu backend slow both backends down. Accelerator backends
only need a thread for the host-side Python.

`sim` is an emulated device (engine/sim_runner.py): the real engine without its model, each
step lasting what a profiled device's step of that shape takes. Its defaults (max_active, KV
cache, batched tokens) are the profiled engine's, so `sim*16` with an H200 profile is sixteen
H200 engines to the router, on a machine without a GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from tandem.cluster.config import BackendConfig, ConfigError, TandemConfig
from tandem.engine.config import check_cpu_kernels
from tandem.engine.memory import default_max_active
from tandem.routing.step_time import load_sim_profile


@dataclass(frozen=True)
class BackendPlan:
    backend_id: str
    device: str  # cpu | cuda | mps
    requested: str  # as configured: cpu | cuda | mps | auto
    reason: str  # why this device, for the start-up log
    threads: int
    max_active: int
    dtype: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    cpu_compile: bool = False  # cpu: decode through torch.compile'd graphs (EngineConfig.cpu_compile)
    cpu_kernels: str = "auto"  # cpu: whose kernels (EngineConfig.cpu_kernels)
    engines_per_gpu: int = 1  # cuda: how many engines share this backend's GPU
    gpu_memory_share: float | None = None  # cuda: share of its GPU's memory (EngineConfig.gpu_memory_share)
    max_num_batched_tokens: int | None = None  # None: the cluster's (a sim backend: its profile's)
    kv_host_memory_gb: float = 0.0  # cuda, sim: the host-memory KV tier (EngineConfig.kv_host_memory_gb); 0: none
    kv_host_offload_min_hits: int | None = None  # EngineConfig.kv_host_offload_min_hits; None: the engine's default
    sim_profile: dict | None = None  # sim: the profiled device it emulates (routing/step_time.py's SimProfile)
    sim_profile_name: str | None = None  # sim: that profile as configured (a shipped name or a file)

    def engine_kwargs(self, config: TandemConfig) -> dict[str, Any]:
        """The EngineConfig this plan gives its backend's engine, and `tandem profile` its own copy
        of that engine: one list, so what is profiled is what serves (a sim engine's step-time
        model and a profile's threads and device index are the callers')."""
        return dict(model=config.model, device=self.device, dtype=self.dtype, max_active=self.max_active,
                    block_size=config.block_size, num_kv_blocks=self.num_kv_blocks,
                    kv_cache_memory_gb=self.kv_cache_memory_gb, max_model_len=config.max_model_len,
                    max_num_batched_tokens=self.max_num_batched_tokens or config.max_num_batched_tokens,
                    seed=config.seed, cpu_compile=self.cpu_compile, cpu_kernels=self.cpu_kernels,
                    gpu_memory_share=self.gpu_memory_share, kv_host_memory_gb=self.kv_host_memory_gb,
                    **({"kv_host_offload_min_hits": self.kv_host_offload_min_hits}
                       if self.kv_host_offload_min_hits is not None else {}))

    @property
    def num_gpus(self) -> float:
        """Ray's GPU request: a whole GPU, or 1/k of one where k engines share it."""
        return 1.0 / self.engines_per_gpu if self.device == "cuda" else 0.0


def engines_per_gpu(num_cuda_backends: int, num_gpus: int) -> int:
    """Engines to a GPU when `num_cuda_backends` spread evenly over `num_gpus` (0 GPUs: 0)."""
    return math.ceil(num_cuda_backends / num_gpus) if num_gpus and num_cuda_backends else 0


def gpu_memory_shares(backends: list[tuple[BackendConfig, str]], per_gpu: int,
                      utilization: float) -> list[float | None]:
    """Each backend's share of its GPU's memory (None off cuda): its own, else `utilization`
    split among the engines of one GPU. Shares that overcommit a GPU are an error."""
    shares = [None if device != "cuda" else (b.gpu_memory_share or utilization / per_gpu) for b, device in backends]
    cuda_shares = sorted((s for s in shares if s is not None), reverse=True)
    worst = sum(cuda_shares[:per_gpu])
    if worst > 1.0 + 1e-9:
        raise ConfigError(f"backends: {per_gpu} engines share a GPU and their memory shares add up to {worst:.2f} "
                          "of it; lower gpu_memory_share or --gpu-memory-utilization so they fit in 1.0")
    return shares


# The share of the RAM available at start that cuda backends' host KV tiers take together when
# the config does not size them: room for the prefixes a GPU evicts, leaving the rest to Ray, the
# serving processes, pinned staging and the CPU backends.
HOST_TIER_RAM_SHARE = 0.25


def host_tier_gb(config: TandemConfig, backend: BackendConfig, device: str, num_cuda: int,
                 available_gb: float) -> float:
    """A backend's host KV tier in GiB: its own setting, else the cluster's, else (cuda only)
    `HOST_TIER_RAM_SHARE` of the available RAM split among the cuda backends."""
    if device not in ("cuda", "sim"):
        return 0.0
    for setting in (backend.kv_host_memory_gb, config.kv_host_memory_gb):
        if setting is not None:
            return float(setting)
    if device == "sim":
        return 0.0  # an emulated device's host memory is not this machine's: asked for, never assumed
    return round(HOST_TIER_RAM_SHARE * available_gb / max(1, num_cuda), 2)


def available_ram_gb() -> float:
    """RAM available for new allocations (Linux's MemAvailable), in GiB; 0 where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def resolve_auto(num_free_gpus: int, mps_available: bool) -> tuple[str, str]:
    if num_free_gpus > 0:
        return "cuda", "auto -> cuda (the Ray cluster has a free GPU)"
    if mps_available:
        return "mps", "auto -> mps (Apple GPU found)"
    return "cpu", "auto -> cpu (no cuda GPU in the Ray cluster and no mps): a second cpu backend"


def plan_backends(config: TandemConfig, num_gpus: int, mps_available: bool,
                  num_cores: int | None = None, available_gb: float | None = None) -> list[BackendPlan]:
    num_cores = num_cores or os.cpu_count() or 1
    resolved = _resolve_devices(config.backends, num_gpus, mps_available)
    num_cuda = sum(device == "cuda" for _, device, _ in resolved)
    if available_gb is None:
        available_gb = available_ram_gb() if num_cuda else 0.0
    num_cpu = sum(device == "cpu" for _, device, _ in resolved)
    # serving, and each accelerator's step loop (a sim's mostly sleeps: it reserves no core)
    num_reserved = 1 + sum(device not in ("cpu", "sim") for _, device, _ in resolved)
    default_cpu_threads = config.cpu_threads or max(1, (num_cores - num_reserved) // max(1, num_cpu))
    used_ids = {b.id for b, _, _ in resolved if b.id}
    per_gpu = engines_per_gpu(sum(device == "cuda" for _, device, _ in resolved), num_gpus)
    shares = gpu_memory_shares([(b, device) for b, device, _ in resolved], per_gpu, config.gpu_memory_utilization)
    counters: dict[str, int] = {}
    plans = []
    for (backend, device, reason), share in zip(resolved, shares):
        backend_id = backend.id or _next_id(device, counters, used_ids)
        threads = backend.threads or (default_cpu_threads if device == "cpu" else 1)
        sharing = per_gpu if device == "cuda" else 1
        plans.append(BackendPlan(
            backend_id=backend_id, device=device, requested=backend.device,
            reason=reason + (f", {sharing} engines on its GPU" if sharing > 1 else ""),
            threads=threads, max_active=backend.max_active or config.max_active or default_max_active(device, sharing),
            num_kv_blocks=backend.num_kv_blocks, kv_cache_memory_gb=backend.kv_cache_memory_gb,
            engines_per_gpu=sharing, gpu_memory_share=share,
            kv_host_memory_gb=host_tier_gb(config, backend, device, num_cuda, available_gb),
            kv_host_offload_min_hits=backend.kv_host_offload_min_hits,
            **(cpu_settings(config, backend, backend_id) if device == "cpu" else {"dtype": backend.dtype})))
        if device == "sim":
            plans[-1] = sim_settings(plans[-1], config, backend)
    return plans


def sim_settings(plan: BackendPlan, config: TandemConfig, backend: BackendConfig) -> BackendPlan:
    """A sim backend's engine as its profile describes the device, where the config says nothing:
    max_active, KV cache and batched-token budget are the profiled engine's."""
    name = backend.profile or config.sim_profile
    try:
        profile = load_sim_profile(name).dilated(config.sim_time_scale)
    except ConfigError as exc:
        raise ConfigError(f"backend {plan.backend_id}: {exc}") from None
    num_kv_blocks = plan.num_kv_blocks
    if num_kv_blocks is None and plan.kv_cache_memory_gb is None and profile.num_kv_tokens:
        num_kv_blocks = math.ceil(profile.num_kv_tokens / config.block_size) + 1  # + the null block
    scaled = f", {config.sim_time_scale:g}x slower" if config.sim_time_scale != 1 else ""
    return replace(plan, reason=f"{plan.reason}, emulating {name}{scaled}",
                   max_active=backend.max_active or config.max_active or profile.max_active,
                   num_kv_blocks=num_kv_blocks, dtype="auto",
                   max_num_batched_tokens=config.max_num_batched_tokens or profile.max_num_batched_tokens,
                   sim_profile=profile.model_dump(), sim_profile_name=name)


def cpu_settings(config: TandemConfig, backend: BackendConfig, backend_id: str) -> dict:
    """A cpu backend's dtype and kernels: the cluster's (the --cpu-* flags) over its own, so
    `auto` resolved to the cpu runs as every other cpu backend does."""
    settings = dict(dtype=config.cpu_dtype or backend.dtype, cpu_kernels=config.cpu_kernels or backend.cpu_kernels,
                    cpu_compile=backend.cpu_compile if config.cpu_compile is None else config.cpu_compile)
    try:
        check_cpu_kernels(settings["cpu_kernels"], settings["dtype"], settings["cpu_compile"])
    except ValueError as exc:
        raise ConfigError(f"backend {backend_id}: {exc}") from None
    return settings


def _resolve_devices(backends: list[BackendConfig], num_gpus: int,
                     mps_available: bool) -> list[tuple[BackendConfig, str, str]]:
    """Each backend that will run, with its device and why; counts expanded, in config order."""
    num_explicit = sum(b.count for b in backends if b.device == "cuda" and b.count != "all")
    if num_explicit and not num_gpus:
        raise ConfigError(f"backends: {num_explicit} cuda backend{'s' if num_explicit > 1 else ''} asked for, but "
                          "the Ray cluster has no GPU; use auto (cuda, else mps, else cpu) or cpu")
    num_free_gpus = max(0, num_gpus - num_explicit)
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
