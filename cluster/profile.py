"""Remember each backend's measured rates, and measure identical devices once.

The measurement itself is `tandem.engine.profiler.measure_rates` (repeats, medians, and how far
the repeats spread). Results are cached in one JSON file keyed by what changes them
(`profile_key`: model, device kind and GPU model, dtype, whose kernels run a quantized CPU
model and whether its decode is compiled, threads, max_active, and the engine's speed version,
bumped when the engine gets much faster or slower), so `tandem serve` profiles a backend once
per key and starts at once afterwards.

Backends with the same key are identical devices running the same engine: they share one
profile (`resolve_profiles` measures the first and gives its rates to the others) rather than
each being measured alone: measured separately, identical GPUs can come out far apart
(docs/benchmarks/README.md), and the router would treat one as slower than its twin.
A measurement whose repeats spread more than `MAX_SPREAD` is used for the run that measured it
but not cached (a noisy profile would otherwise steer the router on every later start), with a
warning naming the flag that measures again; a cached entry that spread that much is measured
again. A re-profile (`--profile always`) that moves a rate more than
`MAX_SPREAD` from the cached entry is reported as a warning.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.cluster.config import ConfigError
from tandem.engine.profiler import ENGINE_SPEED_VERSION

RATE_FIELDS = ("prefill_tok_s", "decode_tok_s", "decode_tok_s_by_batch", "reload_tok_s")  # routing's RateProfile
MAX_SPREAD = 0.10  # repeats, or a re-profile of the same device, should agree within 10%
# What a noisy measurement's warning adds, for `tandem serve` (cluster/launcher.py) and `tandem profile`.
NOT_STORED_SERVE = ("not stored in the profile cache, so these rates serve this run only; measure again once "
                    "the machine is quiet: tandem serve --profile always")
NOT_STORED_PROFILE = ("not stored in the profile cache, only written to the rates file; measure again once the "
                      "machine is quiet: run tandem profile again (tandem serve --profile always measures at start)")
# How Ray names an NVIDIA GPU in its `accelerator_type:` node resource ("NVIDIA H200" -> "H200").
_GPU_MODEL = re.compile(r"\w+\s+((?:[A-Z]+\s+)*[A-Z0-9]*\d[A-Z0-9]*)")


def profile_key(model: str, device_kind: str, dtype: str, threads: int, max_active: int,
                device_name: str = "", cpu_compile: bool = False, cpu_kernels: str = "torch",
                host_tier: bool = False) -> str:
    """A compiled CPU decode (`cpu_compile`) is keyed apart from the eager one (`int4-compiled`
    beside `int4`), and ggml's kernels (`cpu_kernels`) likewise (`int4-ggml`, `int4-ggml-compiled`):
    each runs at its own speed, which differs by machine and batch size. Callers pass the kernels a
    cpu backend actually runs, the default `auto` resolved on its machine (`float32-ggml-graph`
    where ggml is built, plain `float32` where not): the rates are those kernels'. Other devices
    have no cpu kernels. An engine with a host KV tier (`host_tier`) is keyed apart too: its
    profile holds the tier's reload rate, which one without a tier has no way to measure."""
    device = f"{device_kind}:{device_name}" if device_name else device_kind
    if cpu_kernels != "torch" and device_kind == "cpu":
        dtype = f"{dtype}-{cpu_kernels}"
    if cpu_compile:
        dtype = f"{dtype}-compiled"
    tier = "|host-tier" if host_tier else ""
    return f"{model}|{device}|{dtype}|threads={threads}|max_active={max_active}{tier}|v{ENGINE_SPEED_VERSION}"


def gpu_model(name: str) -> str:
    """A GPU's model the way Ray's `accelerator_type` resource spells it, from torch's device
    name, so `tandem profile` (torch) and `tandem serve` (Ray) give a GPU the same key."""
    match = _GPU_MODEL.match(name)
    result = match.group(1).replace(" ", "-") if match else ""
    return result if len(result) > 1 else re.sub(r"^NVIDIA\s+", "", name).strip().replace(" ", "-")


def rate_fields(entry: dict[str, Any]) -> dict[str, Any]:
    """The RateProfile fields of a measurement or cache entry (without its `spread`)."""
    return {k: entry[k] for k in RATE_FIELDS if k in entry}


def worst_spread(entry: dict[str, Any]) -> float:
    """How far a measurement's repeats spread at most (0 for an entry without `spread`)."""
    spread = entry.get("spread") or {}
    return max((v for k, v in spread.items() if k != "repeats"), default=0.0)


def is_steady(entry: dict[str, Any]) -> bool:
    """Whether a measurement may be cached: its repeats agree within `MAX_SPREAD`."""
    return worst_spread(entry) <= MAX_SPREAD


def spread_warning(entry: dict[str, Any], not_stored: str = NOT_STORED_SERVE) -> str | None:
    if is_steady(entry):
        return None
    spread = entry["spread"]
    return (f"warning: the profile's {spread.get('repeats')} repeats spread {100 * worst_spread(entry):.0f}% "
            f"(prefill {100 * spread.get('prefill_tok_s', 0):.0f}%, decode {100 * spread.get('decode_tok_s_by_batch', 0):.0f}%), "
            f"more than {100 * MAX_SPREAD:.0f}%: something else was running, or the device is not steady; "
            f"{not_stored}")


