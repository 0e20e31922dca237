"""Start a Tandem cluster (or connect to a running one) and drive it from Python.

    from tandem import cluster
    from tandem.engine.sampling_params import SamplingParams

    tandem = cluster.start(model="smollm2-135m", backends=["cpu", "auto"])   # or cluster.connect()
    for out in tandem.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0)):
        print(out.new_text, end="", flush=True)
    tandem.router, tandem.backends   # the actor handles, for anything else
    tandem.shutdown()

`start` brings the pieces up in dependency order: Ray (a fresh local instance, or the cluster
at `address`), the router actor, one backend actor per configured backend (loading in
parallel), their rates (a rates file, the profile cache, or a fresh profile of each backend
alone, one after another so they do not disturb each other), registration with the router,
and finally the Serve HTTP app. Actors get `num_cpus=0` (Ray's CPU accounting would otherwise
leave them pending on a 2-core machine; torch threads are set per backend instead), and when
joining an existing cluster backends are spread over its nodes.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.config import ConfigError, TandemConfig
from tandem.cluster.driver_loop import DriverLoop
from tandem.cluster.plan import BackendPlan, plan_backends
from tandem.engine.config import GGML_KERNELS

logger = logging.getLogger("tandem.launcher")

ROUTER_NAME = "router"
BACKEND_PREFIX = "backend:"
SERVE_APP_NAME = "tandem"


def ray_env_defaults() -> None:
    """Tandem's own Ray environment, so users need not export it: no usage-stats reporting (a
    server should not phone home) and Ray's own traffic on loopback (without the second, Ray 2.60
    binds the machine's external address), and plain worker prefixes where the console is no
    terminal. Explicit settings win. The CLI calls this before Ray is imported; `start` and
    `connect` call it too (Ray reads these when it starts and as it prints)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    plain_worker_log_prefix()


def plain_worker_log_prefix(streams: tuple = ()) -> None:
    """Ray prints each line a backend or the router logs behind a coloured "(BackendActor pid=N)":
    escape codes that a log file or pipe keeps verbatim. Off unless stdout and stderr are both
    terminals, and unless the user set RAY_COLOR_PREFIX."""
    streams = streams or (sys.stdout, sys.stderr)
    if not all(_is_terminal(stream) for stream in streams):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def check_ports(config: TandemConfig, serve_http: bool = True) -> None:
    """Fail in milliseconds, naming the port and its flag, if a port Tandem would bind is taken.

    Ray would otherwise fail 30 s later with a raylet time-out (metrics port), or Serve at the
    bottom of a long traceback after the models loaded (HTTP port). A port freed later is not
    our concern; one taken between this check and Ray's bind still fails the old way."""
    wanted = []
    if serve_http:
        wanted.append((config.host, config.port, "--port"))
    if not config.address:
        wanted.append(("127.0.0.1", config.metrics_port, "--metrics-port"))
        if config.dashboard:
            wanted.append(("127.0.0.1", config.dashboard_port, "--dashboard-port"))
    seen: dict[int, str] = {}
    for host, port, flag in wanted:
        if port == 0:
            continue
        if port in seen:
            raise ConfigError(f"{flag} {port} is also {seen[port]}; give each its own port")
        seen[port] = flag
        _check_free(host, port, flag)


