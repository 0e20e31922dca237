"""oneDNN-packed CPU linears agree with F.linear, and a packed model with the plain one."""

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_linear
from engine.model.cpu_linear import PackedGateUp, PackedLinear, pack_model


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
    from engine.model.loader import load_model

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
    mlp_in, residual = torch.randn(2, 3, plain.config.hidden_size)
    torch.testing.assert_close(packed.model.layers[0].mlp(mlp_in, residual), plain.model.layers[0].mlp(mlp_in, residual),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_epilogues_match_the_separate_ops(dtype, tol):
    """The residual add and SwiGLU in oneDNN's epilogues against F.linear then the op, on fresh data."""
    if not cpu_linear.epilogues_available(dtype):
        pytest.skip(f"this torch build has no fused {dtype} epilogues")
    g = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(2, 96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x, residual = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 96, generator=g).to(dtype)
    for b in (bias, None):
        out = PackedLinear(weight[0], b, fuse_add=True).forward_add(x, residual)
        expected = F.linear(x.float(), weight[0].float(), None if b is None else b.float()) + residual.float()
        torch.testing.assert_close(out.float(), expected, atol=tol * 4, rtol=tol)
    merged = weight.reshape(192, 64)
    fused = PackedGateUp(merged)
    gate, up = F.linear(x.float(), merged.float()).chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_and_mul(x).float(), F.silu(gate) * up, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(fused(x), F.linear(x, merged), atol=tol, rtol=tol)  # the plain forward too


def test_pack_model_fuses_gate_up_only_when_asked():
    needs(torch.float32)
    from engine.model.loader import load_model

    fused = load_model("tiny-llama-random", torch.device("cpu"), torch.float32).model
    plain = load_model("tiny-llama-random", torch.device("cpu"), torch.float32).model
    pack_model(fused)
    pack_model(plain, fuse_epilogues=False)
    assert isinstance(fused.model.layers[0].mlp.gate_up_proj, PackedGateUp) == cpu_linear.epilogues_available(torch.float32)
    assert isinstance(plain.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert not plain.model.layers[0].self_attn.o_proj.fuse_add


def test_engine_packs_on_cpu_unless_told_not_to():
    needs(torch.float32)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    assert LLMEngine(EngineConfig(model="tiny-llama-random")).model_runner.num_packed_linears > 0
    assert LLMEngine(EngineConfig(model="tiny-llama-random", pack_cpu_weights=False)).model_runner.num_packed_linears == 0
