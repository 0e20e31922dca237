"""A response's choices, read from the engine's outputs: text, finish reason and logprobs per
choice index (parallel sampling streams the `n` choices of one request interleaved), and the
logprobs in OpenAI's two shapes.

Logprobs arrive from the engine as token ids and numbers, one `(logprob, top ids, top
logprobs)` entry per sampled token; the ingress turns ids into text here, with the engine's own
tokenizer, one token at a time (as vLLM does: a token that is part of a multi-byte character
decodes to U+FFFD on its own). They describe the distribution the sampler drew from: after
penalties, logit bias and temperature, before top-k, top-p and min-p (for greedy rows,
temperature 1). A logprob of -inf (a token the request banned) is sent as -9999.0, as vLLM
does: JSON has no infinity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0


@dataclass
class Choice:
    """One choice's outputs, gathered for a non-streamed response."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: Any) -> None:
        self.pieces.append(out.new_text)
        if out.logprobs:
            self.token_ids += out.new_token_ids
            self.logprobs += out.logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class LogprobsFormatter:
    """Token ids to OpenAI's logprobs objects, with each token's text decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def chat(self, token_ids: list[int], entries: list[tuple]) -> ChatLogprobs:
        content = []
        for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, entries):
            top = [self._top(i, lp) for i, lp in zip(top_ids, top_logprobs)]
            text = self.token(token_id)
            content.append(ChatTokenLogprob(token=text, logprob=max(logprob, MIN_LOGPROB),
                                            bytes=list(text.encode("utf-8")), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token(token_id)
        return TopLogprob(token=text, logprob=max(logprob, MIN_LOGPROB), bytes=list(text.encode("utf-8")))

    def completion(self, token_ids: list[int], entries: list[tuple], text_offset: int) -> CompletionLogprobs:
        """`text_offset`: where this piece starts in the choice's text (a stream continues it)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, entries):
            text = self.token(token_id)
            logprob = max(logprob, MIN_LOGPROB)
            top = {self.token(i): max(lp, MIN_LOGPROB) for i, lp in zip(top_ids, top_logprobs)}
            top.setdefault(text, logprob)  # OpenAI: the sampled token is always among them
            tokens.append(text)
            token_logprobs.append(logprob)
            tops.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops,
                                  text_offset=offsets)
