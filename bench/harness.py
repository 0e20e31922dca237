"""The benchmark harness: clusters per arm, cache seeding, one measured run, its JSON record.

Lifecycle. Ray starts once per `tandem bench` invocation (a local instance, loopback only,
usage stats off). Each arm of each run then gets a fresh cluster through the driver API,
`cluster.launcher.start`: a new router with the arm's policy, new backend actors (fresh engines,
empty KV caches) and a new Serve app; `Tandem.shutdown()` removes them and we wait until the
old actors are gone before the next start, so nothing from one arm runs into the next. Each
start uses its own Ray namespace, so actor names never collide with a dying predecessor.
The sweep may instead reuse one cluster for all its cells (`BenchCluster.configure` switches
the router's policy, cordons backends and sets the accelerator's max_active; bench/runner.py).
Every cluster starts with the launcher's warm-up (cluster/warmup.py, `--warmup-tokens`), so
the router's online calibration has seen each backend run beside the others before the first
measured request.

Backends. `--backends cpu,auto` is resolved once (auto: cuda if the Ray cluster has a GPU, else
mps, else a second cpu backend) and given fixed ids (cpu0 and cuda0, or cpu0 and cpu1), so
every arm, the rates file and the reports name the same backends. The accelerator-only arm
uses the `accelerator-only` policy when there is an accelerator; without one (the 2-core CPU
machine) no policy can keep requests off a cpu backend, so that arm runs the `auto` backend
alone and the record says so.

Rates. Every cluster of an invocation loads one rates file: given with `--rates`, or measured
first by `tandem profile` (a subprocess, each backend alone) with the accelerator's
`max_active` set to the largest the invocation uses, so its batch table covers every cell.

Seeding. Before a measurement the workload's seed prompts go to every backend directly through
the backend actor handles (not through the router, which ignores progress about requests it
did not route), then each backend is asked how much of the first request's prompt it can
reuse; the answer is recorded next to the run.

The benches below the cluster share the rest: in-process engines driven step by step (`burst`,
`start_decoding`, ...), a quiet `cluster.start` for the serving path (`start_cluster`), and
`tandem serve` as a user starts it (`Server`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench._machine import machine_info
from bench.client import RequestResult, run_workload
from bench.metrics import run_metrics
from bench.workload import Workload

logger = logging.getLogger("tandem.bench")

ACCELERATOR_ONLY = "accelerator-only"


def ints(text: str) -> list[int]:
    """A comma-separated list of integers ('' is none)."""
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Layout:
    """The resolved backends: ids, devices and per-backend settings, the same for every arm."""

    model: str
    backends: list[dict[str, Any]]  # BackendConfig dicts, explicit ids
    accel_id: str  # the backend `auto` resolved to (the design's "GPU")
    has_accelerator: bool
    cpu_threads: int | None
    devices: dict[str, str] = field(default_factory=dict)  # accelerator backend id -> its device, "cuda:0"
    sim_kinds: dict[str, str] = field(default_factory=dict)  # sim backend id -> the kind it emulates
    sim_time_scale: float = 1.0  # sim steps last this many times their profile's (TandemConfig's)

    def arm_backends(self, arm: str, accel_max_active: int, cpu_max_active: int) -> list[dict[str, Any]]:
        """Every accelerator backend (and the `auto` slot, a cpu backend on a machine without
        one) at `accel_max_active`, the cpu backends at `cpu_max_active`."""
        backends = [dict(b, max_active=accel_max_active if self.is_accelerator(b) else cpu_max_active)
                    for b in self.backends]
        if arm == ACCELERATOR_ONLY and not self.has_accelerator:
            backends = [b for b in backends if b["id"] == self.accel_id]
        return backends

    def is_accelerator(self, backend: dict[str, Any]) -> bool:
        return backend["id"] == self.accel_id or self.sim_kinds.get(backend["id"], backend["device"]) != "cpu"

    def arm_policy(self, arm: str) -> str:
        if arm == ACCELERATOR_ONLY and not self.has_accelerator:
            return "cost"  # one backend: every policy sends everything to it
        return arm

    def arm_note(self, arm: str) -> str | None:
        if arm == ACCELERATOR_ONLY and not self.has_accelerator:
            return (f"no accelerator on this machine: the accelerator-only arm runs backend {self.accel_id} "
                    "(what `auto` resolved to, a cpu backend) alone")
        return None


def init_ray(log_to_driver: bool = False) -> None:
    import ray

    from tandem.cluster.launcher import ray_env_defaults

    ray_env_defaults()
    if not ray.is_initialized():
        ray.init(address="local", namespace="tandem-bench", include_dashboard=False,
                 _metrics_export_port=free_port(), logging_level=logging.WARNING, log_to_driver=log_to_driver)


def resolve_layout(model: str, backends_spec: str, cpu_threads: int | None, cpu_dtype: str = "auto",
                   num_kv_blocks: int | None = None, cpu_compile: bool = False,
                   cpu_kernels: str = "auto", sim_profile: str | None = None,
                   sim_time_scale: float = 1.0, kv_host_memory_gb: float | None = None,
                   kv_host_offload_min_hits: int | None = None) -> Layout:
    """Resolve `auto` and counts once (on the running Ray cluster) and pin every backend's id and
    device; `num_kv_blocks` sizes every backend's KV cache (None: the engine's default) and
    `kv_host_memory_gb` every cuda and sim backend's host tier and `kv_host_offload_min_hits` its
    gate (None: the server's defaults). Every
    backend that resolved to the cpu, `auto` included, gets `cpu_dtype`, `cpu_compile` and
    `cpu_kernels`."""
    import ray

    import torch

    from tandem.cluster.config import TandemConfig, parse_backends
    from tandem.cluster.plan import plan_backends

    config = TandemConfig.validated({"model": model, "backends": parse_backends(backends_spec),
                                     "cpu_threads": cpu_threads, "sim_time_scale": sim_time_scale,
                                     **({"sim_profile": sim_profile} if sim_profile else {})})
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    plans = plan_backends(config, int(ray.cluster_resources().get("GPU", 0)), mps)
    sim_kinds = {p.backend_id: p.sim_profile["device_kind"] for p in plans if p.sim_profile is not None}
    accelerators = [p for p in plans if sim_kinds.get(p.backend_id, p.device) != "cpu"]
    auto = [p for p in plans if p.requested == "auto"] or accelerators or plans[-1:]
    backends = [{"id": p.backend_id, "device": p.device, "threads": p.threads,
                 "dtype": cpu_dtype if p.device == "cpu" else "auto",
                 **({"cpu_compile": True} if cpu_compile and p.device == "cpu" else {}),
                 **({"cpu_kernels": cpu_kernels} if cpu_kernels != "auto" and p.device == "cpu" else {}),
                 **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {}),
                 **({"kv_host_memory_gb": kv_host_memory_gb}
                    if kv_host_memory_gb is not None and p.device in ("cuda", "sim") else {}),
                 **({"kv_host_offload_min_hits": kv_host_offload_min_hits}
                    if kv_host_offload_min_hits is not None and p.device in ("cuda", "sim") else {}),
                 **({"profile": p.sim_profile_name} if p.device == "sim" else {})} for p in plans]
    # A bad pair (ggml kernels without int8/int4) fails here, not in the profile's subprocess.
    TandemConfig.validated({"model": model, "backends": backends}, source="bench backends")
    return Layout(model, backends, auto[0].backend_id, bool(accelerators), cpu_threads, device_names(plans),
                  sim_kinds, sim_time_scale)


def device_names(plans: list[Any]) -> dict[str, str]:
    """Each accelerator backend's device: `cuda:N` with the plan's engines per GPU filling one
    GPU after another, `mps` for Apple's one GPU. cpu backends are left out: each has cores of
    its own (cluster/plan.py splits them), so none shares another's. Which engines Ray puts
    together on a machine with several GPUs is Ray's choice; the counts per GPU are the plan's."""
    names, num_cuda = {}, 0
    for p in plans:
        if p.device == "cuda":
            names[p.backend_id] = f"cuda:{num_cuda // p.engines_per_gpu}"
            num_cuda += 1
        elif p.device not in ("cpu", "sim"):  # a sim backend emulates a device of its own
            names[p.backend_id] = p.device
    return names


def profile_rates(layout: Layout, accel_max_active: int, cpu_max_active: int, out_dir: Path) -> Path:
    """Run `tandem profile` (each backend alone, in a subprocess) and return the rates file."""
    import yaml

    config_path, rates_path = out_dir / "profile-config.yaml", out_dir / "rates.json"
    config = {"model": layout.model, "rates_cache": str(out_dir / "rates-cache.json"),
              "sim_time_scale": layout.sim_time_scale,
              "backends": layout.arm_backends("cost", accel_max_active, cpu_max_active)}
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "tandem.cluster.cli", "profile", "--config", str(config_path), "--output", str(rates_path)]
    done = subprocess.run(command, capture_output=True, text=True)
    (out_dir / "profile.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"tandem profile failed (exit {done.returncode}); see {out_dir / 'profile.log'}:\n"
                           + done.stderr[-2000:])
    return rates_path


@dataclass
class BenchCluster:
    """One fresh cluster for one arm: start on enter, shut down and wait for its actors on exit."""

    layout: Layout
    arm: str
    accel_max_active: int
    cpu_max_active: int
    rates_path: Path
    log_dir: Path
    port: int  # Serve's HTTP proxy keeps the port of the first start: every cluster must use it
    max_pending_requests: int = 256
    warmup_tokens: int = 48
    tandem: Any = None
    infos: dict[str, Any] = field(default_factory=dict)
    routing_log: Path | None = None
    router_settings: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> BenchCluster:
        import ray

        from tandem.cluster.config import TandemConfig
        from tandem.cluster.launcher import start

        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        self.routing_log = self.log_dir / f"routing-{namespace}.jsonl"
        config = TandemConfig.validated({
            "model": self.layout.model, "policy": self.layout.arm_policy(self.arm),
            "backends": self.layout.arm_backends(self.arm, self.accel_max_active, self.cpu_max_active),
            "rates": str(self.rates_path), "profile": "never", "port": self.port,
            "routing_log": str(self.routing_log), "namespace": namespace,
            "max_pending_requests": self.max_pending_requests, "warmup_tokens": self.warmup_tokens,
            "sim_time_scale": self.layout.sim_time_scale,
            # Ray is already up (init_ray, its own metrics port): no metrics page to bind, so no port
            # check either; a test holding the default 8080 had stopped a bench half way.
            "metrics_port": 0},
            source="bench cluster")
        self.tandem = start(config, log=lambda line: logger.info("%s", line))
        self.infos = dict(zip(self.tandem.backends, ray.get([b.info.remote() for b in self.tandem.backends.values()])))
        self.router_settings = {"calibration_alpha": config.calibration_alpha, "spill_margin": config.spill_margin,
                                "spill_allow_queue": config.spill_allow_queue, "warmup_tokens": config.warmup_tokens,
                                "device_shares": config.device_shares}
        return self

    def configure(self, arm: str, accel_max_active: int) -> None:
        """Turn this running cluster into `arm`'s at `accel_max_active` (the sweep reuses one
        cluster): the router's policy, which backends it may use, the accelerator's max_active."""
        import ray

        if accel_max_active != self.accel_max_active:
            accelerators = [self.tandem.backends[b["id"]] for b in self.layout.backends if self.layout.is_accelerator(b)]
            ray.get([handle.set_max_active.remote(accel_max_active) for handle in accelerators])
        wanted = {b["id"] for b in self.layout.arm_backends(arm, accel_max_active, self.cpu_max_active)}
        cordoned = [backend_id for backend_id in self.tandem.backends if backend_id not in wanted]
        ray.get(self.tandem.router.set_policy.remote(self.layout.arm_policy(arm), cordoned))
        self.arm, self.accel_max_active = arm, accel_max_active
        handles = {bid: h for bid, h in self.tandem.backends.items() if bid in wanted}
        self.infos = dict(zip(handles, ray.get([h.info.remote() for h in handles.values()])))

    def __exit__(self, *exc: Any) -> None:
        if self.tandem is None:
            return
        handles = [*self.tandem.backends.values(), self.tandem.router]
        self.tandem.shutdown()
        wait_until_dead(handles)

    def describe(self) -> dict[str, Any]:
        suffixes = {b["id"]: _dtype_suffix(b) for b in self.layout.backends}
        return {"arm": self.arm, "policy": self.layout.arm_policy(self.arm), "note": self.layout.arm_note(self.arm),
                "backends": [{"backend_id": bid, "device": i.device, "device_kind": i.device_kind,
                              "dtype": i.dtype + suffixes.get(bid, ""),
                              "threads": i.threads, "max_active": i.max_active} for bid, i in self.infos.items()],
                "rates": json.loads(self.rates_path.read_text()), "router": self.router_settings}


def _dtype_suffix(backend: dict[str, Any]) -> str:
    """What the dtype alone leaves out, as the profile key spells it (`int4-ggml-compiled`)."""
    kernels = backend.get("cpu_kernels", "auto" if backend.get("device") == "cpu" else "torch")
    return ("" if kernels == "torch" else f"-{kernels}") + ("-compiled" if backend.get("cpu_compile") else "")


def wait_until_dead(handles: list[Any], timeout_s: float = 60.0) -> None:
    """Block until every actor is gone (its process exited), so the next cluster runs alone."""
    import ray
    import ray.exceptions

    deadline = time.monotonic() + timeout_s
    for handle in handles:
        while time.monotonic() < deadline:
            try:
                ray.get(handle.ping.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            time.sleep(0.2)


def seed_caches(cluster: BenchCluster, workload: Workload) -> dict[str, int]:
    """Prefill every seed prompt on every backend; return each backend's reusable prefix for request 0."""
    import ray

    from tandem.actors.channel import run_to_end
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # one decode step: warms it too
    backends = cluster.tandem.backends
    for handle in backends.values():
        for prompt in workload.seed_prompts:  # one at a time: each seed prompt is cached before the next
            run_to_end([(handle, f"seed-{uuid.uuid4().hex}", prompt, params)])
    probe = workload.requests[0].prompt_token_ids
    return dict(zip(backends, ray.get([h.num_cached_tokens.remote(probe) for h in backends.values()])))


