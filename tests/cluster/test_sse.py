"""The SSE chunk template gives the reference path's bytes (pydantic chunk, model_dump,
json.dumps) for completions and chat chunks, whatever the text holds."""

from __future__ import annotations

import pytest

from tandem.cluster.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    TandemInfo,
)
from tandem.cluster.sse import ChunkTemplate, sse_event

TEXTS = ["", "Hello", " world", "naïve 日本語 🎉", 'quote " backslash \\ newline \n tab \t', "\x00", "\u2028\ud7ff",
         '"}],"x":{"', "\x00tandem-text\x00"]
REASONS = [None, "stop", "length"]


def completion_maker(index: int):
    info = TandemInfo(backend="cuda0", estimated_s=0.012345)

    def make(text, reason):
        chunk = CompletionResponse(id="cmpl-1", created=1700000000, model="m", tandem=info,
                                   choices=[CompletionChoice(index=index, text=text, finish_reason=reason)])
        return chunk.model_dump(exclude={"usage"})  # as the app's chunks: usage only in the last
    return make


def chat_maker(index: int):
    info = TandemInfo(backend="cpu0")

    def make(text, reason):
        return ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="m", tandem=info,
                                   choices=[ChatChunkChoice(index=index, delta=DeltaMessage(content=text),
                                                            finish_reason=reason)]).model_dump(exclude={"usage"})
    return make


@pytest.mark.parametrize("maker", [completion_maker, chat_maker])
@pytest.mark.parametrize("index", [0, 3])
def test_template_events_equal_the_reference_path(maker, index):
    make = maker(index)
    template = ChunkTemplate(make)
    assert template.is_fast
    for text in TEXTS:
        for reason in REASONS:
            assert template.event(text, reason) == sse_event(make(text, reason)), (text, reason)


def test_a_builder_that_changes_its_input_falls_back_to_the_reference():
    def make(text, reason):
        return {"text": text.upper(), "finish_reason": reason}

    template = ChunkTemplate(make)
    assert not template.is_fast
    assert template.event("abc", "stop") == sse_event({"text": "ABC", "finish_reason": "stop"})
