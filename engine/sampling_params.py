"""Per-request sampling and stopping settings, validated once at submission.

Validation lives here, not in the HTTP layer, so every entry point (the OpenAI endpoint, the
Python driver, `tandem generate`) rejects the same bad input with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine can never serve; the message names the offending field."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens > 0,
             f"max_tokens must be a positive integer, got {self.max_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature!r}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= -1,
             f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