def measure(cluster: BenchCluster, workload: Workload, temperature: float, on_done: Any = None,
            drain_timeout_s: float | None = None) -> dict[str, Any]:
    """Seed, run the workload through HTTP, and return the run's JSON record (`drain_timeout_s`:
    see bench/client.py's `run_workload`)."""
    import ray

    seeded = seed_caches(cluster, workload)
    router_rates = ray.get(cluster.tandem.router.rates_in_use.remote())
    log_offset = log_size(cluster.routing_log)
    started_at = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    handles = {bid: cluster.tandem.backends[bid] for bid in cluster.infos}
    before, start = engine_stats(handles), time.perf_counter()
    results: list[RequestResult] = asyncio.run(run_workload(
        cluster.tandem.url, cluster.layout.model, workload, temperature, on_done=on_done,
        drain_timeout_s=drain_timeout_s))
    wall_s = time.perf_counter() - start
    after = engine_stats(handles)
    requests = [r.to_dict() for r in results]
    return {
        "engine_work": ({bid: engine_work(b, a, wall_s) for bid, b, a in zip(handles, before, after)}
                        if before and after else {}),
        "workload": workload.summary(),
        "cluster": cluster.describe(),
        "temperature": temperature,
        "seeded_cached_tokens": seeded,
        "router_rates_at_start": router_rates,
        "started_at": started_at,
        "requests": requests,
        "metrics": run_metrics(requests, list(cluster.infos)).to_dict(),
        "decisions": read_decisions(cluster.routing_log, {r.req_id: r.index for r in results if r.req_id},
                                    log_offset),
    }


