"""How long one engine step takes on a profiled device: the timing model of every emulated engine.

Two things emulate a device from its profile, and both time a step with `StepTimeModel`:
- the `sim` device (engine/sim_runner.py behind the real scheduler and KV cache, in a real
  server), which sleeps each step's duration, and
- route-sim's simulated backend (routing/sim_backend.py), which advances a virtual clock by it.

A step that prefills `num_prefill_tokens` and decodes one token for each of `num_decode_seqs`
sequences whose KV spans `num_context_tokens` lasts

    num_prefill_tokens / prefill_rate(num_prefill_tokens) + num_decode_seqs / decode_rate(num_decode_seqs)
        + num_context_tokens * context_cost(num_decode_seqs)

The terms are the cost model's own reading of a profile (routing/rates.py: aggregate prefill
and batch-aware decode rates), so the router ranks work with the same numbers the emulator
spends, and two things a profile of short prompts leaves out, where the profile has them: the
prefill rate by the step's size (a GPU prefills a step of 8k tokens at several times the rate of
one 512-token prompt) and the context cost (attention reads every cached token of every
decoding sequence each step). Without them, every prefill runs at the rates' one prefill rate and
every decode as if its context were short.

With the prefill table, a mixed step (a prompt's tokens beside running decodes) is one forward
over all its tokens: `(prefill tokens + decodes) / prefill rate(that many)` plus the decodes'
context cost. The table's time for a small step is mostly the step's own cost (launching a
forward of every layer), which a mixed step pays once; adding a decode step's time to a
prefill's would pay it twice (docs/benchmarks/host-tier-h100.md compares both with a GPU's mixed
steps). Without the table the terms add, as the rates' one prefill rate has no per-step cost in
it.

The context cost is seconds per context token of a decode step, by the step's batch where the
profile measured it so (`decode_s_per_context_token_by_batch`, interpolated like the decode
rates), else one figure for every batch. It depends on the batch: a decode step's attention
kernel spreads its work over the sequences (and heads) of the batch, so a batch of 16 long
sequences keeps few of a GPU's multiprocessors busy and pays several times more per context
token than a batch of 256 does.

The host's floor. Behind a server, the engine's step loop does more host work per step than in
the process a profile measures it in (each step's outputs go to their callers' channels, arrivals
are admitted, the prefix cache's bookkeeping runs). With asynchronous scheduling that work
overlaps the device's previous step, so a step lasts the longer of the two, and where the host's
part is the longer (a GPU decoding a small batch behind HTTP), the device's profile alone
predicts steps too short. `host_s_per_step_by_batch` (seconds of host work per step by the
step's sequences, measured behind the server: bench/tenants.py) is that floor for route-sim's
engine model (`floor_s`). The `sim` device leaves it out: its host work is real.

A *sim profile* is one device's measurement, written by `tandem profile` from a real device: the
rates plus the engine shape the device was run with (max_active, KV tokens, batched-token
budget), which the emulated engine takes as its defaults. Named profiles ship in
routing/sim_profiles/; `load_sim_profile` takes such a name or a JSON file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.routing.errors import ConfigError, format_validation_errors
from tandem.routing.rates import RateProfile

PROFILES_DIR = Path(__file__).resolve().parent / "sim_profiles"


@dataclass(frozen=True)
class StepTimeModel:
    rates: RateProfile
    decode_s_per_context_token: float = 0.0  # at every batch, where the table below is None
    # Aggregate prefill tok/s by the step's prefill tokens (interpolated, clamped to the ends);
    # None: `rates.prefill_tok_s` at every size. A GPU prefills a step of thousands of tokens
    # at several times the rate of one 512-token prompt, which is what the rates measure.
    prefill_tok_s_by_tokens: dict[int, float] | None = None
    # Tokens a second the device reloads from a host KV tier (host-to-device copies); None:
    # the device is not modelled with a host tier.
    host_reload_tok_s: float | None = None
    # Seconds per context token of a decode step by its batch (interpolated, clamped to the
    # ends); None: `decode_s_per_context_token` at every batch (module doc).
    decode_s_per_context_token_by_batch: dict[int, float] | None = None
    # Seconds of the engine's host work per step behind its server, by the step's sequences
    # (interpolated, clamped to the ends); None: no floor, the device's time alone (module doc).
    host_s_per_step_by_batch: dict[int, float] | None = None

    def context_cost(self, num_decode_seqs: int) -> float:
        """Seconds a decode step of `num_decode_seqs` sequences spends per context token."""
        table = self.decode_s_per_context_token_by_batch
        return interpolate(table, num_decode_seqs) if table else self.decode_s_per_context_token

    def reload_s(self, num_tokens: int) -> float:
        """Seconds to reload `num_tokens` tokens' KV from the host tier."""
        if self.host_reload_tok_s is None:
            raise ValueError("this step-time model has no host reload rate (host_reload_tok_s)")
        return num_tokens / self.host_reload_tok_s

    def prefill_rate(self, num_tokens: int) -> float:
        table = self.prefill_tok_s_by_tokens
        if not table:
            return self.rates.prefill_tok_s
        return interpolate(table, num_tokens)

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int = 0) -> float:
        """Seconds the step takes alone on its device (module docstring)."""
        if num_prefill_tokens and num_decode_seqs and self.prefill_tok_s_by_tokens:
            # A mixed step is one forward over its prompt and decode tokens: the table's time for
            # that many tokens (its per-step cost paid once), and the decodes' context cost.
            num_tokens = num_prefill_tokens + num_decode_seqs
            return num_tokens / self.prefill_rate(num_tokens) + num_context_tokens * self.context_cost(num_decode_seqs)
        seconds = 0.0
        if num_prefill_tokens:
            seconds += num_prefill_tokens / self.prefill_rate(num_prefill_tokens)
        if num_decode_seqs:
            seconds += self.rates.decode_step_s(num_decode_seqs)
            seconds += num_context_tokens * self.context_cost(num_decode_seqs)
        return seconds

    def floor_s(self, num_seqs: int) -> float:
        """The least a step of `num_seqs` sequences lasts behind the server: its host work,
        which overlaps the device's (module doc); 0 without a measured floor."""
        table = self.host_s_per_step_by_batch
        return interpolate(table, num_seqs) if table and num_seqs else 0.0


