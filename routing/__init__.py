"""Tandem's router, as a pure Python package (no ray, no torch).

It decides which backend (CPU engine, accelerator engine, ...) gets each request, from
per-backend ledgers of pending work and the design's cost model, and it includes a what-if
simulator and an oracle split so a policy's gain can be set against the attainable gain.
The Ray actor that hosts the `Router` lives in `actors/`; see docs/routing.md.
"""

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.decision import BackendScore, DecisionRecord
from tandem.routing.errors import ConfigError, DeadlineRefusedError, NoBackendError
from tandem.routing.ledger import Ledger, LedgerEntry
from tandem.routing.messages import EVENT_KINDS, ProgressEvent, RouteRequest, RunningProgress
from tandem.routing.new_token_ratio import NewTokenRatio, NewTokenRatioConfig
from tandem.routing.policies import POLICIES, PrefixAffinityConfig, SpillGuard, make_policy
from tandem.routing.rates import CalibrationConfig, RateProfile, calibrate, load_rate_profiles
from tandem.routing.replication import ReplicationConfig
from tandem.routing.router import PendingSummary, RemovedRequests, Router

__all__ = [
    "BackendScore",
    "BackendSpec",
    "CalibrationConfig",
    "ConfigError",
    "DeadlineRefusedError",
    "DecisionRecord",
    "EVENT_KINDS",
    "Ledger",
    "LedgerEntry",
    "NewTokenRatio",
    "NewTokenRatioConfig",
    "NoBackendError",
    "POLICIES",
    "PendingSummary",
    "PrefixAffinityConfig",
    "ProgressEvent",
    "RateProfile",
    "RemovedRequests",
    "ReplicationConfig",
    "RouteRequest",
    "RunningProgress",
    "Router",
    "SpillGuard",
    "calibrate",
    "load_rate_profiles",
    "make_policy",
]
