"""Tokenizers for the engine: the model's own HF tokenizer, or a byte tokenizer built in code,
and the two calls that turn a prompt into token ids.

`encode_prompt` and `encode_chat` are the only tokenization path: the engine uses them for a
text prompt, and the HTTP ingress and the Python driver use them with a copy of the engine's
tokenizer (fetched from a backend once), so a prompt tokenizes the same wherever it enters.

Random-weight presets run where no tokenizer files can be shipped (the GPU machine has no hub
access), yet their outputs must still detokenize. A byte-level BPE with no merges needs no
files: ids 0-255 are the raw bytes (so any text round-trips and any id sequence decodes), a
few ChatML specials follow, and a ChatML template makes `--chat` work too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, as byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: id b is byte b, then <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab.update({token: 256 + i for i, token in enumerate(BYTE_SPECIAL_TOKENS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(list(BYTE_SPECIAL_TOKENS))  # already in the vocab: keeps ids 256..
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def byte_tokenizer_eos_ids() -> list[int]:
    """<|im_end|> ends a chat turn, <|endoftext|> ends a document: both stop generation."""
    return [256 + BYTE_SPECIAL_TOKENS.index("<|im_end|>"), 256 + BYTE_SPECIAL_TOKENS.index("<|endoftext|>")]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer saved in a model directory."""
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt: the tokenizer's own special tokens (e.g. BOS) included."""
    return list(tokenizer.encode(text))


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Chat messages (and the tools the model may call, for templates that render them)
    through the model's template, ending with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