def engine_stats(handles: dict[str, Any]) -> list[Any] | None:
    """Each backend's engine stats now, or None if one cannot answer (a diagnostic never fails a run)."""
    import ray

    try:
        return ray.get([h.stats.remote() for h in handles.values()], timeout=30)
    except Exception as exc:  # a backend gone or stuck: the run's record says so by leaving it out
        logger.warning("engine stats unavailable: %s", exc)
        return None


def _step_seconds(before: Any, after: Any) -> tuple[float, float, float]:
    """Between two of an engine's stats (EngineStats): seconds in steps with prefill, in all
    steps, and of those spent waiting for the device's sampled ids."""
    prefill_s = after.prefill_time_s - before.prefill_time_s
    busy_s = prefill_s + after.decode_time_s - before.decode_time_s
    return prefill_s, busy_s, after.device_wait_time_s - before.device_wait_time_s


def step_work(before: Any, after: Any) -> dict[str, float]:
    """An engine's steps between two of its stats: how many, and per step the milliseconds of
    host work (scheduling, launching, outputs: the step loop's own time) and of waiting for the
    device's sampled ids."""
    steps = after.num_steps - before.num_steps
    _, busy_s, wait_s = _step_seconds(before, after)
    if steps <= 0:
        return {"steps": 0, "host_ms_per_step": 0.0, "device_wait_ms_per_step": 0.0}
    return {"steps": steps, "host_ms_per_step": round(1e3 * (busy_s - wait_s) / steps, 3),
            "device_wait_ms_per_step": round(1e3 * wait_s / steps, 3)}


