"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character can span
tokens, and decoding the partial bytes yields U+FFFD. This runs once per request per step (a
few hundred requests a step at high concurrency, while the GPU waits for the next step's
inputs), so there are two ways to do it:

- Byte-level tokenizers (GPT-2's byte-to-character map with a `ByteLevel` decoder: SmolLM2,
  Qwen2.5, Llama 3, the random presets' byte tokenizer): each token id stands for fixed bytes,
  read once per tokenizer into a table (`ByteTable`), and the text is those bytes through
  Python's incremental UTF-8 decoder, which holds back an incomplete character until its last
  byte arrives. A token costs a list index and one C call. The completion's text is exactly
  `tokenizer.decode(output_ids, skip_special_tokens=True)` (a test checks it on random ids):
  the output's bytes decoded on their own, trailing incomplete bytes flushed as U+FFFD when
  the request finishes.
- Any other tokenizer: decode a short window that starts a few tokens back (the prefix) and
  emit only what that window adds beyond the prefix's text, holding back while the window
  still ends in an incomplete character (the scheme vLLM uses). The window is the only token
  list (tokens before it are dropped), and the prefix's text is decoded once, when the window
  moves; a test checks it against the scheme decoded afresh each token.

Stop strings are searched in the new text plus a tail of the old, and text that might be the
start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

import codecs
import weakref

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


class ByteTable:
    """The bytes each token id stands for, for a tokenizer whose decode is byte-level (None for
    any other). Special tokens decode to nothing (as with `skip_special_tokens`); other added
    tokens to their text. Built once per tokenizer (~0.1 s for a 150k vocabulary) and shared."""

    _by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes

    @classmethod
    def of(cls, tokenizer) -> ByteTable | None:
        try:
            return cls._by_tokenizer[tokenizer]
        except KeyError:
            pass
        except TypeError:  # not weak-referenceable: build it each time (tests' odd tokenizers)
            return cls._build(tokenizer)
        table = cls._by_tokenizer[tokenizer] = cls._build(tokenizer)
        return table

    @classmethod
    def _build(cls, tokenizer) -> ByteTable | None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        from tokenizers import decoders

        if not isinstance(backend.decoder, decoders.ByteLevel):
            return None
        from tandem.engine.tokenizer import _bytes_to_unicode

        char_to_byte = {char: byte for byte, char in _bytes_to_unicode().items()}
        added = backend.get_added_tokens_decoder()
        vocab = backend.get_vocab(with_added_tokens=False)
        size = max([*vocab.values(), *added.keys()], default=-1) + 1
        token_bytes = [b""] * size
        for token, token_id in vocab.items():
            try:
                token_bytes[token_id] = bytes(char_to_byte[c] for c in token)
            except KeyError:  # a piece outside the byte map: not a byte-level vocabulary after all
                return None
        for token_id, token in added.items():
            token_bytes[token_id] = b"" if token.special else token.content.encode("utf-8")
        return cls(token_bytes)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 byte_level: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        # Decoded text not handed out yet (after stop truncation). Only this is kept: the text
        # handed out never matters again, and appending to the whole output would copy it on
        # every token (quadratic in the output's length, on the engine's step loop).
        self.pending_text = ""
        self.stopped = False  # a stop string was found
        table = ByteTable.of(tokenizer) if byte_level and skip_special_tokens else None
        self._token_bytes = table.token_bytes if table is not None else None
        if self._token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            return
        self._decode_ids = _fast_decoder(tokenizer)
        # The decode window: tokens from the prefix's start on; its first `read_index` tokens
        # are the prefix, already emitted (or prompt context).
        self.window = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.read_index = len(self.window)
        self.prefix_text = self._decode(self.window)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> bool:
        """Decode new tokens into output_text. Returns True when a stop string was found
        (output_text is then cut just before it)."""
        table = self._token_bytes
        if table is not None:
            size = len(table)
            if len(new_token_ids) == 1:
                t = new_token_ids[0]
                new = table[t] if 0 <= t < size else b""
            else:
                new = b"".join(table[t] if 0 <= t < size else b"" for t in new_token_ids)
            text = self._utf8.decode(new)
            return self._append_text(text) if text else False
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
        """Add decoded text and search for stop strings in it and the held tail before it. A
        stop string cannot start in text already handed out, which `take_new_text` only
        releases once it is too far back to begin one."""
        search_from = max(0, len(self.pending_text) - self.max_stop_len + 1)
        self.pending_text += new_text
        if not self.stop:
            return False
        hits = [i for i in (self.pending_text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.pending_text = self.pending_text[: min(hits)]
            self.stopped = True
            return True
        return False

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out. While running, hold back a tail that could still grow
        into a stop string; when finished, also the bytes of an incomplete last character
        (as U+FFFD, as a whole decode shows them)."""
        if finished and self._token_bytes is not None and not self.stopped:
            self.pending_text += self._utf8.decode(b"", final=True)
        text = self.pending_text
        if not finished and self.max_stop_len > 1:
            end = max(0, len(text) - (self.max_stop_len - 1))
            text, self.pending_text = text[:end], text[end:]
        else:
            self.pending_text = ""
        return text
