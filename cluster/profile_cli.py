"""`tandem profile`: measure each backend alone and write the rates file the router loads.

Backends are profiled in this process, one after another, each with the machine to itself (no
Ray, no server), which is what "isolated profile" means in the design. Backends on identical
devices (same model, device and GPU model, dtype, threads, max_active) are measured once and
share the result, as in `tandem serve` (cluster/profile.py). The output maps backend id
to routing's RateProfile fields and is what `tandem serve --rates FILE` reads; the same numbers
go into the profile cache that `tandem serve` consults on start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

from tandem.cluster.config import ConfigError
from tandem.cluster.serve_cli import add_cluster_arguments, hide_advanced, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hide_advanced(parser, add_cluster_arguments(parser))
    parser.add_argument("--output", default="tandem-rates.json", help="rates file to write (default tandem-rates.json)")
    parser.add_argument("--prompt-len", type=int, default=512, help="uncached prompt tokens for prefill (default 512)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens per decode run (default 16)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measure this many times and take each rate's median (default 3)")
    parser.add_argument("--sim-profiles", metavar="DIR",
                        help="also write each backend's sim profile (rates, context cost, engine shape) to "
                             "DIR/ID.json, for `--backends sim --sim-profile DIR/ID.json`")
    parser.add_argument("--context-len", type=int, default=1024, metavar="N",
                        help="sim profiles: the long context whose decode cost is measured (default 1024)")


def run(args: argparse.Namespace) -> int:
    from tandem.cluster.plan import plan_backends
    from tandem.cluster.profile import (NOT_STORED_PROFILE, load_cache, rate_fields, resolve_profiles, store_in_cache,
                                        write_rates_file)
    from tandem.engine.profiler import measure_rates
    from tandem.routing.step_time import sim_profile_from_dict

    try:
        config = load_config(args)
        num_gpus, mps = _local_accelerators()
        plans = plan_backends(config, num_gpus, mps)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Engines that share a GPU are packed k to a device, as Ray's fractional GPUs place them.
    cuda_index = {p.backend_id: i // p.engines_per_gpu for i, p in enumerate(p for p in plans if p.device == "cuda")}
    plan_of = {plan.backend_id: plan for plan in plans}
    # A sim backend's rates are its profile's: the device it emulates was measured already.
    emulated = {plan.backend_id: sim_profile_from_dict(plan.sim_profile).rate_fields()
                for plan in plans if plan.sim_profile is not None}
    wanted = [(plan.backend_id, _plan_key(config, plan, cuda_index.get(plan.backend_id)))
              for plan in plans if plan.backend_id not in emulated]

    def measure(backend_id: str) -> dict:
        plan = plan_of[backend_id]
        engine = _load_engine(config, plan, cuda_index.get(backend_id, 0))
        try:
            entry = measure_rates(engine, plan.max_active, prompt_len=args.prompt_len,
                                  decode_tokens=args.decode_tokens, repeats=args.repeats)
            if args.sim_profiles:
                entry["sim"] = _sim_extras(engine, plan, args)
            return entry
        finally:
            del engine
            gc.collect()

    found = resolve_profiles(wanted, {}, "always", measure,
                             store=lambda key, entry: store_in_cache(config.rates_cache, key, entry),
                             log=lambda line: print(line, flush=True), previous=load_cache(config.rates_cache),
                             not_stored=NOT_STORED_PROFILE)
    found.update(emulated)
    write_rates_file(args.output, {plan.backend_id: rate_fields(found[plan.backend_id]) for plan in plans})
    print(f"wrote {args.output}; use it with: tandem serve --rates {args.output}")
    if args.sim_profiles:
        _write_sim_profiles(args.sim_profiles, found)
    return 0


def _sim_extras(engine, plan, args: argparse.Namespace) -> dict:
    """What a sim profile holds beyond the rates: the context cost by batch, the prefill table and
    the engine's shape."""
    import platform

    from tandem.engine.profiler import measure_sim_extras

    extras = measure_sim_extras(engine, args.context_len, args.decode_tokens, repeats=args.repeats)
    description = (f"tandem profile of {engine.model_name} on {engine.config.device} ({plan.reason}), dtype "
                   f"{engine.config.dtype}, {plan.threads} thread{'s' if plan.threads != 1 else ''}, "
                   f"{platform.node() or 'this machine'}")
    return {"description": description, "device_kind": engine.device_kind, **extras}


def _write_sim_profiles(directory: str, found: dict) -> None:
    import json
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for backend_id, entry in found.items():
        if "sim" not in entry:
            continue
        path = out / f"{backend_id}.json"
        path.write_text(json.dumps(sim_profile_fields(entry), indent=1) + "\n")
        print(f"wrote {path}; use it with: tandem serve --backends sim --sim-profile {path}")


def sim_profile_fields(entry: dict) -> dict:
    """A measured entry as a sim profile (routing/step_time.py's `SimProfile`): its rates, with a
    host KV tier's reload rate under the profile's name for it, and the sim extras."""
    from tandem.cluster.profile import rate_fields

    fields = rate_fields(entry)
    reload_tok_s = fields.pop("reload_tok_s", None)
    if reload_tok_s is not None:
        fields["host_reload_tok_s"] = reload_tok_s
    return {**fields, **entry["sim"]}


def _plan_key(config, plan, cuda_index: int | None) -> str:
    """The key `tandem serve` gives this backend (cluster/launcher.py), without loading it: the
    engine names its model as configured and resolves its dtype by EngineConfig's rule."""
    from tandem.cluster.profile import gpu_model, profile_key
    from tandem.engine.config import EngineConfig

    engine_config = EngineConfig(model=config.model, device=plan.device, dtype=plan.dtype,
                                 cpu_kernels=plan.cpu_kernels)
    dtype = engine_config.weight_quantization or str(engine_config.torch_dtype)  # int4 rates are not bf16's
    name = ""
    if plan.device == "cuda":
        import torch

        name = gpu_model(torch.cuda.get_device_name(cuda_index))
    kernels = plan.cpu_kernels
    if plan.device == "cpu":  # what `auto` runs here, as the backend's engine resolves it
        from tandem.engine.model.ggml_kernels import auto_kernels

        kernels = auto_kernels(dataclasses.replace(engine_config, cpu_compile=plan.cpu_compile))[0]
    return profile_key(config.model, plan.device, dtype.removeprefix("torch."), plan.threads, plan.max_active, name,
                       cpu_compile=plan.cpu_compile, cpu_kernels=kernels, host_tier=plan.kv_host_memory_gb > 0)


def _load_engine(config, plan, cuda_index: int):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    device = f"cuda:{cuda_index}" if plan.device == "cuda" else plan.device
    return LLMEngine(EngineConfig(**{**plan.engine_kwargs(config), "device": device, "num_threads": plan.threads}))


def _local_accelerators() -> tuple[int, bool]:
    import torch

    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), mps
