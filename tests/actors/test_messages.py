"""The one codec of actors/messages.py: every message type decodes to exactly what was encoded
(every field, nested structs, a SamplingParams with its structured output, logprobs as tuples,
exceptions and arbitrary Python objects through the pickle extension)."""

from __future__ import annotations

import typing

import msgspec
import pytest

from tandem.actors import messages as m
from tandem.engine.outputs import EngineStats, RequestOutput, RequestProgress, Usage
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.structured_output import StructuredOutputParams

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=3, stop=["\n", "x"],
                        stop_token_ids=[2], ignore_eos=True, min_tokens=1, n=2, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={5: -1.5, 9: 2.0}, logprobs=3,
                        structured_output=StructuredOutputParams(choice=("yes", "no")))
OUTPUT = RequestOutput("r", [5, 6], "ab", True, "stop", Usage(10, 2, 8, 3), 1.5, 1.6, 1.7, 1.8, 1,
                       [(-0.1, [5, 7], [-0.1, -2.5]), (-0.2, [6], [-0.2])])


def examples() -> list:
    request = m.EngineCoreRequest("r", [1, 2, 3], PARAMS, 1.25)
    stats = EngineStats(1, 2, 3, 4, 0.5, 6, 7, 8)
    return [
        request,
        m.EngineCoreCall(3, "profile", [None, {"num_steps": 4}]),
        m.EngineCoreStop(),
        m.EngineCoreReady("cpu", "cpu", "float32", 4, 16, 1024, "torch", "tiny", 256, 5.0, {"vocab": [1, 2]}, 0.5, 99,
                          ("\0tandem-wire-1", b"\x00\xfftoken")),
        m.EngineCoreFailed("Traceback ...\nRuntimeError: boom"),
        m.EngineCoreOutputs(replies=[m.CallReply.of(3, True, stats), m.CallReply.of(4, True, (1, "a")),
                                     m.CallReply.of(5, False, InvalidRequestError("too long"))],
                            finished=[m.FinishedRequest("stop", 1.5, 1.6, 1.7, 1.8),
                                      m.FinishedRequest(None, 2.0, None, None, None)],
                            progress=[RequestProgress("r", "running", 10, 8, 10, 2, 7)],
                            step=m.StepTiming(10, 4, 4, 0.012), cache_changes={2**63 + 5: 1, 17: 0, 18: 2},
                            stats=m.StatsTotals(1, 2, 0.25, 30, 40, 20, 100, 50, 1)),
        m.EngineCoreOutputs(),
        m.ChannelOpen("ch-1"),
        m.ChannelAdds([request, m.EngineCoreRequest("s", [4], SamplingParams())]),
        m.ChannelBatch([m.Admitted("r", "cpu0", 3, [OUTPUT], 1.0, 1.1), m.Admitted("s", "cpu0", 1),
                        OUTPUT, m.Refusal("t", InvalidRequestError("bad"))]),
        m.WireCalls([m.WireCall(1, ["r", [1, 2], 16, 1])]),
        m.WireAnswers([m.WireAnswer(1, ["cpu0", "abc", 0.5]), m.WireAnswer(2, ValueError("no backend"))]),
    ]


def _same(a, b) -> bool:
    """Equal, exceptions by type and arguments (they have no equality of their own)."""
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    if hasattr(a, "__struct_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a).__name__ == "Ext":
        return False  # a pickled value must come back as the object, never as the raw extension
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("message", examples(), ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_exactly(message):
    decoded = m.decode(m.encode(message))
    if isinstance(message, m.EngineCoreOutputs) and message.replies:
        # `CallReply.of` pickles its value into an extension: decoded, it is the object again
        stats = EngineStats(1, 2, 3, 4, 0.5, 6, 7, 8)
        assert _same(decoded.replies, [m.CallReply(3, True, stats), m.CallReply(4, True, (1, "a")),
                                       m.CallReply(5, False, InvalidRequestError("too long"))])
        message, decoded = msgspec.structs.replace(message, replies=[]), msgspec.structs.replace(decoded, replies=[])
    assert _same(message, decoded), decoded


def test_the_examples_cover_every_message_type():
    covered = {type(msg) for msg in examples()}
    assert covered == set(typing.get_args(m.Message))


def test_a_decoded_request_keeps_its_sampling_params_and_logprobs_stay_tuples():
    decoded = m.decode(m.encode(m.ChannelBatch([OUTPUT])))
    assert decoded.items[0].logprobs[0] == (-0.1, [5, 7], [-0.1, -2.5])
    request = m.decode(m.encode(m.ChannelAdds([m.EngineCoreRequest("r", [1], PARAMS)]))).requests[0]
    assert request.params == PARAMS and isinstance(request.params.structured_output, StructuredOutputParams)


def test_an_unknown_extension_is_refused():
    with pytest.raises(ValueError, match="unknown msgpack extension"):
        m.decode(msgspec.msgpack.encode(m.WireAnswers([m.WireAnswer(1, msgspec.msgpack.Ext(9, b"x"))])))


def test_a_placement_and_its_request_cross_the_wire_as_arrays_read_back_by_convert():
    """`place_many`'s struct argument and answer ride in `list[Any]`/`Any` fields: they decode as
    their arrays and `msgspec.convert` makes the structs again, every field, deadline included."""
    request = m.PlaceRequest("r", [1, 2], 16, 2, priority=-1, ttft_deadline_s=0.25)
    placement = m.Placement("cpu0", "i1", 0.5, 0.125)
    calls = m.decode(m.encode(m.WireCalls([m.WireCall(1, [request])])))
    answers = m.decode(m.encode(m.WireAnswers([m.WireAnswer(1, placement)])))
    assert msgspec.convert(calls.calls[0].args[0], m.PlaceRequest) == request
    assert msgspec.convert(answers.answers[0].value, m.Placement) == placement
    assert msgspec.convert(placement, m.Placement) is placement  # over Ray it arrives as the struct
    assert m.PlaceRequest("q", [3], 4) == m.PlaceRequest("q", [3], 4, 1, 0, None)
