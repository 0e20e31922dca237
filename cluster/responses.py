"""A routed request's outputs as one OpenAI response, for a request that does not stream.

The response waits for the request's last output and says everything at once: each choice's
text (a chat's read back through its output plan: content, tool calls, the finish reason they
imply), its logprobs when asked, the request's usage, and the `tandem` field that names the
backend that served it (as the x-tandem-* headers also do, cluster/headers.py). An output the
engine ended with an error fails the whole request (cluster/errors.py, `check_output`).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tandem.cluster.choices import Choice, LogprobsFormatter
from tandem.cluster.dispatch import RoutedRequest
from tandem.cluster.errors import check_output
from tandem.cluster.headers import routed_headers
from tandem.cluster.protocol import (AssistantMessage, ChatChoice, ChatCompletionResponse, CompletionChoice,
                                     CompletionResponse, TandemInfo, UsageInfo)
from tandem.cluster.tools import OutputPlan


def tandem_info(stream: RoutedRequest, usage: Any = None) -> TandemInfo:
    """The `tandem` field of a response or chunk: where the router placed the request, and why;
    with the request's `usage` (engine/outputs.py), how much of its cached prompt came from the
    host KV tier."""
    decision = stream.decision
    return TandemInfo(backend=stream.backend_id, estimated_s=round(decision.estimated_s, 6),
                      projected_ttft_ms=round(decision.projected_ttft_s * 1000, 3),
                      host_cached_tokens=None if usage is None else usage.host_cached_tokens)


async def full_response(stream: RoutedRequest, body: Any, chat: bool, plan: OutputPlan,
                        logprobs: LogprobsFormatter) -> JSONResponse:
    choices: dict[int, Choice] = {}
    final = None
    async for out in stream.outputs():
        check_output(out, stream.req_id)
        choices.setdefault(out.index, Choice()).add(out)
        final = out
    usage = UsageInfo.of(final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens)
    wants_logprobs = body.num_logprobs is not None
    if chat:
        chat_choices = []
        for index, c in sorted(choices.items()):
            content, tool_calls, reason = plan.read(c.text, c.finish_reason)
            choice_logprobs = logprobs.chat(c.token_ids, c.logprobs) if wants_logprobs else None
            chat_choices.append(ChatChoice(index=index, message=AssistantMessage(content=content,
                                                                                 tool_calls=tool_calls),
                                           finish_reason=reason, logprobs=choice_logprobs))
        response: Any = ChatCompletionResponse(id=stream.req_id, model=body.model, usage=usage,
                                               tandem=tandem_info(stream, final.usage), choices=chat_choices)
    else:
        response = CompletionResponse(
            id=stream.req_id, model=body.model, usage=usage, tandem=tandem_info(stream, final.usage),
            choices=[CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason,
                                      logprobs=logprobs.completion(c.token_ids, c.logprobs, 0)
                                      if wants_logprobs else None)
                     for index, c in sorted(choices.items())])
    return JSONResponse(response.model_dump(), headers=routed_headers(stream))
