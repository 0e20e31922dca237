"""`tandem serve`: start the cluster and its OpenAI-compatible HTTP API, until Ctrl-C.

Settings come from `--config FILE` (YAML, see cluster/config.py) and flags, flags winning; every
setting is described in docs/config.md, so --help stays one line per flag, and the advanced
flags are listed by --help-all only, so --help fits on one screen.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading

from tandem.cluster.config import (DEFAULT_SIM_PROFILE, LOG_LEVELS, ConfigError, TandemConfig, cache_root,
                                   parse_backends)
from tandem.engine.config import CPU_KERNELS


CONFIG_REFERENCE = ("Every setting, its YAML field, default and why: docs/config.md (--config FILE sets them all); "
                    "--help-all lists the advanced flags too.")


class _HelpAll(argparse.Action):
    """`--help-all`: the help with the advanced group's flags shown too (`--help` leaves them out,
    so it fits on one screen)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="show this help with the advanced flags too and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object,
                 option_string: str | None = None) -> None:
        for action in parser._actions:
            action.help = getattr(action, "full_help", action.help)
        parser.print_help()
        parser.exit()


def hide_advanced(parser: argparse.ArgumentParser, advanced: argparse._ArgumentGroup) -> None:
    """Leave the advanced group's flags out of `--help` (they still work); `--help-all` shows them."""
    for action in advanced._group_actions:
        action.full_help, action.help = action.help, argparse.SUPPRESS
    parser.add_argument("--help-all", action=_HelpAll)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    advanced = add_cluster_arguments(parser)
    parser.add_argument("--policy", metavar="NAME",
                        help="cost (default), prefix-affinity, accelerator-only, cpu-only, round-robin, random, "
                             "least-requests")
    parser.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, metavar="N", help="HTTP port (default 8000)")
    parser.add_argument("--metrics-port", type=int, metavar="N",
                        help="Prometheus scrape port (default 8080; /metrics on --port serves the same)")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get("TANDEM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY, else none)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="model name clients send (default: the model's)")
    parser.add_argument("--rates", metavar="FILE", help="rates file from tandem profile (default: profile cache)")
    parser.add_argument("--profile", choices=["auto", "always", "never"], metavar="WHEN",
                        help="profile backends: auto (without cached rates; default), always, never")
    parser.add_argument("--routing-log", metavar="FILE", help="append a JSON line per routing decision (default off)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, metavar="LEVEL",
                        help="console log level: debug, info, warning (default) or error")
    advanced.add_argument("--calibration-alpha", type=float, metavar="A",
                          help="observed-step weight in online rate calibration (default 0.2; 0: off)")
    advanced.add_argument("--spill-margin", type=float, metavar="F",
                          help="a CPU must beat the accelerator's score by this share (default 0.05)")
    advanced.add_argument("--spill-allow-queue", action="store_true", default=None,
                          help="let a CPU queue work an accelerator could take (default: free slots only)")
    advanced.add_argument("--warmup-tokens", type=int, metavar="N",
                          help="tokens of the co-running warm-up before serving (default 48; 0: none)")
    advanced.add_argument("--new-token-ratio", action="store_true", default=None,
                          help="discount queued decode budgets with SGLang's decaying new_token_ratio")
    advanced.add_argument("--device-shares", action="store_true", default=None,
                          help="score engines that share a GPU by their share of it (default: each alone)")
    advanced.add_argument("--ingress", choices=("auto", "direct", "proxy"), metavar="MODE",
                          help="direct (replicas share --port), proxy, or auto: direct unless --address")
    advanced.add_argument("--http-replicas", type=int, metavar="N",
                          help="HTTP ingress processes (default: one per 4 cores, 1 to 4)")
    advanced.add_argument("--address", metavar="ADDR",
                          help="join this Ray cluster (auto or HOST:6379) instead of starting one")
    advanced.add_argument("--dashboard", action="store_true", default=None, help="start the Ray dashboard")
    advanced.add_argument("--dashboard-port", type=int, metavar="N", help="Ray dashboard port (default 8265)")
    advanced.add_argument("--access-log", action="store_true", default=None,
                          help="log a line per HTTP request (Serve's access log; default off)")
    hide_advanced(parser, advanced)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Flags `serve` and `profile` share; returns the "advanced" group for the caller's rare flags.
    Help is one line per flag: the why, the measurements and the details are in docs/config.md."""
    parser.epilog = CONFIG_REFERENCE
    parser.add_argument("--config", metavar="FILE", help="YAML config file; flags override it")
    parser.add_argument("--model", help="preset name, local HF directory or .gguf file (default smollm2-135m)")
    parser.add_argument("--backends", metavar="LIST",
                        help="cpu, cuda, mps, sim, auto, ID=DEVICE, cuda*2, cuda*all (default cpu,auto)")
    parser.add_argument("--max-active", type=int, metavar="N",
                        help="running requests per backend (default by device: cpu 4, a GPU 256, mps 32)")
    cpu = parser.add_argument_group("every backend on the cpu")
    cpu.add_argument("--cpu-threads", type=int, metavar="N",
                     help="torch threads per cpu backend (default: the cores left over, shared)")
    cpu.add_argument("--cpu-dtype", choices=("auto", "float32", "bfloat16", "int8", "int4"), metavar="DTYPE",
                     help="float32 (default), bfloat16, int8 or int4 (weight-only quantized), auto")
    cpu.add_argument("--cpu-kernels", choices=CPU_KERNELS, metavar="KIND",
                     help="whose kernels: auto (default: ggml graph for float32 decode where built), torch, "
                          "ggml (int8/int4) or ggml-graph")
    cpu.add_argument("--cpu-compile", action="store_true", default=None,
                     help="decode through torch.compile'd graphs (opt-in, measure first; default off)")
    advanced = parser.add_argument_group("advanced")
    advanced.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                          help="share of each GPU's memory its engines use together (default 0.9)")
    advanced.add_argument("--kv-host-memory-gb", type=float, metavar="GIB",
                          help="host memory per cuda backend for KV blocks its GPU evicts, reloaded instead of "
                               "recomputed (default: a quarter of free RAM, shared; 0: off)")
    advanced.add_argument("--sim-profile", metavar="NAME|FILE",
                          help="the device sim backends emulate: a shipped profile (default "
                               f"{DEFAULT_SIM_PROFILE}) or a `tandem profile` file")
    advanced.add_argument("--sim-time-scale", type=float, metavar="K",
                          help="sim steps last K times their profile's (many fast engines on a small host)")
    return advanced


def load_config(args: argparse.Namespace, **extra: object) -> TandemConfig:
    config = TandemConfig.from_yaml(args.config) if args.config else TandemConfig()
    overrides = dict(model=args.model, max_active=args.max_active, cpu_threads=args.cpu_threads,
                     gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                     kv_host_memory_gb=getattr(args, "kv_host_memory_gb", None),
                     sim_profile=getattr(args, "sim_profile", None),
                     sim_time_scale=getattr(args, "sim_time_scale", None), **extra)
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
            new_token_ratio=args.new_token_ratio, device_shares=args.device_shares, host=args.host, port=args.port, metrics_port=args.metrics_port,
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
