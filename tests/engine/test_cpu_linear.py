"""oneDNN-packed CPU linears agree with F.linear, and a packed model with the plain one."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model import cpu_linear
from tandem.engine.model.cpu_linear import PackedLinear, pack_model


def needs(dtype):
    if not cpu_linear.available(dtype):
        pytest.skip(f"this torch build has no packed {dtype} linear")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_packed_linear_equals_f_linear(dtype, atol, rows):
    needs(dtype)
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    for b in (bias, None):
        out = PackedLinear(weight, b)(x)
        assert out.dtype == dtype and out.shape == (rows, 96)
        torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(), atol=atol, rtol=1e-5 if atol else 0)


@pytest.mark.parametrize("preset", ["tiny-llama-random", "tiny-qwen2-random"])
def test_packed_model_matches_the_plain_model(preset):
    needs(torch.float32)
    from tandem.engine.model.loader import load_model

    plain = load_model(preset, torch.device("cpu"), torch.float32).model
    packed = load_model(preset, torch.device("cpu"), torch.float32).model
    num_linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    count = pack_model(packed)
    untied = plain.lm_head is not None
    # every linear but an untied output head, plus the packed output projection
    assert count == num_linears - untied + 1 and packed.logits_proj is not None
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    hidden = torch.randn(5, plain.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), atol=1e-4, rtol=1e-4)
    mlp_in = torch.randn(3, plain.config.hidden_size)
    torch.testing.assert_close(packed.model.layers[0].mlp(mlp_in), plain.model.layers[0].mlp(mlp_in),
                               atol=1e-5, rtol=1e-5)


def test_engine_packs_on_cpu_unless_told_not_to():
    needs(torch.float32)
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    assert LLMEngine(EngineConfig(model="tiny-llama-random")).model_runner.num_packed_linears > 0
    assert LLMEngine(EngineConfig(model="tiny-llama-random", pack_cpu_weights=False)).model_runner.num_packed_linears == 0
