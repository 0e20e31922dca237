"""Tandem's cluster layer: start/connect, the Serve app, the CLI, metrics and config.

`cluster.start(...)` and `cluster.connect(...)` (see cluster/launcher.py) are the Python driver
API; they are imported on first use so that `tandem --help` and `tandem generate` do not pay
for them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Tandem", "connect", "start"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tandem.cluster import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'tandem.cluster' has no attribute {name!r}")
