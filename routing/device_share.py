"""Engines that share one device: how many of them a backend's work is split with.

With `device_shares` on, the router treats backends whose `BackendSpec.device` names the same
device as the simulator does (routing/sim_device.py): while k of them have work, each runs at
1/k of its profiled speed. A backend's share is k counting itself as busy, because a request
sent to an idle backend makes it busy. The cost model divides the backend's rates by that
share (routing/cost_model.py), so waking an idle engine on a busy device costs what it does,
and calibration multiplies an observed step's throughput by it, so the rates it learns stay
per-engine-alone rates rather than absorbing the neighbours' load as well.

A backend's work counts as "there" while its ledger holds a request, active or queued. A
backend without a device (None) is alone on its own: share 1. `tandem serve --device-shares`
(the `device_shares` setting, off by default) and route-sim's scenarios turn it on;
docs/routing.md, "Several engines on one GPU", says what it does.
"""

from __future__ import annotations

from typing import Mapping


def device_shares(devices: Mapping[str, str | None], num_pending: Mapping[str, int]) -> dict[str, int]:
    """Each backend's share: 1 plus the other backends on its device with pending work."""
    num_busy: dict[str, int] = {}
    for backend_id, device in devices.items():
        if device is not None and num_pending[backend_id] > 0:
            num_busy[device] = num_busy.get(device, 0) + 1
    return {backend_id: 1 if device is None else
            1 + num_busy.get(device, 0) - (num_pending[backend_id] > 0)
            for backend_id, device in devices.items()}
