"""Scenario files for the what-if simulator (`tandem route-sim SCENARIO`), JSON or YAML.

A scenario names the backends (rates the router uses, optional `actual_rates` the simulated
backend really runs at, `max_active`, and an optional `device`: backends that name the same
device share its time, routing/sim_device.py), the requests, the default policy and router options.
Requests are listed explicitly under `requests:` and/or generated under `generate:` (n
identical requests at a fixed interval, the design's setting in six lines), each with the
prefix each backend has cached for it fixed up front. Or they come from `tenants:`: several
tenants, each with a shared prefix, picked with Zipf popularity, arriving as a Poisson
process; then every backend simulates a prefix cache of `num_kv_blocks` blocks with LRU
eviction (routing/sim_prefix_cache.py), and what hits is decided by where requests went. A
backend's `num_host_kv_blocks` adds a host-memory KV tier below that cache, which only the engine
model (`tandem route-sim`'s default for such scenarios) simulates; its `max_num_batched_tokens`
sets that model's step budget (default: the engine's for the device kind). The format is
documented in docs/routing.md with examples in docs/route-sim-examples/.

The file is validated with pydantic at this edge, and every error names its field
(`backends.0.rates.prefill_tok_s: Input should be greater than 0 (got -1.0)`); the result
is plain dataclasses (`Scenario`, `SimRequest`, `SimBackendSpec`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.errors import ConfigError, format_validation_errors
from tandem.routing.new_token_ratio import NewTokenRatioConfig
from tandem.routing.policies import POLICIES, PrefixAffinityConfig, SpillGuard
from tandem.routing.rates import CalibrationConfig, RateProfile, RateProfileModel, validate_rate_profile
from tandem.routing.replication import ReplicationConfig
from tandem.routing.step_time import StepTimeFields, StepTimeModel


@dataclass
class SimRequest:
    req_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int  # what the request really generates (<= max_tokens)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # fixed hits (no cache model)
    # fixed host-tier runs after those hits, as a live router saw them (replayed logs); the
    # simulated backends compute these tokens, as they model no host tier
    num_host_cached_tokens: dict[str, int] = field(default_factory=dict)
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks (tenants)
    tenant: int | None = None
    # When the client sent it, where a scenario's `serving:` latency puts `arrival_s` (the router
    # seeing it) later; None: at `arrival_s`. TTFT and E2E count from here.
    sent_s: float | None = None


@dataclass(frozen=True)
class ServingLatency:
    """The serving path's own time from a client's send to the router seeing the request
    (HTTP, tokenizing, hashing, the hops), which no backend model holds: `fixed_s` plus
    `per_prompt_token_s` a prompt token. `tandem bench tenants` measures it on the live server
    with lone requests before its cells."""

    fixed_s: float = 0.0
    per_prompt_token_s: float = 0.0

    def seconds(self, num_prompt_tokens: int) -> float:
        return self.fixed_s + self.per_prompt_token_s * num_prompt_tokens


@dataclass
class SimBackendSpec:
    spec: BackendSpec  # what the router believes (spec.rates)
    actual_rates: RateProfile  # what the simulated backend runs at
    num_kv_blocks: int | None = None  # prefix-cache room (tenants scenarios); None: unlimited
    device: str | None = None  # backends naming the same device share it; None: a device of its own
    # Blocks of a host-memory KV tier below the prefix cache (tenants scenarios); 0: none. Only
    # the engine model (cluster/engine_sim_backend.py) simulates it; its reloads run at
    # `actual_rates.reload_tok_s`.
    num_host_kv_blocks: int = 0
    # The tier keeps only evicted blocks hit at least this many times; None: the engine's default.
    kv_host_offload_min_hits: int | None = None
    # Tokens per step on the engine model; None: the engine's default for the device kind.
    max_num_batched_tokens: int | None = None
    # What times a step beyond `actual_rates` (routing/step_time.py): the context cost, by batch
    # where measured so, and the prefill rate by step size; empty: the rates alone.
    step_time_fields: dict[str, Any] = field(default_factory=dict)

    def step_time(self, with_host_tier: bool = False) -> StepTimeModel:
        """The simulated backend's step-time model; `with_host_tier` times reloads too."""
        rates = self.actual_rates
        return StepTimeModel(rates, host_reload_tok_s=rates.reload_tok_s if with_host_tier else None,
                             **self.step_time_fields)