def engine_work(before: Any, after: Any, wall_s: float) -> dict[str, float]:
    """What one engine did over a run, from its stats before and after (engine/outputs.py's
    EngineStats): the share of the wall its steps took (near 1: the engine itself is the
    bottleneck; well below while requests queue: the wait is elsewhere), the parts of that in
    steps with prefill and spent waiting for the device (the rest of a step is host work), the
    steps and their host and device-wait milliseconds each (`step_work`: a step loop whose wait
    is a small part of its step is host-bound), and the tokens it computed and generated."""
    prefill_s, busy_s, wait_s = _step_seconds(before, after)
    return {"wall_s": round(wall_s, 3), "busy_share": round(busy_s / wall_s, 4) if wall_s > 0 else 0.0,
            **step_work(before, after),
            "prefill_share_of_busy": round(prefill_s / busy_s, 4) if busy_s > 0 else 0.0,
            "device_wait_share_of_busy": round(wait_s / busy_s, 4) if busy_s > 0 else 0.0,
            "prompt_tokens": after.num_prompt_tokens_total - before.num_prompt_tokens_total,
            "generated_tokens": after.num_generation_tokens_total - before.num_generation_tokens_total,
            "host_reloaded_blocks": after.kv_host_reloaded_blocks - before.kv_host_reloaded_blocks,
            "host_offloaded_blocks": after.kv_host_offloaded_blocks - before.kv_host_offloaded_blocks}


