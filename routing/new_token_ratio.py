"""SGLang-style `new_token_ratio`: a decaying discount on the decode budgets already queued.

The router does not predict output lengths: by default an existing request's decode work is
its whole unused `max_tokens` budget (ratio 1, as in the design). Requests often stop early, so
SGLang's scheduler multiplies the remaining budgets of running requests by `new_token_ratio`,
a heuristic that starts at `init_ratio` (0.7), falls linearly by
`(init_ratio - min_ratio) / decay_steps` per decode step down to `min_ratio` (0.098 = 0.7 *
0.14, after 600 steps), and resets to `init_ratio` whenever the backend goes idle.

What it scales here, exactly: the summed remaining decode budget of the requests already on a
backend (active and queued). The new request being scored always counts its full
`max_tokens`, as in the design and in SGLang, where new requests are also counted unscaled.
One tracker per backend; the router advances it by the decode steps it infers from progress
reports (the largest increase of any request's `num_output_tokens` in one report batch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NewTokenRatioConfig:
    init_ratio: float = 0.7
    min_ratio: float = 0.098
    decay_steps: int = 600

    def __post_init__(self) -> None:
        if not 0 < self.min_ratio <= self.init_ratio <= 1:
            raise ValueError(
                "new_token_ratio needs 0 < min_ratio <= init_ratio <= 1 "
                f"(got min_ratio={self.min_ratio!r}, init_ratio={self.init_ratio!r})"
            )
        if self.decay_steps < 1:
            raise ValueError(f"new_token_ratio decay_steps must be >= 1 (got {self.decay_steps!r})")

    @property
    def decay_per_step(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.decay_steps


class NewTokenRatio:
    """The ratio for one backend. `config=None` means off: the ratio is always 1."""

    def __init__(self, config: NewTokenRatioConfig | None = None) -> None:
        self.config = config
        self.ratio = 1.0 if config is None else config.init_ratio

    def on_decode_steps(self, num_steps: int) -> None:
        if self.config is None or num_steps <= 0:
            return
        decayed = self.ratio - num_steps * self.config.decay_per_step
        self.ratio = max(decayed, self.config.min_ratio)

    def reset(self) -> None:
        """The backend went idle: start again from the initial ratio."""
        if self.config is not None:
            self.ratio = self.config.init_ratio