@dataclass
class Scenario:
    name: str
    policy: str
    backends: list[SimBackendSpec]
    requests: list[SimRequest]  # sorted by arrival_s (stable)
    new_token_ratio: NewTokenRatioConfig | None = None
    calibration: CalibrationConfig | None = None
    spill_guard: SpillGuard | None = None
    prefix_affinity: PrefixAffinityConfig | None = None
    recompute_weight: float = 2.0
    inflight_prefixes: bool = True
    replication: ReplicationConfig | None = field(default_factory=ReplicationConfig)
    queue_weight: float = 1.0
    device_shares: bool = False  # the router knows which backends share a device
    block_size: int | None = None  # set when backends simulate prefix caches (tenants scenarios)

    @property
    def backend_specs(self) -> list[BackendSpec]:
        return [b.spec for b in self.backends]

    @property
    def has_prefix_caches(self) -> bool:
        return self.block_size is not None

    @property
    def shared_devices(self) -> dict[str, list[str]]:
        """Device name -> the backend ids on it, for devices that two or more backends name."""
        by_device: dict[str, list[str]] = {}
        for b in self.backends:
            if b.device is not None:
                by_device.setdefault(b.device, []).append(b.spec.backend_id)
        return {device: ids for device, ids in by_device.items() if len(ids) > 1}


# --- file-edge schema ---------------------------------------------------------------------

_STRICT = ConfigDict(extra="forbid")


class _BackendModel(BaseModel):
    model_config = _STRICT
    backend_id: str = Field(min_length=1)
    device_kind: str = Field(min_length=1)
    max_active: int = Field(4, ge=1)
    rates: RateProfileModel
    actual_rates: RateProfileModel | None = None
    num_kv_blocks: int | None = Field(None, ge=1)  # tenants scenarios: prefix-cache room in blocks
    device: str | None = Field(None, min_length=1)  # e.g. "cuda:0"; backends naming one device share it
    num_host_kv_blocks: int = Field(0, ge=0)  # tenants scenarios: the host KV tier's room in blocks; 0: none
    kv_host_offload_min_hits: int | None = Field(None, ge=0)  # the tier's gate; None: the engine's default
    max_num_batched_tokens: int | None = Field(None, ge=1)  # the engine model's step budget
    step_time: StepTimeFields | None = None  # a step's timing beyond the actual rates