def rate_difference(old: dict[str, Any], new: dict[str, Any]) -> float:
    """The largest relative change of any rate (prefill, each decode batch size) from `old`."""
    pairs = [(old["prefill_tok_s"], new["prefill_tok_s"]), (old["decode_tok_s"], new["decode_tok_s"])]
    old_table = {int(b): r for b, r in (old.get("decode_tok_s_by_batch") or {}).items()}  # JSON keys are text
    new_table = {int(b): r for b, r in (new.get("decode_tok_s_by_batch") or {}).items()}
    pairs += [(old_table[b], new_table[b]) for b in old_table if b in new_table]
    return max(abs(b - a) / a for a, b in pairs)


def describe_spread(entry: dict[str, Any]) -> str:
    spread = entry.get("spread")
    if not spread:
        return ""
    return (f"; {spread['repeats']} repeats spread prefill {100 * spread['prefill_tok_s']:.1f}%, "
            f"decode {100 * spread['decode_tok_s_by_batch']:.1f}%")


def resolve_profiles(wanted: list[tuple[str, str]], cache: dict[str, Any], mode: str,
                     measure: Callable[[str], dict[str, Any]], store: Callable[[str, dict[str, Any]], None],
                     log: Callable[[str], None], previous: dict[str, Any] | None = None,
                     not_stored: str = NOT_STORED_SERVE) -> dict[str, dict[str, Any]]:
    """Rates for each (backend_id, key) in `wanted`: the cache's entry, else one measurement per
    key (`measure(backend_id)` on its first backend, `store(key, entry)` keeps it), shared by
    every backend with that key. `mode` is --profile (auto, always, never); `previous` holds the
    cache as it was, so a re-profile is compared with what it replaces. A measurement whose
    repeats spread more than `MAX_SPREAD` is used but not stored, and its warning ends with
    `not_stored` (what happens to it, and the command that measures again); in `auto` mode a
    cached entry that spread that much is measured again. Returns backend_id -> the entry
    (RateProfile fields plus `spread`, when measured)."""
    previous = previous or {}
    found: dict[str, dict[str, Any]] = {}
    first_of: dict[str, str] = {}
    for backend_id, key in wanted:
        if key in first_of:
            found[backend_id] = found[first_of[key]]
            log(f"rates for {backend_id}: the same device and engine as {first_of[key]} ({key}): shares its profile")
            continue
        first_of[key] = backend_id
        cached = cache.get(key) if mode != "always" else None
        if cached is not None and (mode == "never" or is_steady(cached)):
            found[backend_id] = cached
            log(f"rates for {backend_id} from the profile cache: {describe_rates(cached)}")
            if not is_steady(cached):
                log(f"  warning: its repeats spread {100 * worst_spread(cached):.0f}%, more than "
                    f"{100 * MAX_SPREAD:.0f}%; measure again once the machine is quiet: tandem serve --profile always")
            continue
        if cached is not None:
            log(f"cached rates for {backend_id} spread {100 * worst_spread(cached):.0f}% across their repeats, "
                f"more than {100 * MAX_SPREAD:.0f}%: measuring again")
        if mode == "never":
            raise ConfigError(f"no rates for backend {backend_id} ({key}) and profiling is off; "
                              "run `tandem profile` or pass --rates FILE")
        sharing = [b for b, k in wanted if k == key and b != backend_id]
        log(f"profiling backend {backend_id} ({key})"
            + (f" for {', '.join([backend_id, *sharing])}" if sharing else "")
            + "; this happens once per model/device/dtype/threads/max_active")
        start = time.perf_counter()
        entry = measure(backend_id)
        log(f"  {backend_id}: {describe_rates(entry)}{describe_spread(entry)}, in {time.perf_counter() - start:.1f} s")
        for warning in filter(None, [spread_warning(entry, not_stored), _reprofile_warning(previous.get(key), entry)]):
            log(f"  {warning}")
        if is_steady(entry):
            store(key, entry)
        found[backend_id] = entry
    return found


def _reprofile_warning(old: dict[str, Any] | None, new: dict[str, Any]) -> str | None:
    if old is None:
        return None
    try:
        change = rate_difference(old, new)
    except (KeyError, ZeroDivisionError):
        return None
    if change <= MAX_SPREAD:
        return f"re-profile agrees with the cached profile of this device within {100 * change:.1f}%"
    return (f"warning: re-profile differs from the cached profile of this device by {100 * change:.1f}% "
            f"(more than {100 * MAX_SPREAD:.0f}%)")


def describe_rates(rates: dict[str, Any]) -> str:
    text = f"prefill {rates['prefill_tok_s']:.0f} tok/s, decode {rates['decode_tok_s']:.1f} tok/s (batch 1)"
    by_batch = rates.get("decode_tok_s_by_batch")
    if by_batch:
        text += f", by batch {{{', '.join(f'{b}: {r:.1f}' for b, r in by_batch.items())}}}"
    return text


# -- the cache -------------------------------------------------------------------------------
def load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def store_in_cache(path: Path, key: str, rates: dict[str, Any]) -> None:
    """Add one entry, writing atomically (a rename), so concurrent starts never see half a file.
    Whether a measurement is steady enough to keep is `resolve_profiles`'s call (`is_steady`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_cache(path)
    data[key] = rates
    fd, tmp = tempfile.mkstemp(prefix=".rates-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def write_rates_file(path: Path, rates_by_backend: dict[str, dict[str, Any]]) -> None:
    """The file routing's `load_rate_profiles` reads: backend id -> profile (rate fields only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rates = {backend_id: rate_fields(entry) for backend_id, entry in rates_by_backend.items()}
    path.write_text(json.dumps(rates, indent=2, sort_keys=True) + "\n")