def log_size(routing_log: Path | None) -> int:
    return routing_log.stat().st_size if routing_log is not None and routing_log.exists() else 0


def read_decisions(routing_log: Path | None, index_by_req_id: dict[str, int], offset: int = 0) -> list[dict[str, Any]]:
    """This run's routing-log lines, in decision order, each tagged with its workload index;
    `offset` skips what the log held before the run (a reused cluster's log keeps growing)."""
    if routing_log is None or not routing_log.exists():
        return []
    decisions = []
    with routing_log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode()
    for line in text.splitlines():
        record = json.loads(line)
        if record.get("req_id") in index_by_req_id:
            decisions.append({"index": index_by_req_id[record["req_id"]], **record})
    return sorted(decisions, key=lambda d: d["ts"])


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


class Budget:
    """A wall-clock budget: benches stop starting new work once it is spent."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if not seconds else time.monotonic() + seconds

    def left_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.left_s() <= 0


@dataclass
class BenchContext:
    """What every measurement of one invocation shares: where output goes, backends, rates, sampling."""

    out_dir: Path
    layout: Layout
    rates_path: Path
    temperature: float
    cpu_max_active: int
    budget: Budget
    meta: dict[str, Any]
    port: int = field(default_factory=free_port)
    warmup_tokens: int = 48

    def cluster(self, arm: str, accel_max_active: int, max_pending_requests: int) -> BenchCluster:
        return BenchCluster(self.layout, arm, accel_max_active, self.cpu_max_active, self.rates_path,
                            self.out_dir / "logs", self.port, max_pending_requests, self.warmup_tokens)


def prepare(out_dir: Path, model: str, backends: str, cpu_threads: int | None, cpu_dtype: str,
            cpu_max_active: int, max_accel_max_active: int, rates: str | None, temperature: float | None,
            time_budget_s: float | None, verbose: bool, command: str,
            num_kv_blocks: int | None = None, cpu_compile: bool = False,
            cpu_kernels: str = "auto", sim_profile: str | None = None, sim_time_scale: float = 1.0,
            kv_host_memory_gb: float | None = None, kv_host_offload_min_hits: int | None = None) -> BenchContext:
    """Start Ray, resolve the backends, get the rates (profiling if needed) and stamp the run."""
    budget = Budget(time_budget_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    init_ray(log_to_driver=verbose)
    layout = resolve_layout(model, backends, cpu_threads, cpu_dtype, num_kv_blocks, cpu_compile, cpu_kernels,
                            sim_profile, sim_time_scale, kv_host_memory_gb, kv_host_offload_min_hits)
    rates_path = Path(rates) if rates else profile_rates(layout, max_accel_max_active, cpu_max_active, out_dir)
    if temperature is None:  # random weights + byte tokenizer: greedy output can hold text back for long
        temperature = 1.0 if model.endswith("-random") else 0.0
    meta = {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_info(), "model": model, "backends": layout.backends, "accel_id": layout.accel_id,
            "has_accelerator": layout.has_accelerator, "cpu_max_active": cpu_max_active,
            "rates_file": str(rates_path), "rates": json.loads(Path(rates_path).read_text()),
            "temperature": temperature}
    return BenchContext(out_dir, layout, Path(rates_path), temperature, cpu_max_active, budget, meta)


# -- in-process engines: what the engine-level benches share ------------------------------------
def make_engine(model: str, device: str = "cpu", max_active: int | None = None, dtype: str = "auto",
                threads: int | None = None, step_time: Any = None, **config: Any) -> Any:
    """An in-process engine; a sim device's takes its `step_time` (engine/sim_runner.py)."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_active=max_active,
                                  num_threads=threads, **config), step_time=step_time)


