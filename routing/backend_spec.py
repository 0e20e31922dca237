"""What the router knows about one backend: its id, device kind, rates and concurrency.

`device_kind` is "cpu" or an accelerator ("cuda", "mps", ...). It matters for the
`accelerator-only` and `cpu-only` policies and for ties, which go to the accelerator.
`max_active` is the backend scheduler's limit on running requests; the simulator uses it to
decide active vs queued, and a batch-aware rate profile uses it to pick the batch size.
`device` names the accelerator an engine runs on ("cuda:0") when several engines share one:
their steps compete for its compute, so what online calibration learns from one engine's steps
is the device's state and holds for its identical siblings too (routing/router.py); route-sim
runs such backends' steps on one shared device (routing/sim_device.py), and the router's
`device_shares` option scores them by it (routing/device_share.py). None: a device of its own
(every CPU backend, whose threads are its own).
`max_priority_wait_s` is the backend scheduler's starvation bound: a less urgent request queued
longer is admitted as if most urgent, so TTFT projections count it ahead (routing/deadline.py).
None: unknown, and projections ignore aging.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.routing.rates import RateProfile


@dataclass
class BackendSpec:
    backend_id: str
    device_kind: str
    rates: RateProfile
    max_active: int = 4
    device: str | None = None
    max_priority_wait_s: float | None = None

    def __post_init__(self) -> None:
        if not self.backend_id:
            raise ValueError("backend_id must be a non-empty string")
        if not self.device_kind:
            raise ValueError(f"backend {self.backend_id!r}: device_kind must be non-empty")
        if self.max_active < 1:
            raise ValueError(f"backend {self.backend_id!r}: max_active must be >= 1 (got {self.max_active})")
        if self.max_priority_wait_s is not None and not self.max_priority_wait_s >= 0:
            raise ValueError(f"backend {self.backend_id!r}: max_priority_wait_s must be >= 0 seconds "
                             f"(got {self.max_priority_wait_s})")

    @property
    def is_cpu(self) -> bool:
        return self.device_kind == "cpu"

    def preference_key(self) -> tuple[bool, str]:
        """Tie-break order: accelerators before CPUs, then lower backend_id."""
        return (self.is_cpu, self.backend_id)
