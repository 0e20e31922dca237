"""ggml's quantized CPU linears (engine/model/ggml_kernels.py): the kernels compute what their
blocks hold, GGUF blocks are used byte for byte, and an engine on them generates what a float32
engine does with the same weights. ggml is built once per machine (about a minute on two cores,
from llama-cpp-python's sdist, which needs the package index); where it cannot be built, the
kernel tests skip and say why."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model import ggml_kernels
from tandem.engine.model.ggml_kernels import Q4_0, Q4_1, Q8_0, GGMLLinear
from tests.conftest import build_ggml_or_skip


@pytest.fixture(scope="module")
def kernels():
    build_ggml_or_skip()


def _weight(n=96, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_config_takes_ggml_kernels_for_quantized_dtypes_only():
    from tandem.engine.config import EngineConfig

    assert EngineConfig(dtype="int4", cpu_kernels="ggml").torch_dtype == torch.float32
    assert EngineConfig(dtype="int4").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="int8 or int4"):
        EngineConfig(dtype="float32", cpu_kernels="ggml")
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(dtype="int4", cpu_kernels="onnx")


def test_block_rows_are_checked():
    assert ggml_kernels.row_bytes(Q4_1, 128) == 4 * 20 and ggml_kernels.row_bytes(Q8_0, 64) == 2 * 34
    with pytest.raises(ValueError, match="divisible by 32"):
        ggml_kernels.row_bytes(Q4_0, 48)
    with pytest.raises(ValueError, match="uint8"):
        GGMLLinear(torch.zeros(4, 10, dtype=torch.uint8), Q4_1, 128, None)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_ggml_quantize_matches_gguf_reference(kernels, ggml_type):
    """ggml's own quantizer writes the blocks gguf-py's reference writes, and its kernel's
    dequantized weight is gguf-py's dequantization of them."""
    from gguf import GGMLQuantizationType, quants

    weight = _weight() * 10
    layer = GGMLLinear.from_float(weight, None, ggml_type)
    reference = quants.quantize(weight.numpy(), GGMLQuantizationType(ggml_type))
    np.testing.assert_array_equal(layer.blocks.numpy(), reference)
    expected = quants.dequantize(reference, GGMLQuantizationType(ggml_type))
    # The kernel quantizes its input rows too (Q8_0 / Q8_1), so identity rows come back to ~1e-3.
    np.testing.assert_allclose(layer.dequantized().numpy(), expected, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_linear_matches_float_matmul_of_its_weight(kernels, rows):
    weight, bias = _weight(), torch.randn(96) * 0.1
    layer = GGMLLinear.from_float(weight, bias, Q4_1)
    from gguf import GGMLQuantizationType, quants

    dequantized = torch.from_numpy(quants.dequantize(layer.blocks.numpy(), GGMLQuantizationType.Q4_1))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    residual = torch.randn(rows, 96)
    expected = F.linear(x, dequantized, bias)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    # Activations go through Q8_1 (8 bits per value, a scale per 32): ~0.5% of the output's scale.
    torch.testing.assert_close(out, expected, atol=0.01 * expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(layer(x, residual), out + residual)


def test_gguf_blocks_are_used_byte_for_byte(kernels):
    """SmolLM2's shipped Q4_1 GGUF: every projection keeps its blocks (q/k rows back in HF's
    order) and the tied output projection is the Q8_0 token embedding, unchanged."""
    from gguf import GGUFReader

    from tandem.engine.model.loader import _gguf_source, load_model

    path = _gguf_source("smollm2-135m")
    model = load_model("smollm2-135m", "cpu", torch.float32, quantization="int4", kernels="ggml").model
    linears = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert len(linears) == 30 * 4 + 1 and not any(isinstance(m, torch.nn.Linear) for m in model.model.modules())
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    layer = model.model.layers[3]
    o_proj = np.asarray(tensors["blk.3.attn_output.weight"].data)
    assert layer.self_attn.o_proj.ggml_type == Q4_1 and np.array_equal(layer.self_attn.o_proj.blocks.numpy(), o_proj)
    v_rows = np.asarray(tensors["blk.3.attn_v.weight"].data)  # v is not permuted: the last rows of qkv
    assert np.array_equal(layer.self_attn.qkv_proj.blocks[-v_rows.shape[0]:].numpy(), v_rows)
    assert model.logits_proj.ggml_type == Q8_0
    assert np.array_equal(model.logits_proj.blocks.numpy(), np.asarray(tensors["token_embd.weight"].data))


def test_engine_on_ggml_q8_0_follows_float32(kernels):
    """A tiny model's int8 (Q8_0) engine against float32: Q8_0 keeps ~2-3 significant digits, so
    greedy decoding agrees on the first tokens (later ones can flip at the random model's near ties)."""
    from tandem.engine.config import EngineConfig
    from tests.conftest import greedy_tokens

    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(3)]
    engine, out = greedy_tokens(EngineConfig(model="tiny-qwen2-random", dtype="int8", cpu_kernels="ggml",
                                             max_active=4), prompts, 8)
    assert engine.dtype == torch.float32 and [len(o) for o in out] == [8, 8, 8]
    assert isinstance(engine.model_runner.model.model.layers[0].self_attn.qkv_proj, GGMLLinear)
    _, reference = greedy_tokens(EngineConfig(model="tiny-qwen2-random", dtype="float32", cpu_kernels="torch",
                                              max_active=4), prompts, 8)
    assert [o[:2] for o in out] == [r[:2] for r in reference]
