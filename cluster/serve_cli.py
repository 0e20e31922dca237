"""`tandem serve`: start the cluster and its OpenAI-compatible HTTP API, until Ctrl-C.

Settings come from `--config FILE` (YAML, see cluster/config.py) and flags, flags winning.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading

from tandem.cluster.config import LOG_LEVELS, ConfigError, TandemConfig, cache_root, parse_backends
from tandem.engine.config import CPU_KERNELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cluster_arguments(parser)
    parser.add_argument("--policy", help="routing policy: cost (default), accelerator-only, cpu-only, "
                        "round-robin, random (uniform, llm-d's baseline), least-requests, prefix-affinity")
    parser.add_argument("--calibration-alpha", type=float,
                        help="EWMA weight of each observed engine step when calibrating the router's rates "
                             "online (default 0.2; 0 turns calibration off and keeps the profiled rates)")
    parser.add_argument("--spill-margin", type=float,
                        help="with an accelerator present, a CPU backend takes a request only if its score is "
                             "lower than the accelerator's by this fraction (default 0.05; 0: the design's rule)")
    parser.add_argument("--spill-allow-queue", action="store_true", default=None,
                        help="let a CPU backend queue requests beyond its max_active while an accelerator "
                             "could take them (default: spill only to a free CPU slot, which guards p95 TTFT)")
    parser.add_argument("--warmup-tokens", type=int,
                        help="after start, every backend decodes a full batch at once, this many tokens per "
                             "request on the slowest (more on faster ones), so online calibration starts from "
                             "co-running speeds (default 48; 0: none; skipped when calibration is off)")
    parser.add_argument("--new-token-ratio", action="store_true", default=None,
                        help="discount queued decode budgets with SGLang's decaying new_token_ratio")
    parser.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--ingress", choices=("auto", "direct", "proxy"),
                        help="direct: each ingress replica serves HTTP on --port itself, the kernel spreading "
                             "connections over them (SO_REUSEPORT; one replica off Linux); proxy: Serve's HTTP "
                             "proxy on --port in front of the replicas (one more process hop per request); "
                             "auto (default): direct unless --address")
    parser.add_argument("--http-replicas", type=int,
                        help="Serve ingress replicas, each an HTTP process of its own (default: one per 4 cores "
                             "of this machine, 1 to 4)")
    parser.add_argument("--metrics-port", type=int,
                        help="Prometheus scrape port, Ray's metrics export (default 8080; /metrics on --port serves "
                             "the same page)")
    parser.add_argument("--dashboard-port", type=int, help="Ray dashboard port, with --dashboard (default 8265)")
    parser.add_argument("--rates", help="rates file (tandem profile --output); default: profile cache")
    parser.add_argument("--profile", choices=["auto", "always", "never"],
                        help="profile backends with no cached rates (auto, default), always, or never")
    parser.add_argument("--routing-log", help="append one JSON line per routing decision to this file (default: off)")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY, else none)")
    parser.add_argument("--address", help="join this Ray cluster (e.g. auto or HOST:6379) instead of starting one")
    parser.add_argument("--served-model-name", help="model name clients send (default: the model's name)")
    parser.add_argument("--dashboard", action="store_true", default=None, help="start the Ray dashboard")
    parser.add_argument("--log-level", choices=LOG_LEVELS,
                        help="level of Ray's, Serve's and Tandem's log lines on this console (default warning)")
    parser.add_argument("--access-log", action="store_true", default=None,
                        help="log one line per HTTP request (Serve's access log; default off)")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags `serve` and `profile` share."""
    parser.add_argument("--config", help="YAML config file; flags override it")
    parser.add_argument("--model", help="preset name, local HF directory or .gguf file (default smollm2-135m)")
    parser.add_argument("--backends", help="comma-separated devices, cpu, cuda, mps or auto; id=device names "
                        "one; DEVICE*N is N alike (cuda*2), cuda*all or auto*all one per free GPU "
                        "(default cpu,auto: auto is cuda, else mps, else a second cpu); more cuda backends "
                        "than GPUs share them (cuda*2 on one GPU: two engines, each with half its memory)")
    parser.add_argument("--max-active", type=int, help="running requests per backend (default by device: cpu 4, "
                        "a GPU 256 split among the engines sharing it, mps 32)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="share of each GPU's memory its engines use together for weights, activations and "
                             "KV cache; the KV cache takes what the rest leaves (default 0.9)")
    parser.add_argument("--cpu-threads", type=int,
                        help="torch threads per cpu backend (default: the cores left after one for serving and "
                             "one per accelerator backend, shared by the cpu backends)")
    parser.add_argument("--cpu-dtype", choices=("auto", "float32", "bfloat16", "int8", "int4"),
                        help="dtype of every cpu backend: int8/int4 are weight-only quantized linears with bfloat16 "
                             "activations (default: the config's, else float32)")
    parser.add_argument("--cpu-compile", action="store_true", default=None,
                        help="opt-in: every cpu backend decodes through torch.compile'd graphs (a few fused "
                             "loops per layer instead of many small ops; needs a C++ compiler). The first start "
                             "of a model, dtype and thread count compiles for a while (20 s to 2 min on 2 cores), "
                             "later starts load the cache; its rates are profiled apart from eager ones. Measure "
                             "before turning it on: in our measurements it lost to eager decode on a 14-thread "
                             "Xeon (int4 8x slower) and won 1.1-1.4x per step on 2 cores (default: the config's, "
                             "else off)")
    parser.add_argument("--cpu-kernels", choices=CPU_KERNELS,
                        help="whose kernels run every cpu backend's linears (ggml needs --cpu-dtype int8 or "
                             "int4, or that dtype in the config): torch, or ggml, llama.cpp's own quantized dot "
                             "products, built once from llama-cpp-python's sources (about a minute on two cores; "
                             "later starts reuse the build), faster per decode row on AVX2 CPUs; or ggml-graph "
                             "(int8, int4 or float32), each decode step run as one ggml graph, llama.cpp's speed "
                             "per token (no compiling; not with --cpu-compile). Rates are profiled apart per "
                             "choice (default: the config's, else torch)")


