"""What a backend's TTFT projection leaves out, learned from the first tokens it serves.

The projection (routing/deadline.py) counts what the ledger shows: the prefill ahead of a
request, its own, and the wait for a slot. Three costs are invisible there: the rest of the
engine step already running when the request arrives (on a CPU backend a batch prefill step
can take half a second), the decode tokens of the running requests that ride along in every
step up to and including the request's own prefill, and the hops between the router, the
backend and the client. Each is roughly steady for a given backend and load, so together they
show up as a bias, a projection late by about the same amount request after request
(docs/benchmarks/deadlines-cpu-2core.md measures it on two CPU backends).

So the router learns that bias as it calibrates rates (routing/rates.py): the error of each
first token (observed TTFT minus the projection the request was placed with, offset included)
moves the backend's offset by `alpha` of it, and later projections add the offset. A backend
with nothing pending has no step in progress and no riders, so its bias is learned apart from a
busy one's: a burst's late first tokens do not make an idle backend look slow.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TTFTOffset:
    """One backend's learned projection offsets (seconds, either sign), idle and busy."""

    idle_s: float = 0.0
    busy_s: float = 0.0

    def offset_s(self, busy: bool) -> float:
        """What to add to a projection made while the backend is `busy` (has work pending)."""
        return self.busy_s if busy else self.idle_s

    def observe(self, busy: bool, error_s: float, alpha: float) -> None:
        """Blend in one first token's error (observed minus projected TTFT) of a request placed
        while the backend was `busy`."""
        if busy:
            self.busy_s += alpha * error_s
        else:
            self.idle_s += alpha * error_s
