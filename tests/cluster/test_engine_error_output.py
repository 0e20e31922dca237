"""A request the engine failed on its own (its last output finished with reason "error",
engine/output_processor.py) reaches the client as an error: the error event of a stream that
already started (then [DONE]), or a 500 for a response not streamed. The ingress's response code
(cluster/streaming.py, cluster/responses.py) runs here without Ray: a stand-in stream hands it
the engine's outputs."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from tandem.cluster.errors import error_response
from tandem.cluster.responses import full_response
from tandem.cluster.streaming import sse_events
from tandem.engine.errors import TandemError
from tandem.cluster.protocol import ChatCompletionRequest, CompletionRequest
from tandem.cluster.tools import plan_output
from tandem.engine.outputs import RequestOutput, Usage

REQ_ID = "cmpl-test"


class FakeStream:
    def __init__(self, outputs):
        self.req_id, self.backend_id = REQ_ID, "cpu0"
        self.decision = SimpleNamespace(estimated_s=0.0, projected_ttft_s=0.0)
        self._outputs = outputs
        self.closed = False

    async def outputs(self):
        for out in self._outputs:
            yield out

    async def close(self):
        self.closed = True


def output(text, reason=None, index=0, finished=None):
    finished = reason is not None if finished is None else finished
    return RequestOutput(REQ_ID, [65] if text else [], text, finished, reason, Usage(3, 1, 0), index=index)


def events(outputs, body, chat):
    async def collect():
        return [chunk async for chunk in sse_events(FakeStream(outputs), body, chat, plan_output(body, None), None)]
    return [line.removeprefix("data: ").strip() for line in asyncio.run(collect())]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_ends_with_an_error_event(chat):
    if chat:
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    else:
        body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True})
    sent = events([output("A"), output("", "error")], body, chat)
    assert sent[-1] == "[DONE]"
    error = json.loads(sent[-2])["error"]
    assert error["type"] == "internal_error" and error["request_id"] == REQ_ID
    assert REQ_ID in error["message"] and "Traceback" not in error["message"]
    chunks = [json.loads(e) for e in sent[:-2]]
    assert all(c["choices"][0].get("finish_reason") is None for c in chunks)  # no chunk says it ended well


def test_a_choice_that_failed_fails_the_request_with_several_choices():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True, "n": 2})
    sent = events([output("A", index=0), output("B", index=1), output("", "error", index=1, finished=False)],
                  body, False)
    assert sent[-1] == "[DONE]" and json.loads(sent[-2])["error"]["type"] == "internal_error"


def test_a_response_not_streamed_is_a_500():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    with pytest.raises(TandemError) as failed:
        asyncio.run(full_response(FakeStream([output("A"), output("", "error")]), body, False,
                                  plan_output(body, None), None))
    response = error_response(failed.value, REQ_ID)
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["type"] == "internal_error"


def test_other_finish_reasons_pass():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True})
    sent = events([output("A"), output("B", "length")], body, False)
    assert sent[-1] == "[DONE]" and all("error" not in json.loads(e) for e in sent[:-1])