def load_config(args: argparse.Namespace, **extra: object) -> TandemConfig:
    config = TandemConfig.from_yaml(args.config) if args.config else TandemConfig()
    overrides = dict(model=args.model, max_active=args.max_active, cpu_threads=args.cpu_threads,
                     gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None), **extra)
    if args.backends:
        overrides["backends"] = parse_backends(args.backends)
    cpu_settings = {"cpu_dtype": getattr(args, "cpu_dtype", None), "cpu_compile": getattr(args, "cpu_compile", None),
                    "cpu_kernels": getattr(args, "cpu_kernels", None)}
    cpu_settings = {key: value for key, value in cpu_settings.items() if value}
    try:
        config = config.with_overrides(**overrides, **cpu_settings)
        if cpu_settings:
            _check_cpu_settings(config)
    except ConfigError as exc:
        typed = {"dtype" if key == "cpu_dtype" else key for key in cpu_settings}
        raise ConfigError(_flag_names(str(exc), typed=typed, config_file=bool(args.config))) from None
    return config


def _check_cpu_settings(config: TandemConfig) -> None:
    """The --cpu-* flags apply to every backend that can run on the cpu: fail now, not after Ray
    started, when there is none or when a backend's own settings and the flags cannot go together."""
    from tandem.cluster.plan import cpu_settings

    if not any(b.device in ("cpu", "auto") for b in config.backends):
        flags = [flag for field, flag in (("cpu_compile", "--cpu-compile"), ("cpu_kernels", "--cpu-kernels"))
                 if getattr(config, field)]
        if flags:
            raise ConfigError(f"{flags[0]} applies to backends with device cpu, and there is none "
                              f"(backends: {', '.join(b.id or b.device for b in config.backends)})")
    for backend in config.backends:
        if backend.device in ("cpu", "auto"):
            cpu_settings(config, backend, backend.id or backend.device)


