"""Per-backend throughput profiles, their JSON file, and optional online calibration.

A `RateProfile` is what the cost model divides by. Rates are *aggregate* throughputs of the
whole backend: `decode_tok_s` is output tokens per second summed over everything it decodes,
so "pending decode tokens / decode_tok_s" is the time to drain the backend. The design's
numbers come from an isolated profile (one request at a time), which is why it ranks work
rather than predicting batched completion times.

`decode_tok_s_by_batch`, when given, maps batch size -> aggregate decode tok/s at that batch
size (a batch-aware model: a GPU that decodes 4 sequences barely slower than 1 has a much
higher aggregate rate at 4). Between listed sizes the rate is interpolated linearly; outside
them it is clamped to the nearest listed size.

Calibration blends observed step throughput into the profile with an EWMA
(`new = (1 - alpha) * old + alpha * observed`); a decode step rescales the whole batch table by
the factor it implies for its own batch size. A step that did both prefill and decode is
skipped: one elapsed time cannot be split between two unknown rates.

The file format is a JSON object mapping a name (backend id or device kind) to a profile:
``{"cuda0": {"prefill_tok_s": 2551, "decode_tok_s": 293}, "cpu0": {...}}``. It is validated
with pydantic at this edge; everything inside the router is a plain dataclass.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tandem.routing.errors import ConfigError, format_validation_errors


@dataclass(frozen=True)
class RateProfile:
    prefill_tok_s: float
    decode_tok_s: float
    decode_tok_s_by_batch: dict[int, float] | None = None
    # Prompt tokens per second a host-memory KV tier copies back to the device (its bandwidth over
    # the KV bytes of one token). None: no host tier, so a host-tier hit is priced as a miss.
    reload_tok_s: float | None = None

    def __post_init__(self) -> None:
        _require_positive("prefill_tok_s", self.prefill_tok_s)
        _require_positive("decode_tok_s", self.decode_tok_s)
        if self.reload_tok_s is not None:
            _require_positive("reload_tok_s", self.reload_tok_s)
        if self.decode_tok_s_by_batch is not None:
            if not self.decode_tok_s_by_batch:
                raise ValueError("decode_tok_s_by_batch must be None or non-empty")
            for batch_size, rate in self.decode_tok_s_by_batch.items():
                if int(batch_size) < 1:
                    raise ValueError(f"decode_tok_s_by_batch: batch size must be >= 1 (got {batch_size})")
                _require_positive(f"decode_tok_s_by_batch[{batch_size}]", rate)
            # Sorted, int-keyed copy so lookups can bisect and callers' dicts stay theirs.
            items = sorted(self.decode_tok_s_by_batch.items(), key=lambda item: int(item[0]))
            table = {int(b): float(r) for b, r in items}
            object.__setattr__(self, "decode_tok_s_by_batch", table)

    @property
    def is_batch_aware(self) -> bool:
        return self.decode_tok_s_by_batch is not None

    def decode_rate(self, batch_size: int) -> float:
        """Aggregate decode tok/s when `batch_size` sequences decode together."""
        table = self.decode_tok_s_by_batch
        if table is None:
            return self.decode_tok_s
        sizes = list(table)
        if batch_size <= sizes[0]:
            return table[sizes[0]]
        if batch_size >= sizes[-1]:
            return table[sizes[-1]]
        hi = bisect.bisect_left(sizes, batch_size)
        lo_size, hi_size = sizes[hi - 1], sizes[hi]
        if hi_size == batch_size:
            return table[hi_size]
        frac = (batch_size - lo_size) / (hi_size - lo_size)
        return table[lo_size] + frac * (table[hi_size] - table[lo_size])

    def decode_step_s(self, batch_size: int) -> float:
        """Seconds for one decode step that gives each of `batch_size` sequences one token."""
        return batch_size / self.decode_rate(batch_size)


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (got {value!r})")


@dataclass(frozen=True)
class CalibrationConfig:
    """Online calibration: EWMA weight of each observed step (0 < alpha <= 1)."""

    alpha: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"calibration alpha must be in (0, 1] (got {self.alpha!r})")


def calibrate(
    profile: RateProfile,
    config: CalibrationConfig,
    num_prefill_tokens: int,
    num_decode_tokens: int,
    batch_size: int,
    elapsed_s: float,
) -> RateProfile:
    """Return `profile` with one observed step blended in (unchanged for empty steps and for
    mixed steps where decode tokens are as many as the prefill tokens or more).

    A decode step observed at one batch size rescales the whole batch table by the same
    factor: what slows a backend down (a busy neighbour on the same cores, the serving path
    around the engine) slows every batch size, and the next decision is often made at a batch
    size that has not run lately (an idle backend is scored at batch 1).

    A mixed step whose prefill tokens outnumber its decode tokens counts as prefill of all its
    tokens: the engine runs it as one forward pass over every scheduled token, the decode ones
    being a few more rows. Under load a backend prefills almost only in such steps (a new
    request joins requests that are decoding), so without them the prefill rate would keep the
    idle backend's speed and every projection would be early by the contention it leaves out."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed_s must be > 0 (got {elapsed_s!r})")
    alpha = config.alpha
    if num_prefill_tokens > num_decode_tokens:
        observed = (num_prefill_tokens + num_decode_tokens) / elapsed_s
        return replace(profile, prefill_tok_s=(1 - alpha) * profile.prefill_tok_s + alpha * observed)
    if num_decode_tokens > 0 and num_prefill_tokens == 0:
        expected = profile.decode_rate(max(1, batch_size))
        factor = (1 - alpha) + alpha * (num_decode_tokens / elapsed_s) / expected
        return scale_decode(profile, factor)
    return profile


def scale_decode(profile: RateProfile, factor: float) -> RateProfile:
    """`profile` with every decode rate (the batch table's too) multiplied by `factor`."""
    table = profile.decode_tok_s_by_batch
    return replace(profile, decode_tok_s=profile.decode_tok_s * factor,
                   decode_tok_s_by_batch=None if table is None else {b: r * factor for b, r in table.items()})


class RateProfileModel(BaseModel):
    """File-edge schema of one profile (also used inside scenario files)."""

    model_config = ConfigDict(extra="forbid")

    prefill_tok_s: float = Field(gt=0)
    decode_tok_s: float = Field(gt=0)
    decode_tok_s_by_batch: dict[int, float] | None = None
    reload_tok_s: float | None = Field(default=None, gt=0)

    def to_profile(self) -> RateProfile:
        return RateProfile(self.prefill_tok_s, self.decode_tok_s, self.decode_tok_s_by_batch, self.reload_tok_s)


def validate_rate_profile(model: RateProfileModel, field_path: str) -> RateProfile:
    """Build the dataclass, turning its ValueError into a ConfigError naming `field_path`."""
    try:
        return model.to_profile()
    except ValueError as exc:
        raise ConfigError(f"{field_path}: {exc}") from None


def load_rate_profiles(path: str | Path) -> dict[str, RateProfile]:
    """Load a JSON file mapping name -> profile. Raises ConfigError naming any bad field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read rate profile file {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"rate profile file {path} is not valid JSON: {exc}") from None
    try:
        models = TypeAdapter(dict[str, RateProfileModel]).validate_python(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_errors(f"rate profile file {path}", exc.errors())) from None
    return {name: validate_rate_profile(model, name) for name, model in models.items()}
