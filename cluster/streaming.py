"""A routed request's outputs as a stream of server-sent events, and the response that sends it.

The stream starts only once the request is admitted by a backend (cluster/app.py), so its
status code still means something; from then on a failure can no longer change it, and becomes
the stream's last event instead: an error event shaped like an error response's body
(cluster/errors.py, `error_event`), then `[DONE]`. An output the engine ended with an error is
such a failure (`check_output`).

Each output becomes at most one chunk: a chat's first chunks give each choice its role; a text
delta goes out through its choice's `ChunkTemplate` (cluster/sse.py: the same bytes as the
chunk model, without building one per token); chunks that carry logprobs or tool calls take the
chunk model; a chat that may call tools holds back what could be the start of a call
(cluster/tools.py). `include_usage` adds a last chunk with the request's usage.

The request must be closed (aborted on its backend unless finished, and released from the
ingress's admission count) exactly once however the response ends: by the generator's end at
once, and by `OnceClosedStreamingResponse` even when the client was gone before the first byte
and the generator never started.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from tandem.cluster.choices import LogprobsFormatter
from tandem.cluster.dispatch import RoutedRequest
from tandem.cluster.errors import check_output, error_event, internal_error
from tandem.cluster.headers import routed_headers
from tandem.cluster.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse,
                                     DeltaMessage, UsageInfo)
from tandem.cluster.responses import tandem_info
from tandem.cluster.sse import ChunkTemplate, sse_event
from tandem.cluster.tools import OutputPlan, ToolCallStream, delta_tool_calls
from tandem.engine.errors import TandemError

logger = logging.getLogger("tandem.app")  # the ingress's one logger (cluster/errors.py)


@dataclass
class ChunkMaker:
    """The chunks of one stream: the same id, model, creation time and `tandem` field in each,
    shaped as OpenAI's: `make` a choice's chunk, with no `usage` key (OpenAI sends usage only in
    the chunk `usage` makes, the last, when the request's stream_options.include_usage asks for
    it); a chat delta carries only its fields (DeltaMessage)."""

    stream: RoutedRequest
    model: str
    created: int
    chat: bool
    info: Any

    def make(self, delta: Any, finish_reason: str | None, index: int = 0, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            choice: Any = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
            chunk: Any = ChatCompletionChunk(id=self.stream.req_id, created=self.created, model=self.model,
                                             choices=[choice], tandem=self.info(self.stream))
        else:
            choice = CompletionChoice(index=index, text=delta, finish_reason=finish_reason, logprobs=logprobs)
            chunk = CompletionResponse(id=self.stream.req_id, created=self.created, model=self.model,
                                       choices=[choice], tandem=self.info(self.stream))
        return chunk.model_dump(exclude={"usage"})

    def usage(self, usage: UsageInfo, engine_usage: Any) -> dict[str, Any]:
        info = self.info(self.stream, engine_usage)
        if self.chat:
            chunk: Any = ChatCompletionChunk(id=self.stream.req_id, created=self.created, model=self.model,
                                             choices=[], usage=usage, tandem=info)
        else:
            chunk = CompletionResponse(id=self.stream.req_id, created=self.created, model=self.model,
                                       choices=[], usage=usage, tandem=info)
        return chunk.model_dump()


class OnceClosedStreamingResponse(StreamingResponse):
    """Runs `cleanup` exactly once when the response ends, however it ends.

    A generator's `finally` alone is not enough: if the client is gone before the first byte,
    Starlette never starts the body generator, and its cleanup would never run.
    """

    def __init__(self, content: Any, cleanup: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cleanup, self._cleanup = self._cleanup, None
            if cleanup is not None:
                await cleanup()


def streaming_response(stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan,
                       logprobs: LogprobsFormatter, release: Callable[[], None]) -> StreamingResponse:
    """The request's events as a response; once it ends, the request is closed and `release`d."""

    async def cleanup() -> None:
        await stream.close()
        release()

    return OnceClosedStreamingResponse(sse_events(stream, body, chat, plan, logprobs), cleanup,
                                       media_type="text/event-stream",
                                       headers={**routed_headers(stream), "cache-control": "no-cache"})


