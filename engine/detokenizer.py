"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character can span
tokens, and decoding the partial bytes yields U+FFFD. We decode a short window that starts a
few tokens back (the prefix) and emit only what that window adds beyond the prefix's text,
holding back while the window still ends in an incomplete character (the scheme vLLM uses).
Stop strings are searched in the new text plus a tail of the old, and text that might be the
start of a stop string is held back until it is known not to be one.

This runs once per request per step, so it is kept lean: the window is the only token list
(tokens before it are dropped, so nothing is sliced or copied), and the prefix's text is
decoded once, when the window moves, instead of on every call. It is the same state machine as
decoding `tokens[prefix_offset:read_offset]` and `tokens[prefix_offset:]` afresh each call, and
a test checks that the text agrees token for token. `tokenizers.decoders.DecodeStream` runs
the same scheme in Rust and is faster still, but it leaves the prefix empty when the prompt's
tail ends in an incomplete character and re-anchors the window while the prefix text is empty,
so its text can differ from this scheme's; it is not used.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded before the new ones, so leading-space handling matches a full decode.
CONTEXT_TOKENS = 5


def _fast_decoder(tokenizer):
    """The Rust tokenizer's own decode when the HF wrapper would add nothing to it: it costs a
    fifth of the wrapper's call, and a busy engine decodes twice per token per step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = _fast_decoder(tokenizer)
        # The decode window: tokens from the prefix's start on; its first `read_index` tokens
        # are the prefix, already emitted (or prompt context).
        self.window = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.read_index = len(self.window)
        self.prefix_text = self._decode(self.window)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.output_text = ""  # everything decoded so far (after stop truncation)
        self.num_emitted_chars = 0  # how much of output_text the caller has seen

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> bool:
        """Decode new tokens into output_text. Returns True when a stop string was found
        (output_text is then cut just before it)."""
        window = self.window
        window.extend(new_token_ids)
        full_text = self._decode(window)
        prefix_len = len(self.prefix_text)
        if len(full_text) <= prefix_len or full_text.endswith(REPLACEMENT_CHAR):
            return False  # incomplete character: wait for more tokens
        # The window moves on: the tokens read so far become the new prefix.
        del window[: self.read_index]
        self.read_index = len(window)
        self.prefix_text = self._decode(window)
        return self._append_text(full_text[prefix_len:])

    def _append_text(self, new_text: str) -> bool:
        search_from = max(0, len(self.output_text) - self.max_stop_len + 1)
        self.output_text += new_text
        if not self.stop:
            return False
        hits = [i for i in (self.output_text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.output_text = self.output_text[: min(hits)]
            return True
        return False

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out. While running, hold back a tail that could still grow
        into a stop string."""
        end = len(self.output_text)
        if not finished and self.max_stop_len > 1:
            end = max(self.num_emitted_chars, end - (self.max_stop_len - 1))
        text = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return text
