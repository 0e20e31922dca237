"""`tandem serve`'s settings: one pydantic model, loadable from YAML, overridable by flags.

Everything a deployment needs lives in `TandemConfig`, so a YAML file, the CLI and the Python
driver (`cluster.start(...)`) all describe a cluster the same way and are validated by the same
rules. Flags override the file field by field (`with_overrides`); a flag left unset keeps the
file's value, and a field missing from both keeps the default below.

Example file::

    model: smollm2-135m
    policy: cost
    gpu_memory_utilization: 0.9  # share of each GPU its engines use together (weights, activations, KV)
    backends:
      - device: cpu
        threads: 1
        cpu_compile: false  # cpu: decode through torch.compile'd graphs (opt-in; measure first)
        cpu_kernels: auto  # cpu: auto (float32: ggml graph for decode where built, eager prefill), torch, ggml (int8/int4) or ggml-graph
      - device: auto        # cuda, else mps, else a second cpu backend
        count: all          # one per free GPU (cuda: 2 is two cuda backends, sharing a GPU if there is one)
        # max_active: 128         # None: by device (cpu 4, a GPU 256 split among its engines)
        # gpu_memory_share: 0.45  # cuda: this engine's share of its GPU's memory
        # kv_host_memory_gb: 32   # cuda: host memory for KV blocks evicted from the GPU (0: off)
    port: 8000
    routing_log: routing.jsonl   # off unless set

Defaults that the engine also needs (model, max_active, block size) are the engine's
(engine/config.py), and the cache root is the engine's `cache_root()`, so each is stated once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.engine.config import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL, cache_root, check_cpu_kernels
from tandem.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from tandem.routing.errors import ConfigError, format_validation_errors

DEVICES = ("cpu", "cuda", "mps", "auto", "sim")
# The device a sim backend emulates unless told (routing/sim_profiles/; routing/step_time.py).
DEFAULT_SIM_PROFILE = "h200-qwen2.5-0.5b"
EVERY_GPU_DEVICES = ("cuda", "auto")  # the devices `count: all` (`cuda*all`) applies to
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)

__all__ = ["DEFAULT_MODEL", "ConfigError", "TandemConfig", "BackendConfig", "parse_backends", "cache_root"]


class BackendConfig(BaseModel):
    """One backend engine, or `count` alike. `id` defaults to the resolved device kind plus an
    index (cpu0, cuda0). `count: all` (cuda or auto only) is one backend per GPU the Ray cluster
    has left once explicit cuda backends took theirs; cluster/plan.py expands it."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda", "mps", "auto", "sim"] = "cpu"
    count: Annotated[int, Field(ge=1)] | Literal["all"] = 1
    # sim backends: the profiled device they emulate, a shipped profile's name or a JSON file
    # (routing/step_time.py); None: the cluster's sim_profile.
    profile: str | None = None
    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    # int8 / int4: weight-only quantized linears with bfloat16 activations, cpu backends only
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "int4"] = "auto"
    threads: int | None = Field(default=None, ge=1)  # torch threads; None: the cluster's cpu_threads
    max_active: int | None = Field(default=None, ge=1)  # None: the cluster's max_active
    num_kv_blocks: int | None = Field(default=None, ge=2)
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    # cuda: this engine's share of its GPU's total memory; None: gpu_memory_utilization split
    # among the engines on that GPU (cluster/plan.py)
    gpu_memory_share: float | None = Field(default=None, gt=0, le=1)
    # cuda and sim backends: GiB of host memory that keep prefix-cache blocks evicted from the
    # device, reloaded instead of recomputed (engine/kv_cache/host_tier.py); 0: off. None: the
    # cluster's kv_host_memory_gb.
    kv_host_memory_gb: float | None = Field(default=None, ge=0)
    # the host tier keeps only evicted blocks hit at least this many times (EngineConfig.kv_host_offload_min_hits);
    # None: the engine's default
    kv_host_offload_min_hits: int | None = Field(default=None, ge=0)
    # cpu backends only: decode steps through torch.compile'd graphs (engine/model/cpu_compile.py).
    # Opt-in: it helps on some CPUs and hurts badly on others, so it is measured, not assumed.
    cpu_compile: bool = False
    # cpu backends: whose kernels run them (engine/config.py's CPU_KERNELS): auto (float32 decode steps
    # through ggml's graph where ggml is built, the rest eager), PyTorch's, or ggml's (llama.cpp's).
    cpu_kernels: Literal["auto", "torch", "ggml", "ggml-graph"] = "auto"

    @model_validator(mode="after")
    def _count_fits_device(self) -> BackendConfig:
        if self.count == "all" and self.device not in EVERY_GPU_DEVICES:
            raise ValueError(f"count all is one backend per GPU: it applies to "
                             f"{' and '.join(EVERY_GPU_DEVICES)}, not {self.device}")
        if self.dtype in ("int8", "int4") and self.device != "cpu":
            raise ValueError(f"dtype {self.dtype} (quantized weights) is for cpu backends, not {self.device}")
        if self.gpu_memory_share is not None and self.device not in ("cuda", "auto"):
            raise ValueError(f"gpu_memory_share is a share of a GPU's memory, for cuda backends, not {self.device}")
        if self.profile is not None and self.device != "sim":
            raise ValueError(f"profile is the device a sim backend emulates, not a setting of {self.device}")
        if self.kv_host_memory_gb and self.device in ("cpu", "mps"):
            raise ValueError(f"kv_host_memory_gb is a host-memory tier below a device's KV cache; a {self.device} "
                             "backend's cache already lives in host memory: drop it or set it on a cuda backend")
        if self.cpu_compile and self.device != "cpu":
            raise ValueError(f"cpu_compile (torch.compile'd CPU decode) is for cpu backends, not {self.device}; "
                             "set it on a backend with device: cpu")
        self._check_cpu_kernels()
        if self.count != 1 and self.id is not None:
            raise ValueError("an id names one backend: drop the id or the count (ids are then cuda0, cuda1, ...)")
        return self

    def _check_cpu_kernels(self) -> None:
        """Caught here rather than in the backend actor, where a bad pair fails only once Ray runs it."""
        if self.cpu_kernels in ("auto", "torch"):
            return
        if self.device != "cpu":
            raise ValueError(f"cpu_kernels {self.cpu_kernels} (llama.cpp's quantized dot products) is for cpu "
                             f"backends, not {self.device}; set it on a backend with device: cpu")
        check_cpu_kernels(self.cpu_kernels, self.dtype, self.cpu_compile)


class TandemConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # the name clients send; None: the engine's model name
    backends: list[BackendConfig] = Field(
        default_factory=lambda: [BackendConfig(device="cpu"), BackendConfig(device="auto")])
    policy: str = "cost"
    calibration_alpha: float | None = Field(default=0.2, ge=0, le=1)  # EWMA weight of observed steps; 0/None: off
    spill_margin: float = Field(default=0.05, ge=0, lt=1)  # a CPU must beat the accelerator's score by this share
    spill_allow_queue: bool = False  # let a CPU queue requests while an accelerator could take them
    warmup_tokens: int = Field(default=48, ge=0)  # after start, all backends decode together (cluster/warmup.py)
    new_token_ratio: bool = False  # SGLang-style decaying discount of queued decode budgets
    # Engines that share one device are scored by their share of it (routing/device_share.py):
    # waking an idle engine beside a busy one costs what it does. Off by default (docs/routing.md:
    # where it helps in replays and where it does not).
    device_shares: bool = False
    # Running requests per backend; None: by device (engine/memory.py: cpu 4, a GPU 256 split
    # among the engines that share it, mps 32).
    max_active: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=DEFAULT_GPU_MEMORY_UTILIZATION, gt=0, le=1)
    # GiB of host memory per cuda backend for its KV tier (BackendConfig.kv_host_memory_gb); None:
    # cuda backends share a quarter of the RAM available at start (cluster/plan.py), sim
    # backends have none; 0: off everywhere.
    kv_host_memory_gb: float | None = Field(default=None, ge=0)
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    cpu_threads: int | None = Field(default=None, ge=1)  # per cpu backend; None: (cores - 1 - accelerators) / cpu backends
    # --cpu-dtype, --cpu-kernels, --cpu-compile: every backend that runs on the cpu, `auto` resolved
    # to the cpu included, over the backend's own setting; None: each backend's own (cluster/plan.py).
    cpu_dtype: Literal["auto", "float32", "bfloat16", "int8", "int4"] | None = None
    cpu_kernels: Literal["auto", "torch", "ggml", "ggml-graph"] | None = None
    cpu_compile: bool | None = None
    seed: int = 0
    sim_profile: str = DEFAULT_SIM_PROFILE  # what a sim backend without its own `profile` emulates
    # Every sim step lasts this many times its profile's (routing/step_time.py's `dilated`): many
    # emulated engines of a fast device on a small host; read durations back divided by it.
    sim_time_scale: float = Field(default=1.0, gt=0)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    metrics_port: int = Field(default=8080, ge=0, le=65535)
    dashboard: bool = False  # start the Ray dashboard (needs more memory and start-up time)
    dashboard_port: int = Field(default=8265, ge=0, le=65535)
    address: str | None = None  # join this Ray cluster instead of starting one
    namespace: str = "tandem"

    rates: Path | None = None  # rates file (routing's format); None: the profile cache
    profile: Literal["auto", "always", "never"] = "auto"
    rates_cache: Path = Field(default_factory=lambda: cache_root() / "rates-cache.json")
    routing_log: Path | None = None  # JSON lines, one per routing decision; None: off

    api_key: str | None = None
    # Admitted and unfinished, all ingress replicas together; beyond: 429. None: 4 x the backends'
    # max_active in total (at least 64), so the limit grows with what the backends can run.
    max_pending_requests: int | None = Field(default=None, ge=1)
    # direct: each Serve ingress replica serves HTTP on `port` itself, the port shared between
    # them (SO_REUSEPORT); proxy: Serve's HTTP proxy on `port` in front of the replicas; auto:
    # direct unless joining a cluster.
    ingress: Literal["auto", "direct", "proxy"] = "auto"
    http_replicas: int = Field(default=0, ge=0)  # Serve ingress replicas; 0: one per 4 cores, 1 to 4
    max_request_bytes: int = Field(default=4 << 20, ge=1024)  # larger bodies: 413
    max_route_attempts: int = Field(default=3, ge=1)
    backend_max_restarts: int = Field(default=-1, ge=-1)  # -1: Ray restarts a dead backend forever
    health_check_period_s: float = Field(default=1.0, gt=0)
    access_log: bool = False  # Serve's per-request log lines
    log_level: LogLevel = "warning"  # Ray's, Serve's and Tandem's logs

    @field_validator("backends")
    @classmethod
    def _at_least_one_backend(cls, backends: list[BackendConfig]) -> list[BackendConfig]:
        if not backends:
            raise ValueError("at least one backend is needed")
        return backends

    @model_validator(mode="after")
    def _unique_ids(self) -> TandemConfig:
        ids = [b.id for b in self.backends if b.id is not None]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"backend ids must be unique; repeated: {', '.join(duplicates)}")
        return self

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> TandemConfig:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of settings at the top level")
        return cls.validated(data, source=f"config file {path}")

    @classmethod
    def validated(cls, data: dict[str, Any], source: str = "config") -> TandemConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_errors(source, exc.errors())) from None

    def with_overrides(self, **overrides: Any) -> TandemConfig:
        """A copy with every override that is not None applied, validated again."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return self.validated(data, source="flags")


def parse_backends(spec: str) -> list[dict[str, Any]]:
    """`--backends cpu,auto` -> [{"device": "cpu"}, {"device": "auto"}]; `id=device` names one;
    `device*N` is N alike (`cuda*2`) and `cuda*all` / `auto*all` one per free GPU; `sim:PROFILE`
    is a sim backend emulating that profile (`sim:m2-cpu-qwen2.5-0.5b*2`)."""
    backends = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        backend_id, _, device = item.rpartition("=")
        device, star, count = device.partition("*")
        device, colon, profile = device.partition(":")
        if colon and device != "sim":
            raise ConfigError(f"--backends: {item!r}: only a sim backend takes a profile (sim:NAME)")
        if device not in DEVICES:
            raise ConfigError(f"--backends: unknown device {device!r} in {item!r}; use {', '.join(DEVICES)}, "
                              "optionally with *N or *all (cuda*2, auto*all)")
        backend: dict[str, Any] = {"device": device, **({"profile": profile} if profile else {})}
        if star:
            backend["count"] = _parse_count(item, device, count)
            if backend_id:
                raise ConfigError(f"--backends: {item!r} names several backends with one id; drop the id "
                                  f"(they become {device}0, {device}1, ...) or the count")
        if backend_id:
            backend["id"] = backend_id
        backends.append(backend)
    if not backends:
        raise ConfigError("--backends needs at least one device, e.g. cpu,auto")
    return backends


def _parse_count(item: str, device: str, count: str) -> int | str:
    if count == "all":
        if device not in EVERY_GPU_DEVICES:
            raise ConfigError(f"--backends: {item!r}: *all is one backend per GPU; use cuda*all or auto*all")
        return "all"
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--backends: {item!r}: the count after * is a whole number >= 1 or all")
    return int(count)