# A cpu backend's setting -> the flag that sets it on every cpu backend.
CPU_FLAGS = {"dtype": "--cpu-dtype", "cpu_kernels": "--cpu-kernels", "cpu_compile": "--cpu-compile"}


def _flag_names(message: str, typed: set[str], config_file: bool) -> str:
    """The config's error about cpu settings, in the flags the user types: a field is named by its
    flag when it came from a flag, or when there is no config file (the flag is then the one way to
    set it: `--cpu-kernels ggml` alone is told to use `--cpu-dtype int8 or int4`). A field that a
    config file set keeps its YAML name."""
    for field, flag in CPU_FLAGS.items():
        if field in typed or not config_file:
            message = re.sub(rf"(?<![\w-]){field}s(?![\w-])", f"{flag} values", message)  # "one of those dtypes"
            message = re.sub(rf"(?<![\w-]){field}(?![\w-])", flag, message)
    return message


def run(args: argparse.Namespace) -> int:
    from tandem.cluster.launcher import start

    try:
        config = load_config(
            args, policy=args.policy, calibration_alpha=args.calibration_alpha, spill_margin=args.spill_margin,
            spill_allow_queue=args.spill_allow_queue, warmup_tokens=args.warmup_tokens,
            new_token_ratio=args.new_token_ratio, host=args.host, port=args.port, metrics_port=args.metrics_port,
            rates=args.rates, profile=args.profile, routing_log=args.routing_log, api_key=args.api_key,
            address=args.address, served_model_name=args.served_model_name, dashboard=args.dashboard,
            dashboard_port=args.dashboard_port, log_level=args.log_level, access_log=args.access_log,
            http_replicas=args.http_replicas, ingress=args.ingress)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tandem: starting {config.model} on backends "
          f"{', '.join(b.id or b.device for b in config.backends)} (policy {config.policy})", flush=True)
    try:
        tandem = start(config, log=lambda line: print(f"tandem: {line}", flush=True))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_urls(tandem)
    # Ctrl-C and SIGTERM only set an event: a KeyboardInterrupt raised inside Event.wait can
    # escape as "release unlocked lock". A second Ctrl-C during shutdown interrupts as usual.
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("\ntandem: stopping", flush=True)
    tandem.shutdown()
    return 0


def _print_urls(tandem) -> None:
    config = tandem.config
    model = config.served_model_name or _model_name(tandem)
    print(f"tandem: OpenAI API  {tandem.url}/v1  (model {model!r})", flush=True)
    print(f"tandem: health      {tandem.url}/health", flush=True)
    metrics = f"{tandem.metrics_url} and {tandem.url}/metrics" if tandem.metrics_url else f"{tandem.url}/metrics"
    print(f"tandem: metrics     {metrics}  (Prometheus; Ray reports every 10 s)", flush=True)
    if tandem.dashboard_url:
        print(f"tandem: dashboard   {tandem.dashboard_url}  (Ray)", flush=True)
    if config.routing_log:
        print(f"tandem: routing log {os.path.abspath(config.routing_log)}", flush=True)
    else:
        print("tandem: routing log off (--routing-log FILE records each decision)", flush=True)
    print(f"tandem: cache       {cache_root()}  (converted models, measured rates)", flush=True)
    print(f"tandem: logs        {_ray_log_dir()}  (Ray, Serve, backends)", flush=True)
    print(f"tandem: try  curl {tandem.url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'", flush=True)
    print("tandem: Ctrl-C stops the server", flush=True)


def _ray_log_dir() -> str:
    import ray

    context = ray.get_runtime_context()
    return os.path.join(context.get_temp_dir(), context.get_session_name(), "logs")


def _model_name(tandem) -> str:
    import ray

    infos = ray.get(tandem.router.backend_infos.remote())
    return next(iter(infos.values())).model_name if infos else tandem.config.model
