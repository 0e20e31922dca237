"""Prompt tokenization outside the engine, exactly as the engine does it.

The HTTP ingress and the Python driver tokenize with a copy of the engine's own tokenizer
(fetched from a backend once) instead of a round trip per request, so they must make the same
calls as `LLMEngine.encode` and `LLMEngine.apply_chat_template`; the end-to-end tests compare the
server's greedy text with `tandem generate` to keep these in step.
"""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
