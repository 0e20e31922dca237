"""Scenario files for the what-if simulator (`tandem route-sim SCENARIO`), JSON or YAML.

A scenario names the backends (rates the router uses, optional `actual_rates` the simulated
backend really runs at, `max_active`), the requests, the default policy and router options.
Requests are listed explicitly under `requests:` and/or generated under `generate:` (n
identical requests at a fixed interval, the spec's setting in six lines). The format is
documented in docs/routing.md with an example in docs/route-sim-examples/.

The file is validated with pydantic at this edge, and every error names its field
(`backends.0.rates.prefill_tok_s: Input should be greater than 0 (got -1.0)`); the result
is plain dataclasses (`Scenario`, `SimRequest`, `SimBackendSpec`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.routing.backend_spec import BackendSpec
from tandem.routing.errors import ConfigError, format_validation_errors
from tandem.routing.new_token_ratio import NewTokenRatioConfig
from tandem.routing.policies import POLICIES, SpillGuard
from tandem.routing.rates import CalibrationConfig, RateProfile, RateProfileModel, validate_rate_profile


@dataclass
class SimRequest:
    req_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int  # what the request really generates (<= max_tokens)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class SimBackendSpec:
    spec: BackendSpec  # what the router believes (spec.rates)
    actual_rates: RateProfile  # what the simulated backend runs at


@dataclass
class Scenario:
    name: str
    policy: str
    backends: list[SimBackendSpec]
    requests: list[SimRequest]  # sorted by arrival_s (stable)
    new_token_ratio: NewTokenRatioConfig | None = None
    calibration: CalibrationConfig | None = None
    spill_guard: SpillGuard | None = None

    @property
    def backend_specs(self) -> list[BackendSpec]:
        return [b.spec for b in self.backends]


# --- file-edge schema ---------------------------------------------------------------------

_STRICT = ConfigDict(extra="forbid")


class _BackendModel(BaseModel):
    model_config = _STRICT
    backend_id: str = Field(min_length=1)
    device_kind: str = Field(min_length=1)
    max_active: int = Field(4, ge=1)
    rates: RateProfileModel
    actual_rates: RateProfileModel | None = None


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


class _ScenarioModel(BaseModel):
    model_config = _STRICT
    name: str = "scenario"
    policy: str = "cost"
    backends: list[_BackendModel] = Field(min_length=1)
    requests: list[_RequestModel] = Field(default_factory=list)
    generate: _GenerateModel | None = None
    router: _RouterModel = Field(default_factory=_RouterModel)

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
        if not self.requests and self.generate is None:
            raise ValueError("requests: give at least one request, or a generate: section")
        return self


# --- loading --------------------------------------------------------------------------------


def load_scenario(path: str | Path, num_requests: int | None = None) -> Scenario:
    """Read a JSON or YAML scenario. `num_requests` overrides `generate.num_requests`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"scenario {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None
    return parse_scenario(data, source=f"scenario {path}", num_requests=num_requests)


def parse_scenario(data: Any, source: str = "scenario", num_requests: int | None = None) -> Scenario:
    """Validate an already-parsed scenario document and build the dataclasses."""
    if num_requests is not None and isinstance(data, dict) and isinstance(data.get("generate"), dict):
        data = {**data, "generate": {**data["generate"], "num_requests": num_requests}}
    try:
        model = _ScenarioModel.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_errors(source, exc.errors())) from None
    if num_requests is not None and model.generate is None:
        raise ConfigError(f"{source}: --num-requests needs a generate: section to override")
    backends = [_backend(b, f"backends.{i}") for i, b in enumerate(model.backends)]
    backend_ids = [b.spec.backend_id for b in backends]
    requests = _requests(model, backend_ids)
    return Scenario(
        name=model.name,
        policy=model.policy,
        backends=backends,
        requests=requests,
        new_token_ratio=_new_token_ratio(model.router.new_token_ratio),
        calibration=CalibrationConfig(model.router.calibration.alpha) if model.router.calibration else None,
        spill_guard=SpillGuard(**model.router.spill_guard.model_dump()) if model.router.spill_guard else None,
    )


def _backend(model: _BackendModel, path: str) -> SimBackendSpec:
    rates = validate_rate_profile(model.rates, f"{path}.rates")
    actual = rates if model.actual_rates is None else validate_rate_profile(model.actual_rates, f"{path}.actual_rates")
    spec = BackendSpec(model.backend_id, model.device_kind, rates, model.max_active)
    return SimBackendSpec(spec, actual)


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


def _new_token_ratio(model: _NewTokenRatioModel | None) -> NewTokenRatioConfig | None:
    if model is None:
        return None
    try:
        return NewTokenRatioConfig(model.init_ratio, model.min_ratio, model.decay_steps)
    except ValueError as exc:
        raise ConfigError(f"router.new_token_ratio: {exc}") from None
