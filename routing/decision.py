"""The record of one routing decision: every backend's score terms and the choice made.

These records are the router's diagnostic log (one JSON line each, `to_dict()`), what the
metrics show, and what the simulator prints, so a surprising placement can be explained from
the log alone: "GPU prefill 60 tok / 2551 + decode 880 tok / 293 = 3.027 s < CPU 3.118 s".
Scores are computed for every backend under every policy, so even a `round-robin` log shows
what `cost` would have done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BackendScore:
    backend_id: str
    device_kind: str
    num_cached_tokens: int  # the new request's reusable prefix on this backend (in flight included)
    num_prefill_tokens: float  # pending + new uncached prompt tokens
    num_decode_tokens: float  # pending budgets (times new_token_ratio) + the new max_tokens
    prefill_term_s: float
    decode_term_s: float
    score_s: float
    num_active: int
    num_queued: int
    max_active: int = 4  # the backend's slots (the spill guard asks whether one is free)
    new_token_ratio: float = 1.0
    prefill_tok_s: float = 0.0  # rates used (after calibration, if on)
    decode_tok_s: float = 0.0
    num_inflight_cached_tokens: int = 0  # the prefix that requests in flight here will have cached
    recompute_term_s: float = 0.0  # weighted prefill of a prefix another routable backend holds
    replication_term_s: float = 0.0  # instead, where a copy of that prefix is an investment (< 0 once it pays)
    queue_term_s: float = 0.0  # the new request's prefill x the requests queued here, which it delays
    projected_ttft_s: float = 0.0  # the new request's time to first token here (routing/deadline.py)
    num_host_cached_tokens: int = 0  # the prefix after the device hit that the host tier holds here
    reload_term_s: float = 0.0  # copying those tokens back to the device (routing/cost_model.py, the host tier)

    @property
    def rank_s(self) -> float:
        """What the score-based policies minimise: the score plus the recompute or the
        replication term, plus the queue term."""
        return self.score_s + self.recompute_term_s + self.replication_term_s + self.queue_term_s


@dataclass
class DecisionRecord:
    """One decision. A request with a TTFT deadline that no routable backend can meet is not
    placed (`placed` False): `backend_id` is then the backend with the best projection, and
    `retry_after_s` the seconds until its work ahead drains enough (None when even an idle
    backend would miss the deadline: its own prefill is too long)."""

    req_id: str
    policy: str
    backend_id: str
    per_backend: dict[str, BackendScore] = field(default_factory=dict)
    priority: int = 0
    ttft_deadline_s: float | None = None
    placed: bool = True
    retry_after_s: float | None = None

    @property
    def chosen(self) -> BackendScore:
        return self.per_backend[self.backend_id]

    def to_dict(self, ndigits: int = 6) -> dict[str, Any]:
        """JSON-able form; floats rounded to `ndigits` so a log line stays readable."""
        return {
            "req_id": self.req_id,
            "policy": self.policy,
            "backend_id": self.backend_id,
            "priority": self.priority,
            "ttft_deadline_s": self.ttft_deadline_s,
            "placed": self.placed,
            "retry_after_s": None if self.retry_after_s is None else round(self.retry_after_s, ndigits),
            "per_backend": {
                backend_id: _rounded(vars(score), ndigits)  # a score's fields are flat: no asdict's deep copy
                for backend_id, score in self.per_backend.items()
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _rounded(values: dict[str, Any], ndigits: int) -> dict[str, Any]:
    return {k: round(v, ndigits) if isinstance(v, float) else v for k, v in values.items()}
