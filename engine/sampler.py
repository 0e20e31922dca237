"""Turns the last-position logits of each request into its next token.

An all-greedy batch takes one argmax over the batch. Otherwise each row applies its own
temperature, top-k and top-p and draws with its own `torch.Generator` when it has a seed, so a
seeded request samples the same tokens whatever else shares its batch. Rows that must not
stop yet (min_tokens) get their stop tokens masked first. `sample` leaves the ids on the device
(the runner copies them to the host once, asynchronously); calling the sampler reads them back
with one `.tolist()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # stop tokens while under min_tokens


class Sampler:
    def __init__(self, sampling_vocab_size: int | None = None) -> None:
        # Random-weight presets pair a large vocab with a small tokenizer: sample only ids
        # the tokenizer can turn back into text.
        self.sampling_vocab_size = sampling_vocab_size

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        return self.sample(logits, rows).tolist()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The next token of each row, int64 [len(rows)], left on the logits' device."""
        if self.sampling_vocab_size is not None:
            logits = logits[:, : self.sampling_vocab_size]
        logits = self._mask_banned(logits, rows)
        if all(row.params.is_greedy for row in rows):
            return logits.argmax(dim=-1)
        # Rows are drawn one by one (each with its own settings and generator) but read back
        # together: one device-to-host copy per step, not one per request.
        return torch.stack([self._sample_row(logits[i], row) for i, row in enumerate(rows)])

    @staticmethod
    def _mask_banned(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(row.banned_token_ids for row in rows):
            return logits
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                ids = [t for t in row.banned_token_ids if t < logits.shape[-1]]
                logits[i, ids] = float("-inf")
        return logits

    @staticmethod
    def _sample_row(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
        """The row's next token id as a 0-d tensor, left on the device."""
        params = row.params
        if params.is_greedy:
            return logits.argmax()
        logits = logits.float() / params.temperature
        if params.top_k > 0:
            kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p_filter(probs, params.top_p)
        return torch.multinomial(probs, 1, generator=row.generator)[0]


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (always at least one)."""
    sorted_probs, sorted_ids = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(-1)
    drop = cumulative - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, sorted_ids, sorted_probs)
    return filtered / filtered.sum()