class _RequestFields(BaseModel):
    """Fields shared by explicit requests and the generator."""

    model_config = _STRICT
    num_prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    num_output_tokens: int | None = Field(None, ge=1)  # default: max_tokens (EOS ignored)
    num_cached_tokens: int | dict[str, int] = 0  # one int = the same prefix on every backend

    @field_validator("num_cached_tokens")
    @classmethod
    def _non_negative(cls, value: int | dict[str, int]) -> int | dict[str, int]:
        values = value.values() if isinstance(value, dict) else [value]
        if any(v < 0 for v in values):
            raise ValueError(f"must be >= 0 (got {value!r})")
        return value

    @model_validator(mode="after")
    def _output_within_budget(self) -> "_RequestFields":
        if self.num_output_tokens is not None and self.num_output_tokens > self.max_tokens:
            raise ValueError(
                f"num_output_tokens ({self.num_output_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        return self


class _RequestModel(_RequestFields):
    req_id: str | None = None  # default: "r<position>", 1-based
    arrival_s: float = Field(ge=0)


class _GenerateModel(_RequestFields):
    num_requests: int = Field(ge=1)
    interval_s: float = Field(ge=0)
    start_s: float = Field(0.0, ge=0)
    req_id_prefix: str = "r"


class _TenantsModel(BaseModel):
    """Multi-tenant traffic: each request is one tenant's shared prefix plus a unique suffix."""

    model_config = _STRICT
    num_requests: int = Field(ge=1)
    rate_per_s: float = Field(gt=0)  # Poisson arrivals
    num_tenants: int = Field(ge=1)
    zipf_s: float = Field(1.0, ge=0)  # tenant k (1-based) is picked with weight 1 / k**zipf_s
    prefix_tokens: int = Field(ge=1)  # shared by all of a tenant's requests
    suffix_tokens: int = Field(1, ge=1)  # unique to each request
    max_tokens: int = Field(ge=1)
    num_output_tokens: int | None = Field(None, ge=1)  # default: max_tokens
    seed: int = 0
    start_s: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _output_within_budget(self) -> "_TenantsModel":
        if self.num_output_tokens is not None and self.num_output_tokens > self.max_tokens:
            raise ValueError(
                f"num_output_tokens ({self.num_output_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        return self


class _PrefixAffinityModel(BaseModel):
    model_config = _STRICT
    num_prefix_blocks: int = Field(8, ge=1)
    load_factor: float = Field(1.25, ge=1)


class _ReplicationModel(BaseModel):
    model_config = _STRICT
    future_factor: float = Field(2.0, gt=0)
    pressure_window: int = Field(256, ge=0)
    copy_interval: int = Field(200, ge=0)
    num_prefix_blocks: int = Field(8, ge=1)
    max_prefixes: int = Field(4096, ge=1)


class _NewTokenRatioModel(BaseModel):
    model_config = _STRICT
    init_ratio: float = Field(0.7, gt=0, le=1)
    min_ratio: float = Field(0.098, gt=0, le=1)
    decay_steps: int = Field(600, ge=1)


class _CalibrationModel(BaseModel):
    model_config = _STRICT
    alpha: float = Field(0.1, gt=0, le=1)


class _SpillGuardModel(BaseModel):
    model_config = _STRICT
    margin: float = Field(0.0, ge=0, lt=1)
    allow_queue: bool = True


class _RouterModel(BaseModel):
    model_config = _STRICT
    new_token_ratio: _NewTokenRatioModel | None = None
    calibration: _CalibrationModel | None = None
    spill_guard: _SpillGuardModel | None = None
    prefix_affinity: _PrefixAffinityModel | None = None
    recompute_weight: float = Field(2.0, ge=0)  # 0: the design's plain score
    inflight_prefixes: bool = True  # count prefixes routed but not yet reported as cached
    replication: _ReplicationModel | None = Field(default_factory=_ReplicationModel)  # null: off
    queue_weight: float = Field(1.0, ge=0)  # 0: rank without the queue term
    device_shares: bool = False  # true: the cost model divides rates among busy engines of a device


class _ServingModel(BaseModel):
    model_config = _STRICT
    fixed_s: float = Field(0.0, ge=0)
    per_prompt_token_s: float = Field(0.0, ge=0)


class _ScenarioModel(BaseModel):
    model_config = _STRICT
    name: str = "scenario"
    policy: str = "cost"
    backends: list[_BackendModel] = Field(min_length=1)
    requests: list[_RequestModel] = Field(default_factory=list)
    generate: _GenerateModel | None = None
    tenants: _TenantsModel | None = None
    block_size: int = Field(16, ge=1)  # tenants scenarios: tokens per KV block
    router: _RouterModel = Field(default_factory=_RouterModel)
    serving: _ServingModel | None = None  # the serving path's latency before the router (ServingLatency)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; choose one of {sorted(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "_ScenarioModel":
        ids = [b.backend_id for b in self.backends]
        if len(set(ids)) != len(ids):
            raise ValueError(f"backends: backend_id values must be unique (got {ids})")
        if self.tenants is not None and (self.requests or self.generate is not None):
            raise ValueError("tenants: cannot be combined with requests: or generate: (their hits are "
                             "fixed up front; tenants' hits come from the simulated caches)")
        if not self.requests and self.generate is None and self.tenants is None:
            raise ValueError("requests: give at least one request, or a generate: or tenants: section")
        _check_devices(self.backends)
        if self.tenants is None and any(b.num_kv_blocks is not None for b in self.backends):
            raise ValueError("backends: num_kv_blocks needs a tenants: section (only tenants' prefixes are cached)")
        if self.tenants is None and any(b.num_host_kv_blocks for b in self.backends):
            raise ValueError("backends: num_host_kv_blocks needs a tenants: section (only tenants' prefixes are "
                             "cached)")
        return self


def _check_devices(backends: list[_BackendModel]) -> None:
    kinds: dict[str, set[str]] = {}
    for b in backends:
        if b.device is not None:
            kinds.setdefault(b.device, set()).add(b.device_kind)
    for device, device_kinds in kinds.items():
        if len(device_kinds) > 1:
            raise ValueError(f"backends: the backends on device {device!r} have different device_kind values "
                             f"({sorted(device_kinds)}); give each device one kind")


# --- loading --------------------------------------------------------------------------------


def load_scenario(path: str | Path, num_requests: int | None = None,
                  overrides: list[str] = ()) -> Scenario:
    """Read a JSON or YAML scenario. `num_requests` overrides `generate.num_requests` (or
    `tenants.num_requests`); each override `a.b.0.c=VALUE` sets one field (VALUE is YAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"scenario {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None
    for override in overrides:
        apply_override(data, override)
    return parse_scenario(data, source=f"scenario {path}", num_requests=num_requests)


def apply_override(data: Any, override: str) -> None:
    """Set `a.b.0.c` to VALUE (parsed as YAML) in a loaded scenario document, in place."""
    path, sep, value = override.partition("=")
    keys = path.split(".")
    if not sep or not all(keys):
        raise ConfigError(f"--set {override!r}: expected FIELD.PATH=VALUE, e.g. tenants.rate_per_s=100")
    node = data
    try:
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = yaml.safe_load(value)
        else:
            node[last] = yaml.safe_load(value)
    except (ValueError, IndexError, TypeError, AttributeError, yaml.YAMLError) as exc:
        raise ConfigError(f"--set {override!r}: cannot set {path}: {exc}") from None


def with_serving_latency(requests: list[SimRequest], latency: ServingLatency) -> list[SimRequest]:
    """The requests as the router sees them: each arriving its serving latency after it was sent
    (`sent_s`), in the order they reach the router (stable)."""
    shifted = [dataclasses.replace(r, sent_s=r.arrival_s, arrival_s=r.arrival_s + latency.seconds(r.num_prompt_tokens))
               for r in requests]
    return sorted(shifted, key=lambda r: r.arrival_s)


def parse_scenario(data: Any, source: str = "scenario", num_requests: int | None = None) -> Scenario:
    """Validate an already-parsed scenario document and build the dataclasses."""
    if num_requests is not None and isinstance(data, dict):
        for section in ("generate", "tenants"):
            if isinstance(data.get(section), dict):
                data = {**data, section: {**data[section], "num_requests": num_requests}}
    try:
        model = _ScenarioModel.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_errors(source, exc.errors())) from None
    if num_requests is not None and model.generate is None and model.tenants is None:
        raise ConfigError(f"{source}: --num-requests needs a generate: or tenants: section to override")
    backends = [_backend(b, f"backends.{i}") for i, b in enumerate(model.backends)]
    backend_ids = [b.spec.backend_id for b in backends]
    if model.tenants is not None:
        requests = tenant_requests(model.tenants, model.block_size)
    else:
        requests = _requests(model, backend_ids)
    if model.serving is not None:
        requests = with_serving_latency(requests, ServingLatency(**model.serving.model_dump()))
    affinity = model.router.prefix_affinity
    return Scenario(
        name=model.name,
        policy=model.policy,
        backends=backends,
        requests=requests,
        new_token_ratio=_new_token_ratio(model.router.new_token_ratio),
        calibration=CalibrationConfig(model.router.calibration.alpha) if model.router.calibration else None,
        spill_guard=SpillGuard(**model.router.spill_guard.model_dump()) if model.router.spill_guard else None,
        prefix_affinity=PrefixAffinityConfig(**affinity.model_dump()) if affinity else None,
        recompute_weight=model.router.recompute_weight,
        inflight_prefixes=model.router.inflight_prefixes,
        replication=ReplicationConfig(**model.router.replication.model_dump()) if model.router.replication else None,
        queue_weight=model.router.queue_weight,
        device_shares=model.router.device_shares,
        block_size=model.block_size if model.tenants is not None else None,
    )


def _backend(model: _BackendModel, path: str) -> SimBackendSpec:
    rates = validate_rate_profile(model.rates, f"{path}.rates")
    actual = rates if model.actual_rates is None else validate_rate_profile(model.actual_rates, f"{path}.actual_rates")
    if model.num_host_kv_blocks and actual.reload_tok_s is None:
        where = "actual_rates" if model.actual_rates is not None else "rates"
        raise ConfigError(f"{path}.num_host_kv_blocks: a host KV tier ({model.num_host_kv_blocks} blocks) needs the "
                          f"rate its blocks are reloaded at: give {path}.{where}.reload_tok_s")
    spec = BackendSpec(model.backend_id, model.device_kind, rates, model.max_active, model.device)
    step_time = {} if model.step_time is None else model.step_time.model_dump(exclude_none=True)
    return SimBackendSpec(spec, actual, model.num_kv_blocks, model.device, model.num_host_kv_blocks,
                          model.kv_host_offload_min_hits, model.max_num_batched_tokens, step_time)


def _requests(model: _ScenarioModel, backend_ids: list[str]) -> list[SimRequest]:
    requests = [
        _request(r, r.req_id or f"r{i + 1}", r.arrival_s, f"requests.{i}", backend_ids)
        for i, r in enumerate(model.requests)
    ]
    gen = model.generate
    if gen is not None:
        requests += [
            _request(gen, f"{gen.req_id_prefix}{i + 1}", gen.start_s + i * gen.interval_s, "generate", backend_ids)
            for i in range(gen.num_requests)
        ]
    seen: set[str] = set()
    for r in requests:
        if r.req_id in seen:
            raise ConfigError(f"requests: duplicate req_id {r.req_id!r}")
        seen.add(r.req_id)
    return sorted(requests, key=lambda r: r.arrival_s)


def _request(fields: _RequestFields, req_id: str, arrival_s: float, path: str, backend_ids: list[str]) -> SimRequest:
    cached = fields.num_cached_tokens
    if isinstance(cached, int):
        cached = {backend_id: cached for backend_id in backend_ids}
    for backend_id, num_cached in cached.items():
        if backend_id not in backend_ids:
            raise ConfigError(f"{path}.num_cached_tokens: unknown backend {backend_id!r}; backends are {backend_ids}")
        if num_cached > fields.num_prompt_tokens:
            raise ConfigError(
                f"{path}.num_cached_tokens.{backend_id}: {num_cached} exceeds num_prompt_tokens ({fields.num_prompt_tokens})"
            )
    return SimRequest(
        req_id=req_id,
        arrival_s=arrival_s,
        num_prompt_tokens=fields.num_prompt_tokens,
        max_tokens=fields.max_tokens,
        num_output_tokens=fields.num_output_tokens or fields.max_tokens,
        num_cached_tokens=dict(cached),
    )


def tenant_requests(tenants: _TenantsModel, block_size: int) -> list[SimRequest]:
    """Poisson arrivals, Zipf-popular tenants; deterministic for a seed."""
    rng = random.Random(tenants.seed)
    cum_weights = list(itertools.accumulate(1 / (k + 1) ** tenants.zipf_s for k in range(tenants.num_tenants)))
    num_prompt_tokens = tenants.prefix_tokens + tenants.suffix_tokens
    requests, arrival_s = [], tenants.start_s
    for n in range(tenants.num_requests):
        if n:
            arrival_s += rng.expovariate(tenants.rate_per_s)
        tenant = rng.choices(range(tenants.num_tenants), cum_weights=cum_weights)[0]
        requests.append(SimRequest(
            req_id=f"r{n + 1}",
            arrival_s=arrival_s,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=tenants.max_tokens,
            num_output_tokens=tenants.num_output_tokens or tenants.max_tokens,
            block_hashes=tenant_block_hashes(tenant, n, tenants.prefix_tokens, num_prompt_tokens, block_size),
            tenant=tenant,
        ))
    return requests


def tenant_block_hashes(tenant: int, index: int, num_prefix_tokens: int, num_prompt_tokens: int,
                        block_size: int) -> tuple[int, ...]:
    """Stand-ins for chained block hashes: equal for a tenant's full prefix blocks, unique after
    (a block that straddles the end of the prefix is unique too). Tuples of ints hash the same in
    every process."""
    num_prefix_blocks = num_prefix_tokens // block_size
    num_blocks = num_prompt_tokens // block_size
    return tuple(hash((1, tenant, i)) if i < num_prefix_blocks else hash((2, index, i))
                 for i in range(num_blocks))


def _new_token_ratio(model: _NewTokenRatioModel | None) -> NewTokenRatioConfig | None:
    if model is None:
        return None
    try:
        return NewTokenRatioConfig(model.init_ratio, model.min_ratio, model.decay_steps)
    except ValueError as exc:
        raise ConfigError(f"router.new_token_ratio: {exc}") from None
