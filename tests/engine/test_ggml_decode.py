"""A decode step as one ggml graph (engine/model/ggml_decode.py) computes what the eager few-op
layers compute.

With the linears' weights as float32 rows (ggml type F32), the graph's arithmetic is exact up to
float rounding, so its logits must match the eager step's to ~1e-4 for several requests of
different context lengths in one batch: this pins the graph's wiring (RMSNorm, the fused QKV
split, RoPE, the KV write at the slots, the gather of each request's context, grouped-query
flash attention, SwiGLU, the residuals, the head), for a Llama (no bias) and a Qwen2 (QKV bias).
With quantized rows, the graph quantizes activations in its own order, so it is held to the real
SmolLM2 weights' answer instead. ggml is built once per machine; where it cannot be, these skip.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.engine.sampling_params import SamplingParams
from tests.conftest import build_ggml_or_skip, greedy_tokens

PROMPTS = {"a": list(range(10, 51)), "b": list(range(200, 209)), "c": list(range(100, 133))}


def _float_rows(model: nn.Module) -> None:
    """Every ggml linear of a `cpu_kernels="ggml"` model as float32 rows of its dequantized weight."""
    from tandem.engine.model.ggml_decode import _PROJECTIONS, FloatRows

    for layer in model.model.layers:
        for name in _PROJECTIONS:
            linear = getattr(layer, name)
            setattr(layer, name, FloatRows(linear.dequantized(), linear.bias))
    model.logits_proj = FloatRows(model.logits_proj.dequantized(), None)


@pytest.mark.parametrize("model,chunks", [("tiny-llama-random", 0), ("tiny-qwen2-random", 0),
                                          ("tiny-llama-random", 3), ("tiny-llama-random", 16)])
def test_graph_step_matches_the_eager_step_on_float_rows(model, chunks):
    """chunks: each (request, K/V head)'s context cut into pieces combined afterwards (16: more
    pieces than the shortest context has positions, so some are empty); 0: as the engine picks."""
    build_ggml_or_skip()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.model.cpu_compile import decode_forward
    from tandem.engine.model.ggml_decode import GGMLGraphDecode

    engine = LLMEngine(EngineConfig(model=model, dtype="int8", cpu_kernels="ggml", max_active=4))
    runner = engine.model_runner
    _float_rows(runner.model)
    for req_id, prompt in PROMPTS.items():  # prefill: each request's context in the paged cache
        engine.add_request(req_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    first = {o.req_id: o.new_token_ids[-1] for o in engine.step()}
    graph = GGMLGraphDecode(runner.model, runner.kv_caches, engine.config.block_size, attention_chunks=chunks)
    ids = [first[r] for r in PROMPTS]
    positions = [len(p) for p in PROMPTS.values()]
    tables = [engine.kv_cache_manager.req_to_block_ids[r] for r in PROMPTS]
    with torch.inference_mode():
        got = graph(*graph.inputs(ids, positions, tables))
        bs = engine.config.block_size
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)])
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        expected = decode_forward(runner.model, None, torch.tensor(ids), torch.tensor(positions), slots,
                                  torch.tensor(positions) + 1, padded, runner.kv_caches)
        alone = graph(*graph.inputs(ids[1:2], positions[1:2], tables[1:2]))  # one row: the same answer
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(alone[0], got[1], atol=2e-4, rtol=1e-4)
    # the graph derives its slots from the block tables and embeds the ids itself: a table too
    # short, a block the cache does not have or an id past the vocabulary is an error, not a read
    # out of bounds
    with pytest.raises(RuntimeError, match="past its block table"):
        graph(*graph.inputs(ids[:1], [len(tables[0]) * bs], tables[:1]))
    with pytest.raises(RuntimeError, match="not in the cache"):
        graph(*graph.inputs(ids[:1], positions[:1], [[runner.kv_caches[0].shape[1]] * len(tables[0])]))
    with pytest.raises(RuntimeError, match="out of range"):  # the embedding is the graph's: ids are checked
        graph(*graph.inputs([runner.model.config.vocab_size], positions[:1], tables[:1]))


def test_repacked_weights_give_the_same_logits():
    """Weights in ggml's own faster layout (Q4_0 rows interleaved 8 at a time, on AVX2 and ARM)
    are what the graph reads when `repack` is on; the logits must not change."""
    build_ggml_or_skip()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.model.ggml_decode import _PROJECTIONS, GGMLGraphDecode
    from tandem.engine.model.ggml_kernels import Q4_0, GGMLLinear

    engine = LLMEngine(EngineConfig(model="tiny-llama-random", dtype="int4", cpu_kernels="ggml", max_active=4))
    runner = engine.model_runner
    for layer in runner.model.model.layers:  # Q4_0: the type with a repacked layout on x86 (AVX2)
        for name in _PROJECTIONS:
            linear = getattr(layer, name)
            setattr(layer, name, GGMLLinear.from_float(linear.dequantized(), linear.bias, Q4_0))
    prompts = {"a": list(range(10, 51)), "b": list(range(200, 209))}
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first = {o.req_id: o.new_token_ids[-1] for o in engine.step()}
    step = ([first[r] for r in prompts], [len(p) for p in prompts.values()],
            [engine.kv_cache_manager.req_to_block_ids[r] for r in prompts])
    packed = GGMLGraphDecode(runner.model, runner.kv_caches, engine.config.block_size, repack=True)
    plain = GGMLGraphDecode(runner.model, runner.kv_caches, engine.config.block_size, repack=False)
    assert plain.repacked == 0
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert packed.repacked == 4 * len(runner.model.model.layers)
    with torch.inference_mode():
        torch.testing.assert_close(packed(*packed.inputs(*step)), plain(*plain.inputs(*step)), atol=1e-4, rtol=1e-4)


def test_config_checks_ggml_graph():
    from tandem.engine.config import EngineConfig

    assert EngineConfig(dtype="int4", cpu_kernels="ggml-graph").torch_dtype == torch.float32
    assert EngineConfig(dtype="float32", cpu_kernels="ggml-graph").torch_dtype == torch.float32
    with pytest.raises(ValueError, match="int8, int4 or float32"):
        EngineConfig(dtype="bfloat16", cpu_kernels="ggml-graph")
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(dtype="int4", cpu_kernels="ggml-graph", cpu_compile=True)


@pytest.mark.slow
def test_smollm2_int4_on_the_ggml_graph_answers_as_eager():
    """The real weights (the GGUF's Q4_1 blocks): the graph engine's greedy answer is the eager
    ggml engine's, several requests decoding together."""
    build_ggml_or_skip()
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.ggml_decode import GGMLGraphDecode

    config = dict(model="smollm2-135m", dtype="int4", max_active=4)
    engine, graph_out = greedy_tokens(EngineConfig(cpu_kernels="ggml-graph", **config), _prompts(), 12)
    assert isinstance(engine.model_runner.cpu_decode, GGMLGraphDecode)
    engine, eager_out = greedy_tokens(EngineConfig(cpu_kernels="ggml", **config), _prompts(), 12)
    text = [engine.tokenizer.decode(ids) for ids in graph_out]
    assert "Paris" in text[0], text
    assert [o[:4] for o in graph_out] == [o[:4] for o in eager_out]


@pytest.mark.parametrize("model", ["tiny-llama-random", "tiny-qwen2-random"])
def test_float32_engine_on_the_ggml_graph_decodes_as_eager(model):
    """float32: eager steps run oneDNN-packed copies of the linears, the graph reads the plain
    weights as ggml F32 rows (a tied head reads the embedding itself, no copy): the same arithmetic
    as the eager float32 engine up to rounding, so the same greedy tokens."""
    build_ggml_or_skip()
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.cpu_linear import PackedLinear, available
    from tandem.engine.model.ggml_decode import FloatRows, GGMLGraphDecode

    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(3)]
    engine, graph_out = greedy_tokens(EngineConfig(model=model, dtype="float32", cpu_kernels="ggml-graph",
                                                   max_active=4), prompts, 10)
    model_, decode = engine.model_runner.model, engine.model_runner.cpu_decode
    assert isinstance(decode, GGMLGraphDecode)
    rows = decode.rows
    assert all(isinstance(layer[name], FloatRows) for layer in rows.layers for name in layer)
    assert isinstance(rows.head, FloatRows)
    if available(torch.float32):
        assert isinstance(model_.model.layers[0].qkv_proj, PackedLinear)
    if model_.lm_head is None:  # tied: the head's rows are the embedding matrix itself
        assert rows.head.weight.data_ptr() == model_.model.embed_tokens.weight.data_ptr()
    _, eager_out = greedy_tokens(EngineConfig(model=model, dtype="float32", cpu_kernels="torch", max_active=4),
                                 prompts, 10)
    assert graph_out == eager_out


def _prompts() -> list[list[int]]:
    from tandem.engine.model.loader import load_model

    tokenizer = load_model("smollm2-135m", "cpu", torch.float32).tokenizer
    return [tokenizer.encode(p) for p in ("The capital of France is", "Water boils at", "1, 2, 3,")]