def greedy(max_tokens: int) -> Any:
    """Exactly `max_tokens` greedy tokens (EOS ignored), so every system does the same work."""
    from tandem.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def submit(engine: Any, prompts: list[list[int]], max_tokens: int | list[int], tag: str) -> list[str]:
    """Add every prompt (`max_tokens` one for all, or one each); the request ids, in order."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, prompt, length in zip(ids, prompts, lengths):
        engine.add_request(req_id, prompt, greedy(length))
    return ids


def drain(engine: Any) -> tuple[int, int]:
    """Step until nothing is left: (tokens generated, steps)."""
    tokens = steps = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return tokens, steps


def start_decoding(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str, settle: int = 2) -> list[str]:
    """Submit the prompts and step until every one has its first token, then `settle` more steps:
    from here on each step is a decode step of the whole batch."""
    ids = submit(engine, prompts, max_tokens, tag)
    first = 0
    while first < len(prompts):
        first += sum(1 for o in engine.step() if o.new_token_ids and o.usage.completion_tokens == 1)
    for _ in range(settle):
        engine.step()
    return ids


def abort_all(engine: Any, ids: list[str]) -> None:
    for req_id in ids:
        engine.abort_request(req_id)
    drain(engine)


def sync_device() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def burst(engine: Any, prompts: list[list[int]], max_tokens: int | list[int], tag: str) -> dict[str, Any]:
    """Every prompt submitted at once and stepped until all finish: output tok/s over the wall time
    from the first submit, and per request (in order, seconds from that submit) when its first
    token and its last came back and the tokens it got."""
    sync_device()
    stats_before = copy.copy(engine.get_stats())  # the engine updates its stats object in place
    start = time.perf_counter()
    ids = submit(engine, prompts, max_tokens, tag)
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    tokens: dict[str, list[int]] = {req_id: [] for req_id in ids}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            tokens[out.req_id] += out.new_token_ids
            first.setdefault(out.req_id, now)
            if out.finished:
                end[out.req_id] = now
    sync_device()
    wall = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    return {"requests": len(ids), "generated": generated, "wall_s": wall, "steps": steps, "tok_s": generated / wall,
            "step_work": step_work(stats_before, engine.get_stats()),
            "ttft_s": [first[r] for r in ids], "e2e_s": [end[r] for r in ids], "tokens": [tokens[r] for r in ids]}


def median_ms(fn: Any, reps: int, warmup: int = 3) -> float:
    """Median wall time of `fn()` over `reps` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def median_run(runs: list[dict[str, Any]], key: str = "tok_s") -> dict[str, Any]:
    """The run with the median `key`, carrying every run's figure."""
    ordered = sorted(runs, key=lambda r: r[key])
    return dict(ordered[len(ordered) // 2], **{f"runs_{key}": [r[key] for r in runs]})


# -- servers: the serving path under test ---------------------------------------------------------
def start_cluster(**overrides: Any) -> Any:
    """`cluster.start` on free ports, quietly. Without `rates` or `profile`, placeholder rates and
    no profiling: a bench of the serving path has one backend, so the rates choose nothing."""
    import tempfile

    from tandem import cluster

    if "rates" not in overrides and "profile" not in overrides:
        tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
        (tmp / "rates.json").write_text(json.dumps({kind: {"prefill_tok_s": 20000.0, "decode_tok_s": 500.0}
                                                    for kind in ("cpu", "cuda", "mps")}))
        overrides.update(rates=str(tmp / "rates.json"), rates_cache=str(tmp / "rates-cache.json"), profile="never")
    overrides.setdefault("port", free_port())
    return cluster.start(**{"metrics_port": free_port(), "access_log": False, "warmup_tokens": 0,
                            "log": lambda line: None, **overrides})


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


def served_model(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The model card a server's /v1/models lists first."""
    status, body = http_get(url + "/v1/models", headers, timeout=10.0)
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:300]!r}")
    return json.loads(body)["data"][0]


class Server:
    """`tandem serve [--model M] --port PORT FLAGS` as a user starts it, in a process group of its
    own with its console in `log_path`: ready when /health answers 200, stopped with Ctrl-C."""

    UP_LINE = "Ctrl-C stops the server"  # the console's last start-up line (cluster/serve_cli.py)

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
        repo = Path(__file__).resolve().parent.parent
        # The checkout's `tandem` package wins over any other on the path (tandem/__init__.py).
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=repo, env=env, start_new_session=True)
        self.started_at = time.perf_counter()

    def wait_ready(self, timeout_s: float, headers: dict[str, str] | None = None) -> str | None:
        """None once /health answers 200 (and the console printed its last start-up line, or 10 s
        passed); else why not."""
        assert self.proc is not None
        deadline = self.started_at + timeout_s
        while http_get(self.url + "/health", headers)[0] != 200:
            if self.proc.poll() is not None:
                return f"the server exited with code {self.proc.returncode} before it was ready"
            if time.perf_counter() > deadline:
                return f"/health did not answer 200 within {timeout_s:.0f} s"
            time.sleep(1.0)
        until = time.perf_counter() + 10.0
        while self.UP_LINE not in self.log_text() and time.perf_counter() < until:
            time.sleep(0.2)
        return None

    def _signal_group(self, signum: int) -> bool:
        """Send `signum` to the group this bench created (start_new_session); False if it is gone.
        Signal 0 only asks: a group member running as someone else still counts as there."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, wait_s: float = 60.0) -> dict[str, Any]:
        """Ctrl-C to the group, as a terminal sends it; SIGTERM then SIGKILL if it does not exit.
        Clean: the server exited with code 0 after SIGINT alone and left nothing of its group."""
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
        until = time.perf_counter() + 10.0  # Ray's processes of the group: a few seconds' grace, then killed
        while self._signal_group(0) and time.perf_counter() < until:
            time.sleep(0.2)
        outcome["group_left_over"] = self._signal_group(0)
        if outcome["group_left_over"]:
            self._signal_group(signal.SIGKILL)
        outcome["stop_s"] = round(time.perf_counter() - start, 1)
        outcome["clean"] = (outcome["signals"] in (["SIGINT"], []) and outcome["returncode"] == 0
                            and not outcome["group_left_over"])
        return outcome