def interpolate(table: dict[int, float], x: int) -> float:
    """`table` at `x`: linear between its keys, its end values outside them."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        return table[keys[-1]]
    hi = next(i for i, k in enumerate(keys) if k >= x)
    lo_key, hi_key = keys[hi - 1], keys[hi]
    return table[lo_key] + (x - lo_key) / (hi_key - lo_key) * (table[hi_key] - table[lo_key])


class StepTimeFields(BaseModel):
    """What times a step beyond the rates, as a sim profile and a route-sim scenario's backend
    (its `step_time`) hold it: `StepTimeModel`'s fields of the same names."""

    model_config = ConfigDict(extra="forbid")

    decode_s_per_context_token: float = Field(default=0.0, ge=0)
    decode_s_per_context_token_by_batch: dict[int, Annotated[float, Field(ge=0)]] | None = None
    prefill_tok_s_by_tokens: dict[int, Annotated[float, Field(gt=0)]] | None = None
    host_s_per_step_by_batch: dict[int, Annotated[float, Field(ge=0)]] | None = None


class SimProfile(StepTimeFields):
    """One device's profile as a file holds it (validated here, at the file edge)."""

    description: str = ""  # what was measured, where, how
    # The kind of device measured: the router treats a sim backend as one of this kind (a CPU's
    # spill guard, accelerator-only routing, replication among devices of one kind).
    device_kind: Literal["cpu", "cuda", "mps"] = "cuda"
    prefill_tok_s: float = Field(gt=0)
    decode_tok_s: float = Field(gt=0)
    decode_tok_s_by_batch: dict[int, float] | None = None
    host_reload_tok_s: float | None = Field(default=None, gt=0)  # StepTimeModel's; None: no host KV tier
    # The engine the device ran, which an emulated engine takes as its defaults.
    max_active: int = Field(default=256, ge=1)
    num_kv_tokens: int | None = Field(default=None, ge=1)  # None: the engine's own default
    max_num_batched_tokens: int | None = Field(default=None, ge=1)

    def dilated(self, time_scale: float) -> SimProfile:
        """The same device run `time_scale` times slower: every step lasts `time_scale` times
        as long. A host too small to keep many emulated engines at a fast device's pace (each
        step costs the host the same whatever its length) can run them dilated and read every
        duration back divided by `time_scale`; the router gets the dilated rates too, so its
        scores stay those of the device it sees."""
        if time_scale == 1.0:
            return self
        table, prefill, context, host = (self.decode_tok_s_by_batch, self.prefill_tok_s_by_tokens,
                                         self.decode_s_per_context_token_by_batch, self.host_s_per_step_by_batch)
        return self.model_copy(update={
            "prefill_tok_s": self.prefill_tok_s / time_scale, "decode_tok_s": self.decode_tok_s / time_scale,
            "decode_tok_s_by_batch": None if table is None else {b: r / time_scale for b, r in table.items()},
            "prefill_tok_s_by_tokens": None if prefill is None else {n: r / time_scale for n, r in prefill.items()},
            "decode_s_per_context_token": self.decode_s_per_context_token * time_scale,
            "decode_s_per_context_token_by_batch": None if context is None else {b: c * time_scale
                                                                                 for b, c in context.items()},
            "host_reload_tok_s": None if self.host_reload_tok_s is None else self.host_reload_tok_s / time_scale,
            "host_s_per_step_by_batch": None if host is None else {b: h * time_scale for b, h in host.items()},
            "description": f"{self.description} [dilated {time_scale:g}x]"})

    def rates(self) -> RateProfile:
        return RateProfile(self.prefill_tok_s, self.decode_tok_s, self.decode_tok_s_by_batch)

    def step_time(self) -> StepTimeModel:
        return StepTimeModel(self.rates(), self.decode_s_per_context_token, self.prefill_tok_s_by_tokens,
                             self.host_reload_tok_s, self.decode_s_per_context_token_by_batch,
                             self.host_s_per_step_by_batch)

    def step_time_fields(self) -> dict[str, Any]:
        """What this profile times a step by beyond the rates (the context cost, the prefill
        table), as a route-sim scenario's backend `step_time` holds it; those it does not have
        are left out."""
        fields = self.model_dump(include=set(StepTimeFields.model_fields))
        return {name: value for name, value in fields.items() if value}

    def rate_fields(self) -> dict[str, Any]:
        """What the router's rates file holds for this device."""
        fields = self.model_dump(include={"prefill_tok_s", "decode_tok_s", "decode_tok_s_by_batch"})
        if self.host_reload_tok_s is not None:  # a host KV tier's reload, for the router's host-hit term
            fields["reload_tok_s"] = self.host_reload_tok_s
        return fields


def shipped_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILES_DIR.glob("*.json"))


def load_sim_profile(name_or_path: str) -> SimProfile:
    """A shipped profile by name (routing/sim_profiles/NAME.json) or a JSON file."""
    path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"sim profile {name_or_path!r} is neither a shipped profile "
                          f"({', '.join(shipped_profiles())}) nor a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read sim profile {path}: {exc}") from None
    return sim_profile_from_dict(data, str(path))


def sim_profile_from_dict(data: dict[str, Any], where: str = "sim profile") -> SimProfile:
    try:
        profile = SimProfile.model_validate(data)
        profile.rates()  # the rate table's own checks
    except ValidationError as exc:
        raise ConfigError(format_validation_errors(where, exc.errors())) from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return profile
