"""Several simulated backends on one device: the device's time is shared among their steps.

`tandem serve --backends cuda*4` runs four engines on one GPU, each profiled alone, so a
profile says how long a step takes when its engine has the GPU to itself. When several of
them have a step to run at once, the GPU time-slices between their processes (kernels of
different processes do not overlap without MPS), so each runs slower.

The model is processor sharing: while k backends of one device are in a step, each progresses
at 1/k of its profiled speed. A step's profiled duration is its *work*; a step that runs
alongside one other for its whole length takes twice its profiled time, and when a neighbour
starts or finishes a step, the others' remaining work is re-timed at the new k. The device is
never idle while a member has a step to run and never does more than one profile's worth of
work per second, so the total throughput of the device equals one engine's, whatever the
split. It is chosen over "one step at a time, round-robin" because a GPU time-slices at a
granularity finer than a long prefill step: a neighbour's decode step is not held back for
the whole of a 4k-token prefill.

What it leaves out: a profile includes its engine's host time (scheduling, launching
kernels) during which the GPU is idle, and another engine's kernels can run then. For a small
model whose step loop is host-bound, k engines together can deliver more than one, so this
model is pessimistic there; for a compute-bound step it is about right.

On a shared device a backend's decode runs are single steps (routing/sim_backend.py): a run
of many identical steps planned ahead would fix its end time, which a neighbour's next step
changes. A backend whose device no other backend names is simulated exactly as before, with
no `SimDevice` at all.
"""

from __future__ import annotations

import math
from typing import Protocol


class DeviceMember(Protocol):
    """What the device needs of a backend (routing/sim_backend.py's `SimBackend`)."""

    backend_id: str
    step: str | None  # None: idle
    step_end_s: float

    def next_boundary(self) -> float: ...

    def process_boundary(self) -> None: ...


class SimDevice:
    """The members' steps, timed together; advance the members only through their device."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.members: list[DeviceMember] = []
        self.work_left_s: dict[str, float] = {}  # profiled seconds left in each busy member's step
        self.last_s = -math.inf  # when work_left_s was last brought up to date
        self.num_busy = 0

    def add(self, backend: DeviceMember) -> None:
        self.members.append(backend)

    def begin_step(self, backend: DeviceMember, work_s: float) -> None:
        """`backend` starts a step that takes `work_s` alone; `_retime` sets its end once the
        boundary is processed and the number of busy members is known."""
        self.work_left_s[backend.backend_id] = work_s
        backend.step_end_s = math.inf

    def advance_to(self, t: float) -> None:
        """Process every member boundary strictly before `t`, in time order across members."""
        while True:
            backend = min(self.members, key=lambda b: b.next_boundary())  # first on ties: list order
            boundary_s = backend.next_boundary()
            if boundary_s >= t:
                return
            self._settle(boundary_s)
            backend.process_boundary()
            self._retime(boundary_s, backend)

    def run_to_completion(self) -> None:
        self.advance_to(math.inf)

    def _busy(self) -> list[DeviceMember]:
        return [b for b in self.members if b.step is not None]

    def _settle(self, t: float) -> None:
        """Take the work done since `last_s` off every busy member's step (each at 1/k speed)."""
        if self.num_busy and t > self.last_s:
            done_s = (t - self.last_s) / self.num_busy
            for backend in self._busy():
                self.work_left_s[backend.backend_id] = max(0.0, self.work_left_s[backend.backend_id] - done_s)
        self.last_s = t

    def _retime(self, t: float, stepped: DeviceMember) -> None:
        """After `stepped`'s boundary at `t`: its new step's end, and every member's if k changed."""
        busy = self._busy()
        if len(busy) != self.num_busy:
            self.num_busy = len(busy)
            retimed = busy
        else:
            retimed = [stepped] if stepped.step is not None else []
        for backend in retimed:
            backend.step_end_s = t + self.work_left_s[backend.backend_id] * self.num_busy