def _check_free(host: str, port: int, flag: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            reason = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ConfigError(f"port {port} on {host} ({flag}) {reason}; stop what holds it or choose "
                              f"another with {flag} N") from None


@dataclass
class Tandem:
    """A handle on a running Tandem cluster: actor handles plus a token-streaming `generate`."""

    router: Any
    backends: dict[str, Any]
    config: TandemConfig
    url: str | None = None
    metrics_url: str | None = None
    dashboard_url: str | None = None
    owns_ray: bool = False
    owns_actors: bool = False
    plans: list[BackendPlan] = field(default_factory=list)
    _driver: DriverLoop | None = None  # runs `generate`'s streams (cluster/driver_loop.py)
    _tokenizer: Any = None
    # The handles the actors were created with. Ray kills a (non-detached) actor once its
    # creator holds no handle to it, so these stay referenced for as long as this object lives.
    _owned: list[Any] = field(default_factory=list)
    _metrics_server: Any = None  # serves --metrics-port when this process started Ray

    def refresh_backends(self) -> dict[str, Any]:
        import ray

        self.backends = ray.get(self.router.list_backends.remote())
        return self.backends

    def generate(self, prompt: str | list[int], params: Any = None, chat: bool = False) -> Iterator[Any]:
        """Route one request and yield its `RequestOutput`s (token and text deltas) as they come."""
        driver = self._driver_loop()
        agen = self.agenerate(prompt, params, chat)
        try:
            while True:
                try:
                    yield driver.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not driver.closed:  # else `shutdown` cancelled the stream already
                driver.run(agen.aclose())

    async def agenerate(self, prompt: str | list[int], params: Any = None, chat: bool = False) -> AsyncIterator[Any]:
        """The async form of `generate`, for drivers that run their own event loop."""
        from tandem.cluster.dispatch import RoutedRequest
        from tandem.engine.sampling_params import SamplingParams

        params = params or SamplingParams()
        params.validate()  # the driver is an edge: a bad request fails here, before it is routed
        prompt_token_ids = await self._tokenize(prompt, chat)
        stream = RoutedRequest(self.router, f"driver-{uuid.uuid4().hex}", prompt_token_ids, params,
                               time.time(), self.config.max_route_attempts)
        try:
            await stream.open()
            async for out in stream.outputs():
                yield out
        finally:
            await stream.close()

    async def _tokenize(self, prompt: str | list[int], chat: bool) -> list[int]:
        from tandem.engine.tokenizer import encode_chat, encode_prompt

        if not isinstance(prompt, str):
            return list(prompt)
        if self._tokenizer is None:
            backends = await self.router.list_backends.remote()
            if not backends:
                from tandem.engine.errors import BackendUnavailableError

                raise BackendUnavailableError("no backend is alive")
            self._tokenizer = await next(iter(backends.values())).tokenizer.remote()
        if chat:
            return encode_chat(self._tokenizer, [{"role": "user", "content": prompt}])
        return encode_prompt(self._tokenizer, prompt)

    def _driver_loop(self) -> DriverLoop:
        if self._driver is None:
            self._driver = DriverLoop()
        return self._driver

    def shutdown(self) -> None:
        """Stop what `start` started: Ray itself if we started it, else our app and actors only."""
        import ray

        if self._driver is not None:  # first, while the backends and the router still answer
            self._driver.close()
            self._driver = None
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if not ray.is_initialized():
            return
        if self.owns_ray:
            ray.shutdown()  # takes Serve and every actor with it
            return
        if self.owns_actors:
            if self.url:
                from ray import serve

                serve.delete(SERVE_APP_NAME)
            for handle in self._owned:
                ray.kill(handle, no_restart=True)


def start(config: TandemConfig | None = None, *, serve_http: bool = True, log: Any = print,
          **overrides: Any) -> Tandem:
    """Start Ray (or join `config.address`), the actors and, unless `serve_http=False`, the HTTP app."""
    config = (config or TandemConfig()).with_overrides(**_normalise(overrides))
    import ray

    from tandem.cluster.metrics_route import MetricsServer

    ray_env_defaults()
    if serve_http:
        config = config.with_overrides(ingress=resolve_ingress(config))
    check_ports(config, serve_http)
    ray_metrics_port = _free_port()
    # Tandem's page takes --metrics-port before Ray starts, so nothing of Ray's can land on it.
    metrics_server = None if config.address or ray.is_initialized() else MetricsServer(
        config.metrics_port, ray_metrics_port)
    owns_ray = False
    try:
        owns_ray = _init_ray(config, ray_metrics_port)
        tandem = _start_on_ray(config, serve_http, log, owns_ray)
    except BaseException:
        if metrics_server is not None:
            metrics_server.close()
        if owns_ray:
            ray.shutdown()
        raise
    if metrics_server is not None:  # else Ray's ports are not ours: /metrics on the API port serves
        tandem._metrics_server = metrics_server
        tandem.metrics_url = f"http://127.0.0.1:{metrics_server.port}/metrics"
    return tandem


def connect(address: str = "auto", namespace: str = "tandem") -> Tandem:
    """Attach to a running Tandem (started by `tandem serve` or `start`) from another script."""
    import ray

    ray_env_defaults()
    owns_ray = False
    if not ray.is_initialized():
        quiet_ray_notices()
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
        owns_ray = True
    try:
        router = ray.get_actor(ROUTER_NAME, namespace=namespace)
    except ValueError:
        raise ConfigError(f"no Tandem router in namespace {namespace!r} of the Ray cluster at {address!r}; "
                          "is `tandem serve` running?") from None
    backends = ray.get(router.list_backends.remote())
    return Tandem(router=router, backends=backends, config=TandemConfig(namespace=namespace), owns_ray=owns_ray)


def _normalise(overrides: dict[str, Any]) -> dict[str, Any]:
    """`backends` as `--backends` spells them ("cpu", "cuda*2", "big=cpu") or as config dicts."""
    from tandem.cluster.config import parse_backends

    backends = overrides.get("backends")
    if backends is not None and backends and isinstance(backends[0], str):
        overrides["backends"] = parse_backends(",".join(backends))
    return overrides


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_ray(config: TandemConfig, ray_metrics_port: int) -> bool:
    """Start Ray (or join `config.address`); Ray's own metrics export goes to `ray_metrics_port`,
    behind Tandem's page on `config.metrics_port` (cluster/metrics_route.py)."""
    import ray

    if ray.is_initialized():
        return False
    level = config.log_level.upper()
    quiet_ray_notices()
    if config.address:
        ray.init(address=config.address, namespace=config.namespace, logging_level=level)
    else:
        ray.init(address="local", namespace=config.namespace, include_dashboard=config.dashboard,
                 dashboard_host="127.0.0.1", dashboard_port=config.dashboard_port,
                 _metrics_export_port=ray_metrics_port, logging_level=level)
    logging.getLogger("tandem").setLevel(level)
    return True


def quiet_ray_notices() -> None:
    """Ray's notice that it enabled token authentication (its default for a local cluster,
    which Tandem keeps) is logged as a warning on every start; nothing is wrong, so hide it."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def _start_on_ray(config: TandemConfig, serve_http: bool, log: Any, owns_ray: bool) -> Tandem:
    import ray

    from tandem.actors.backend import BackendActor
    from tandem.actors.router import RouterActor

    plans = plan_backends(config, int(ray.cluster_resources().get("GPU", 0)), _mps_available(config))
    for plan in plans:
        threads = f"{plan.threads} thread{'' if plan.threads == 1 else 's'}"
        log(f"backend {plan.backend_id}: {plan.device} ({plan.reason}), {threads}, "
            f"max_active {plan.max_active}{_gpu_notes(plan)}{_cpu_notes(plan)}")
    router = ray.remote(RouterActor).options(
        name=ROUTER_NAME, namespace=config.namespace, num_cpus=0, max_concurrency=10_000,
        scheduling_strategy=_this_node(),
    ).remote(config.policy, str(config.routing_log) if config.routing_log else None,
             config.health_check_period_s,
             calibration_alpha=config.calibration_alpha, new_token_ratio=config.new_token_ratio,
             spill_margin=config.spill_margin, spill_allow_queue=config.spill_allow_queue,
             device_shares=config.device_shares)
    placements = _cpu_backend_placements(plans) if config.address else {}
    backends = {plan.backend_id: _create_backend(BackendActor, plan, config, placements.get(plan.backend_id))
                for plan in plans}
    infos = ray.get([b.info.remote() for b in backends.values()])  # waits for every model to load
    for info in infos:
        log(ready_line(info))
    rates = _resolve_rates(config, plans, infos, backends, log)
    ray.get([backends[p.backend_id].register.remote(rates[p.backend_id]) for p in plans])
    if config.calibration_alpha and config.warmup_tokens:
        _warm_up(config, backends, dict(zip(backends, infos)), rates, log)
    tandem = Tandem(router=router, backends=dict(backends), config=config, owns_ray=owns_ray, owns_actors=True,
                    plans=plans, _owned=[router, *backends.values()])
    if not config.address and config.dashboard:
        tandem.dashboard_url = f"http://127.0.0.1:{config.dashboard_port}"
    if serve_http:
        tandem.url = _start_serve(config, router, backends[plans[0].backend_id], infos[0], plans)
        replicas = http_replicas(config)
        log(f"HTTP: {replicas} ingress replica{'' if replicas == 1 else 's'}, up to {pending_limit(config, plans)} "
            "pending requests before 429 (max_pending_requests in the config)")
    return tandem


def ready_line(info: Any) -> str:
    """What a loaded backend runs, as the user should know it: device, dtype, kernels,
    concurrency and the KV cache's size in tokens."""
    kernels = f", {info.cpu_kernels} kernels" if info.cpu_kernels else ""
    return (f"backend {info.backend_id} ready: {info.device}, {info.dtype}{kernels}, max_active {info.max_active}, "
            f"KV cache {info.num_kv_tokens:,} tokens ({info.num_kv_tokens // max(1, info.block_size):,} blocks of "
            f"{info.block_size})")


def _gpu_notes(plan: BackendPlan) -> str:
    if plan.device != "cuda":
        return ""
    kv = (f"{plan.num_kv_blocks} KV blocks" if plan.num_kv_blocks else f"{plan.kv_cache_memory_gb:g} GiB of KV cache"
          if plan.kv_cache_memory_gb else "KV cache from the rest of the share")
    return f", {plan.gpu_memory_share:.2f} of the GPU's memory ({kv})"


def pending_limit(config: TandemConfig, plans: list[BackendPlan]) -> int:
    """Admitted and unfinished requests the ingress takes before answering 429: as configured,
    else 4 x what the backends run at once (at least 64), so the limit follows their capacity."""
    return config.max_pending_requests or max(64, 4 * sum(p.max_active for p in plans))


def _cpu_notes(plan: BackendPlan, op_library_pending: Any = None) -> str:
    """What makes a cpu backend's first start slow, so a long wait in the log has its reason.
    `op_library_pending()`: whether ggml's op library is yet to be built for this torch (default:
    asks engine/model/ggml_kernels.py)."""
    from tandem.engine.model.ggml_kernels import auto_excluded

    notes = ""
    on_ggml = plan.cpu_kernels in GGML_KERNELS or (
        plan.cpu_kernels == "auto" and auto_excluded(plan.device, plan.dtype, plan.cpu_compile) is None)
    if on_ggml and (op_library_pending or _op_library_pending)():
        notes += ", ggml kernels (this first start on this torch builds their op library, about a minute)"
    if plan.cpu_compile:
        notes += ", compiled decode (the first start compiles it)"
    return notes


def _op_library_pending() -> bool:
    from tandem.engine.model import ggml_kernels

    return ggml_kernels.op_library_pending()


def _warm_up(config: TandemConfig, backends: dict[str, Any], infos: dict[str, Any],
             rates: dict[str, dict[str, Any]], log: Any) -> None:
    """Every backend decodes together once, so calibration starts from co-running speeds."""
    from tandem.cluster.warmup import warm_up_together

    try:
        seconds = warm_up_together(backends, infos, rates, config.warmup_tokens)
    except Exception as exc:  # a failed warm-up leaves the profiled rates: worth a warning, not a failed start
        log(f"warm-up failed ({type(exc).__name__}: {exc}); routing starts from the profiled rates")
        return
    log(f"warm-up: all backends decoded together for {seconds:.1f} s (online calibration)")


def _create_backend(actor_cls: type, plan: BackendPlan, config: TandemConfig, placement: Any = None) -> Any:
    import ray

    engine_kwargs = plan.engine_kwargs(config)
    if plan.sim_profile is not None:
        engine_kwargs["sim_profile"] = plan.sim_profile  # the engine core makes its step-time model of it
    options: dict[str, Any] = dict(
        name=BACKEND_PREFIX + plan.backend_id, namespace=config.namespace, num_cpus=0, num_gpus=plan.num_gpus,
        max_concurrency=10_000, max_restarts=config.backend_max_restarts, max_task_retries=0)
    if placement is not None:
        options["scheduling_strategy"] = placement
    return ray.remote(actor_cls).options(**options).remote(
        plan.backend_id, engine_kwargs, plan.threads, plan.requested, plan.reason, (ROUTER_NAME, config.namespace))


def _resolve_rates(config: TandemConfig, plans: list[BackendPlan], infos: list[Any], backends: dict[str, Any],
                   log: Any) -> dict[str, dict[str, Any]]:
    """Rates per backend: the rates file, else the profile cache, else a fresh profile (one at a
    time), measured once for all backends on identical devices (cluster/profile.py)."""
    import ray

    from tandem.cluster.profile import describe_rates, load_cache, rate_fields, resolve_profiles, store_in_cache
    from tandem.routing.step_time import sim_profile_from_dict

    from_file = _load_rates_file(config) if config.rates else {}
    device_names = _gpu_models() if any(i.device_kind == "cuda" for i in infos) else {}
    rates: dict[str, dict[str, Any]] = {}
    wanted: list[tuple[str, str]] = []
    for plan, info in zip(plans, infos):
        entry = plan.backend_id if plan.backend_id in from_file else info.device_kind
        if plan.sim_profile is not None and entry not in from_file:  # the device it emulates, as profiled
            rates[plan.backend_id] = sim_profile_from_dict(plan.sim_profile).rate_fields()
        elif entry in from_file:
            rates[plan.backend_id] = from_file[entry]
            log(f"rates for {plan.backend_id} from {config.rates} (entry {entry!r}): {describe_rates(from_file[entry])}")
        else:
            wanted.append((plan.backend_id, _profile_key(info, plan, device_names)))
    max_active = {plan.backend_id: plan.max_active for plan in plans}
    cache = load_cache(config.rates_cache)
    profiled = resolve_profiles(
        wanted, cache, config.profile,
        measure=lambda backend_id: ray.get(backends[backend_id].profile.remote(max_active[backend_id])),
        store=lambda key, entry: store_in_cache(config.rates_cache, key, entry), log=log, previous=cache)
    rates.update({backend_id: rate_fields(entry) for backend_id, entry in profiled.items()})
    return {plan.backend_id: rates[plan.backend_id] for plan in plans}


def _profile_key(info: Any, plan: BackendPlan, device_names: dict[str, str]) -> str:
    from tandem.cluster.profile import profile_key

    name = device_names.get(info.node_id, "") if info.device_kind == "cuda" else ""
    kernels = info.cpu_kernels or plan.cpu_kernels  # a cpu backend's, `auto` resolved by its engine
    return profile_key(info.model_name, info.device_kind, info.dtype, info.threads, info.max_active, name,
                       cpu_compile=plan.cpu_compile, cpu_kernels=kernels, host_tier=plan.kv_host_memory_gb > 0)


def _gpu_models() -> dict[str, str]:
    """Node id -> the model of its GPUs (Ray's `accelerator_type:` resource, e.g. H200), so only
    identical GPUs share a profile in a cluster of mixed machines."""
    import ray

    models = {}
    for node in ray.nodes():
        types = [name.split(":", 1)[1] for name in node.get("Resources", {}) if name.startswith("accelerator_type:")]
        if types:
            models[node["NodeID"]] = types[0]
    return models


def _load_rates_file(config: TandemConfig) -> dict[str, dict[str, Any]]:
    from dataclasses import asdict

    from tandem.routing import load_rate_profiles

    return {name: asdict(profile) for name, profile in load_rate_profiles(config.rates).items()}


def resolve_ingress(config: TandemConfig) -> str:
    """`direct` or `proxy` for `config.ingress` (see `TandemConfig.ingress`).

    Direct: every ingress replica serves HTTP on `port` itself, the port shared through
    `SO_REUSEPORT` (cluster/http_server.py), so no request crosses Serve's proxy process; under
    a steady load of short requests the proxy and a replica together spent 3.5x the CPU per
    request of a replica serving alone. The replicas must then run on this machine, so joining a
    cluster (--address) keeps the proxy unless direct is asked for."""
    if config.ingress != "auto":
        return config.ingress
    return "proxy" if config.address else "direct"


def http_replicas(config: TandemConfig) -> int:
    """Serve ingress replicas: as configured, else one per 4 of this machine's cores, 1 to 4;
    one with direct ingress where the system does not balance a shared port."""
    from tandem.cluster.http_server import shared_port_balances

    balances = config.ingress != "direct" or shared_port_balances()
    if config.http_replicas > 1 and not balances:
        raise ConfigError("--http-replicas > 1 with --ingress direct needs Linux (SO_REUSEPORT balancing); "
                          "use --ingress proxy")
    if config.http_replicas:
        return config.http_replicas
    return max(1, min(4, (os.cpu_count() or 1) // 4)) if balances else 1


def _start_serve(config: TandemConfig, router: Any, backend: Any, info: Any, plans: list[BackendPlan]) -> str:
    import ray
    from ray import serve

    from tandem.cluster.app import IngressSettings, build_app

    tokenizer = ray.get(backend.tokenizer.remote())
    replicas = http_replicas(config)
    pending = pending_limit(config, plans)
    direct = config.ingress == "direct"
    settings = IngressSettings(
        served_model_name=config.served_model_name or info.model_name, max_model_len=info.max_model_len,
        api_key=config.api_key, max_pending_requests=-(-pending // replicas),
        max_request_bytes=config.max_request_bytes, max_route_attempts=config.max_route_attempts,
        http_host=config.host, http_port=config.port if direct else None)
    # Serve's driver-side INFO lines ("Connecting to existing Serve app ... New http_options will
    # not be applied", printed by serve.run even though serve.start just applied them) and its
    # per-request access log follow --log-level and --access-log.
    logging.getLogger("ray.serve").setLevel(config.log_level.upper())
    # With direct ingress the replicas hold `port` and Serve starts no proxy.
    serve.start(proxy_location="Disabled" if direct else None, http_options={"host": config.host, "port": config.port},
                logging_config={"log_level": config.log_level.upper(), "enable_access_log": config.access_log})
    app = build_app(router, tokenizer, settings, access_log=config.access_log, num_replicas=replicas,
                    on_this_node=direct)
    serve.run(app, name=SERVE_APP_NAME, route_prefix="/", blocking=False)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    return f"http://{host}:{config.port}"


def _cpu_backend_placements(plans: list[BackendPlan]) -> dict[str, Any]:
    """In a joined cluster, CPU backends take its alive nodes in turn, this node first, so each
    machine's CPU serves; a GPU backend goes wherever Ray finds a free GPU. The affinity is hard:
    for actors that reserve no resources, as ours do not, Ray 2.60 ignores both "SPREAD" and a
    soft node affinity and packs them onto one node (seen in tests/cluster/test_multinode.py)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    node_ids = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda node_id: node_id != here)
    cpu_plans = [plan for plan in plans if not plan.num_gpus]
    return {plan.backend_id: NodeAffinitySchedulingStrategy(node_ids[i % len(node_ids)], soft=False)
            for i, plan in enumerate(cpu_plans)}


def _this_node() -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The router writes the routing log: keep it on the machine the user started Tandem on
    # (hard affinity: a soft one is not honoured for actors that reserve no resources).
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _mps_available(config: TandemConfig) -> bool:
    if not any(b.device == "auto" for b in config.backends):
        return False
    import torch

    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
