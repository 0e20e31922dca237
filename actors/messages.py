"""Small, picklable messages between the backend actors, the router actor and their callers.

Kept free of torch and ray so the HTTP ingress and driver scripts can import them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Admitted:
    """First item of every `BackendActor.generate` stream: the engine accepted the request.

    Callers wait for it before answering HTTP, so a request the engine rejects still gets a
    proper 4xx status instead of an error inside a 200 stream. `BackendActor.add` returns it
    with the request's first outputs when the engine's next step or the one after brings them
    (packed, see actors/engine_core.py; all of a one-token request), so the first token reaches
    the caller with the answer instead of a channel message later; a request still queued then
    is answered without them, and a rejection at once.

    `received_time` (the backend actor took the add) and `queued_time` (the engine core queued
    the request) are `time.time()` stamps that split the add's trip into its hops
    (cluster/dispatch.py `admission_stages`); None where a path does not stamp them.
    """

    req_id: str
    backend_id: str
    num_prompt_tokens: int
    outputs: list = field(default_factory=list)
    received_time: float | None = None
    queued_time: float | None = None


@dataclass
class BackendInfo:
    """What a backend tells the router when it (re)joins, and the driver when asked."""

    backend_id: str
    instance_id: str  # new on every (re)start, so a stale failure report cannot drop a new incarnation
    device: str
    device_kind: str
    requested_device: str
    dtype: str
    threads: int
    max_active: int
    block_size: int
    model_name: str
    max_model_len: int
    node_id: str = ""
    rates: dict[str, Any] | None = None  # routing's RateProfile fields; None: keep the router's
    reconstructed: bool = False


@dataclass
class Decision:
    """The router's answer to `route`: where to send the request and the full record."""

    req_id: str
    backend_id: str
    instance_id: str
    record: dict[str, Any] = field(default_factory=dict)  # routing.DecisionRecord.to_dict()
    estimated_s: float | None = 0.0  # None: not scored (the request went to the fixed choice)
    handle: Any = None  # the chosen backend's actor handle
    projected_ttft_s: float | None = None  # the chosen backend's projected TTFT (None: not scored)


@dataclass
class Placement:
    """The router's answer to `place`, for the serving path: where the request goes and what
    the router expected there. `estimated_s` is the chosen backend's score and
    `projected_ttft_s` its projected time to first token (routing/deadline.py); both None when
    nothing was scored (the request went to the fixed choice)."""

    backend_id: str
    instance_id: str
    estimated_s: float | None = None
    projected_ttft_s: float | None = None


class BackendError(RuntimeError):
    """The backend failed while serving a request (engine error, or it is shutting down)."""


class BackendGone(RuntimeError):
    """The same-node wire to a backend closed under a request (actors/wire.py): the backend's
    process is gone, as a `RayActorError` says on the Ray path, and the request may be routed
    again if it has no tokens yet."""
