"""The GIL's switch interval of a serving process (`TANDEM_SWITCH_INTERVAL_S`).

A backend actor runs its event loop, a reader thread for the engine core's messages and Ray's
own threads; an ingress replica runs its event loop and Ray's threads. When one thread holds
the GIL busy, another that wants it waits up to `sys.getswitchinterval()` (5 ms by default)
before CPython makes the holder let go, and a request crosses such a hand-over several times
on its way to the engine and back. The variable sets the interval for these processes
(seconds; unset: Python's default), so the cost of those waits can be measured and tuned.
"""

from __future__ import annotations

import os
import sys

ENV = "TANDEM_SWITCH_INTERVAL_S"


def apply_switch_interval() -> float:
    """Set this process's switch interval from the environment; returns the one in force."""
    value = os.environ.get(ENV)
    if value:
        sys.setswitchinterval(float(value))
    return sys.getswitchinterval()
