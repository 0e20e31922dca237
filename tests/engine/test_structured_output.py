"""Structured outputs: the params, the compile cache, a grammar walked token by token, the
bitmask applied (xgrammar's kernel against the torch reference, on CPU and, when there is
one, CUDA), and the engine finishing a constrained request with asynchronous scheduling on.

The byte tokenizer makes the expected masks exact: token b is byte b, so the tokens a grammar
allows first are the first bytes of what it accepts.
"""

import json
import sys

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams
from tandem.engine.structured_output import (
    INSTALL_HINT,
    GrammarCompiler,
    StructuredOutputParams,
    apply_grammars,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    bitmask_width,
    check_enforceable,
    fill_bitmask,
)
from tandem.engine.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer, byte_tokenizer_eos_ids

pytest.importorskip("xgrammar")

EOS = byte_tokenizer_eos_ids()  # <|im_end|>, <|endoftext|>
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
          "required": ["a", "b"]}
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_byte_tokenizer(), BYTE_VOCAB_SIZE, tuple(EOS))


def allowed(grammar, vocab_size=BYTE_VOCAB_SIZE):
    bitmask = fill_bitmask([grammar], vocab_size)
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab_size)]
    return {t for t, bit in enumerate(bits) if bit}


def walk(grammar, text):
    return all(grammar.accept_token(b) for b in text.encode())


