"""The bench client's fast path: after the first text it skips plain text chunks unparsed, and
must still read the usage chunk and error events, whichever way a server shapes its chunks."""

import json

from bench.client import is_plain_text_chunk


def data(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n"


def test_text_chunks_are_skipped_and_usage_and_errors_are_read():
    text = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
    assert is_plain_text_chunk(data(text))  # OpenAI's shape (and Tandem's): no usage key
    assert is_plain_text_chunk(data({**text, "usage": None}))  # servers that send "usage":null
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    assert not is_plain_text_chunk(data(usage))
    assert not is_plain_text_chunk(data({"error": {"message": "boom", "type": "internal_error", "code": 500}}))


def test_generated_text_cannot_fake_a_usage_or_error_key():
    for fake in ('"usage":{"completion_tokens":1}', '"error":1'):
        chunk = {"id": "c", "choices": [{"index": 0, "text": fake, "finish_reason": None}]}
        assert is_plain_text_chunk(data(chunk))