async def sse_events(stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan,
                     logprobs: LogprobsFormatter) -> AsyncIterator[str]:
    """Chunks as server-sent events; a failure mid-stream becomes an error event, then [DONE]."""
    chunk = ChunkMaker(stream, body.model, int(time.time()), chat, tandem_info)
    try:
        if chat:
            for index in range(body.n):
                yield sse_event(chunk.make(DeltaMessage(role="assistant", content=""), None, index))
        try:
            async for event in _output_events(stream, body, chat, plan, logprobs, chunk):
                yield event
        except TandemError as exc:
            yield sse_event(error_event(exc, stream.req_id))
        except Exception:  # a bug: the stream ends with an error event, the log has the trace
            logger.exception("request %s: unhandled error mid-stream", stream.req_id)
            yield sse_event(error_event(internal_error(stream.req_id), stream.req_id))
        yield "data: [DONE]\n\n"
    finally:
        await stream.close()  # at once, not when the response object is torn down


async def _output_events(stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan,
                         logprobs: LogprobsFormatter, chunk: ChunkMaker) -> AsyncIterator[str]:
    """One event per engine output that says something, then the usage chunk if asked."""
    tool_streams = {i: plan.tool_stream() for i in range(body.n)} if chat else {}
    text_offsets = [0] * body.n
    templates: dict[int, ChunkTemplate] = {}

    def text_event(index: int, text: str, reason: str | None) -> str:
        """A chunk of text only, from this choice's template (the same bytes as `chunk.make`);
        a chat choice's last chunk with no text left has an empty delta, as OpenAI's."""
        if chat and not text:
            return sse_event(chunk.make(DeltaMessage(), reason, index))
        template = templates.get(index)
        if template is None:
            template = templates[index] = ChunkTemplate(lambda t, r: chunk.make(_delta(t, chat), r, index))
        return template.event(text, reason)

    final = None
    async for out in stream.outputs():
        check_output(out, stream.req_id)
        final = out
        out_logprobs = _chunk_logprobs(out, body, chat, text_offsets, logprobs) if out.logprobs else None
        tool_stream = tool_streams.get(out.index)
        if tool_stream is not None:
            delta, reason = _tool_delta(tool_stream, out)
            if delta is not None or out_logprobs is not None:
                yield sse_event(chunk.make(delta or DeltaMessage(), reason, out.index, out_logprobs))
        elif out_logprobs is not None:
            yield sse_event(chunk.make(_delta(out.new_text, chat), out.finish_reason, out.index, out_logprobs))
        elif out.new_text or out.finish_reason:
            yield text_event(out.index, out.new_text, out.finish_reason)
    if body.include_usage and final is not None:
        u = final.usage
        yield sse_event(chunk.usage(UsageInfo.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens), u))


def _chunk_logprobs(out: Any, body: Any, chat: bool, text_offsets: list[int], logprobs: LogprobsFormatter) -> Any:
    """One streamed output's logprobs; completions' text offsets continue per choice."""
    if body.num_logprobs is None:
        return None
    if chat:
        return logprobs.chat(out.new_token_ids, out.logprobs)
    chunk_logprobs = logprobs.completion(out.new_token_ids, out.logprobs, text_offsets[out.index])
    text_offsets[out.index] += sum(len(token) for token in chunk_logprobs.tokens)
    return chunk_logprobs


def _delta(text: str, chat: bool) -> Any:
    return DeltaMessage(content=text) if chat else text


def _tool_delta(tool_stream: ToolCallStream, out: Any) -> tuple[DeltaMessage | None, str | None]:
    """What a chat stream that reads tool calls sends for one engine output: content as it
    becomes safe to send, the calls (and the reason) with the last one; None for nothing yet."""
    content = tool_stream.feed(out.new_text)
    if out.finish_reason is None:  # this choice goes on (`finished` is the whole request's)
        return (DeltaMessage(content=content) if content else None), None
    rest, calls, reason = tool_stream.finish(out.finish_reason)
    text = content + (rest or "")
    return DeltaMessage(content=text or None, tool_calls=delta_tool_calls(calls) if calls else None), reason