# -- params ----------------------------------------------------------------------------------
def test_schema_is_canonical_so_key_order_does_not_matter():
    a = StructuredOutputParams.from_json_schema({"type": "object", "required": ["a"], "properties": {"a": {}}})
    b = StructuredOutputParams.from_json_schema({"properties": {"a": {}}, "required": ["a"], "type": "object"})
    assert a == b and hash(a) == hash(b) and a.kind == "json_schema"


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "json_object": True}, "exactly one"),
    ({"choice": ()}, "non-empty"),
    ({"choice": ("a", "")}, "non-empty"),
    ({"regex": ""}, "must not be empty"),
])
def test_params_take_exactly_one_valid_constraint(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutputParams(**kwargs)


def test_unenforceable_keywords_are_refused_where_they_are():
    schema = {"type": "object", "properties": {"not": {"type": "array", "items": {"uniqueItems": True}}}}
    with pytest.raises(InvalidRequestError, match=r"schema\.properties\.not\.items: .*'uniqueItems'"):
        check_enforceable(schema)
    with pytest.raises(InvalidRequestError, match="allOf with more than one"):
        StructuredOutputParams.from_json_schema({"allOf": [{"type": "object"}, {"required": ["a"]}]})
    check_enforceable({"type": "object", "properties": {"not": {"type": "string"}}})  # a key, not the keyword


# -- compiling -------------------------------------------------------------------------------
def test_a_schema_sent_again_is_compiled_once(compiler):
    before = compiler.num_compiled
    for order in (SCHEMA, dict(reversed(list(SCHEMA.items())))):
        compiler.make_grammar(StructuredOutputParams.from_json_schema(order))
    assert compiler.num_compiled == before + 1


@pytest.mark.parametrize("params, match", [
    (StructuredOutputParams(regex="(["), "regex could not be compiled into a grammar: .*Unclosed"),
    (StructuredOutputParams.from_json_schema({"type": "strin"}),
     "json_schema could not be compiled into a grammar: .*strin"),
])
def test_compile_errors_are_invalid_requests(compiler, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        compiler.make_grammar(params)


def test_without_xgrammar_a_structured_request_says_the_install_is_broken(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import raises ImportError
    fresh = GrammarCompiler(build_byte_tokenizer(), BYTE_VOCAB_SIZE, tuple(EOS))
    with pytest.raises(InvalidRequestError, match="the install is broken") as info:
        fresh.make_grammar(StructuredOutputParams(json_object=True))
    assert str(info.value).startswith(INSTALL_HINT) and "xgrammar" in str(info.value)
    assert "[structured]" not in str(info.value)  # a default dependency, not an extra to install


def test_xgrammar_is_a_default_dependency():
    """Structured outputs work on a plain `pip install tandem`: the grammar library is no extra."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"xgrammar\b", dep) for dep in project["dependencies"])
    assert "structured" in project["optional-dependencies"]  # old install commands keep working


# -- a grammar, token by token ---------------------------------------------------------------
def test_schema_grammar_masks_then_terminates_on_eos(compiler):
    grammar = compiler.make_grammar(StructuredOutputParams.from_json_schema(SCHEMA))
    assert allowed(grammar) == {ord("{")}
    assert walk(grammar, '{"a": "')
    assert allowed(grammar) == {ord("x"), ord("y")}
    assert walk(grammar, 'y", "b": ')
    assert allowed(grammar) == {ord("t"), ord("f")}
    assert walk(grammar, "false}")
    assert allowed(grammar) == set(EOS) and not grammar.is_terminated()
    assert grammar.accept_token(EOS[0]) and grammar.is_terminated()


def test_choice_and_regex_and_a_refused_token(compiler):
    choice = compiler.make_grammar(StructuredOutputParams(choice=("yes", 'no "way"')))
    assert allowed(choice) == {ord("y"), ord("n")}
    assert walk(choice, 'no "way"') and allowed(choice) == set(EOS)
    regex = compiler.make_grammar(StructuredOutputParams(regex=r"[0-9]{2}-[a-c]"))
    assert allowed(regex) == {ord(str(d)) for d in range(10)}
    assert walk(regex, "42-")
    assert not regex.accept_token(ord("z"))


def test_json_object_starts_with_a_brace(compiler):
    grammar = compiler.make_grammar(StructuredOutputParams(json_object=True))
    assert allowed(grammar) == {ord("{")}
    assert walk(grammar, '{"k": [1, {"n": null}]}') and allowed(grammar) == set(EOS)


# -- the mask on the logits ------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_size", [259, 49152])
def test_kernel_and_torch_reference_agree(device, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=gen).to(device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, bitmask_width(vocab_size)), generator=gen, dtype=torch.int32)
    rows = [0, 2, 5]
    fast, ref = logits.clone(), logits.clone()
    apply_token_bitmask(fast, bitmask.to(device), rows)
    apply_token_bitmask_torch(ref, bitmask.to(device), rows)
    assert torch.equal(fast, ref)
    assert torch.equal(fast[[1, 3, 4]], logits[[1, 3, 4]])  # rows without a grammar untouched
    for row in rows:  # exactly the zero bits are -inf
        bits = torch.tensor([(int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in range(vocab_size)])
        assert torch.equal(torch.isinf(fast[row]).cpu(), bits == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_grammars_on_a_vocab_slice(compiler, device):
    """The sampler may mask a slice of wider logits (a random preset's small tokenizer)."""
    wide = torch.zeros(2, 1000, device=device)
    logits = wide[:, :BYTE_VOCAB_SIZE]
    apply_grammars(logits, [None, compiler.make_grammar(StructuredOutputParams(choice=("ab", "cd")))])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ord("a"), ord("c")]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(wide[:, BYTE_VOCAB_SIZE:]).all()


# -- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    """Engines by (device, async_scheduling), built on first use; on cuda (None: its default)
    the engine takes its fast path (Triton attention, CUDA graphs) and schedules asynchronously."""
    built = {}

    def get(device="cpu", async_scheduling=False):
        if (device, async_scheduling) not in built:
            built[device, async_scheduling] = LLMEngine(EngineConfig(
                model="tiny-llama-random", device=device, dtype="float32", max_model_len=128, max_active=4,
                async_scheduling=async_scheduling))  # float32: greedy tokens do not depend on the batch
        return built[device, async_scheduling]
    return get


def run(engine, requests):
    got = {}
    for req_id, (prompt, params) in requests.items():
        engine.add_request(req_id, prompt, params)
        got[req_id] = {"text": "", "reason": None, "ids": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.req_id]["text"] += out.new_text
            got[out.req_id]["ids"] += out.new_token_ids
            if out.finished:
                got[out.req_id]["reason"] = out.finish_reason
    return got


@pytest.mark.parametrize("device, async_scheduling", [("cpu", False), ("cpu", True), *[
    pytest.param("cuda", None, marks=p.marks) for p in DEVICES[1:]]])
def test_engine_constrains_grammar_rows_and_leaves_the_others(engines, device, async_scheduling):
    engine = engines(device, async_scheduling)
    schema = StructuredOutputParams.from_json_schema(SCHEMA)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {
        "schema": ([5, 6, 7], SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_output=schema)),
        "choice": ([8, 9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                          structured_output=StructuredOutputParams(choice=("red", "green")))),
        "plain": ([10, 11, 12], plain),
    }
    got = run(engine, requests)
    doc = json.loads(got["schema"]["text"])
    assert doc["a"] in ("x", "y") and isinstance(doc["b"], bool) and set(doc) == {"a", "b"}
    assert got["schema"]["reason"] == "stop" and got["schema"]["ids"][-1] in EOS
    assert got["choice"]["text"] in ("red", "green") and got["choice"]["reason"] == "stop"  # even with ignore_eos
    assert got["plain"] == run(engine, {"plain": ([10, 11, 12], plain)})["plain"]
    pool = engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_engine_refuses_a_bad_grammar_before_queueing(engines):
    engine = engines()
    with pytest.raises(InvalidRequestError, match="regex could not be compiled"):
        engine.add_request("bad", [1, 2], SamplingParams(structured_output=StructuredOutputParams(regex="(")))
    assert not engine.has_unfinished_requests()


def test_min_tokens_with_structured_output_is_refused_at_the_edge():
    """A rule between two fields of the request contract, checked where the request is built."""
    params = SamplingParams(min_tokens=2, structured_output=StructuredOutputParams(json_object=True))
    with pytest.raises(InvalidRequestError, match="min_tokens") as info:
        params.validate()
    assert info.value.param == "min_tokens"
