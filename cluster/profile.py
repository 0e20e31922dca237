"""Remember each backend's measured rates per model, device, dtype and threads.

The measurement itself is `tandem.engine.profiler.measure_rates`. Results are cached in one JSON
file keyed by what changes them (`profile_key`, which includes the engine's speed version,
bumped when the engine gets much faster or slower), so `tandem serve` profiles a backend once
per model/device/dtype/threads and starts at once afterwards.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tandem.engine.profiler import ENGINE_SPEED_VERSION


def profile_key(model: str, device_kind: str, dtype: str, threads: int) -> str:
    return f"{model}|{device_kind}|{dtype}|threads={threads}|v{ENGINE_SPEED_VERSION}"


# -- the cache -------------------------------------------------------------------------------
def load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def store_in_cache(path: Path, key: str, rates: dict[str, Any]) -> None:
    """Add one entry, writing atomically (a rename), so concurrent starts never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_cache(path)
    data[key] = rates
    fd, tmp = tempfile.mkstemp(prefix=".rates-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def write_rates_file(path: Path, rates_by_backend: dict[str, dict[str, Any]]) -> None:
    """The file routing's `load_rate_profiles` reads: backend id -> profile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rates_by_backend, indent=2, sort_keys=True) + "\n")
