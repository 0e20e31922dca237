"""oneDNN-packed CPU linears agree with F.linear, and a packed model with the plain one; they run
at a bounded set of row counts (`bucket_rows`), so oneDNN builds a bounded set of kernels."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model import cpu_linear
from tandem.engine.model.cpu_linear import PackedLinear, bucket_rows, pack_model


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


def test_bucket_rows_is_exact_to_16_then_eight_sizes_per_doubling():
    assert [bucket_rows(n) for n in (1, 4, 16, 17, 19, 32, 33, 37, 64, 65, 100, 129, 257, 289, 512, 513)] == \
        [1, 4, 16, 18, 20, 32, 36, 40, 64, 72, 104, 144, 288, 320, 512, 576]
    for n in range(1, 8193):
        b = bucket_rows(n)
        assert n <= b and 8 * (b - n) < n and bucket_rows(b) == b
    assert len({bucket_rows(n) for n in range(1, 513)}) == 16 + 5 * 8  # a CPU engine's 512-token steps


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_packed_linear_runs_at_the_bucketed_row_count(monkeypatch, dtype, atol):
    needs(dtype)
    rows_run = []
    pointwise = torch.ops.mkldnn._linear_pointwise

    def recording(x, *args):
        rows_run.append(x.shape[0])
        return pointwise(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    linear = PackedLinear(weight, bias)
    for rows in (3, 17, 100, 300):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        residual = torch.randn(rows, 96, generator=g).to(dtype)
        expected = F.linear(x, weight, bias)
        torch.testing.assert_close(linear(x).float(), expected.float(), atol=atol, rtol=1e-5 if atol else 0)
        added = linear.add(x, residual)
        assert added.shape == (rows, 96)
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: one rounding against two
        torch.testing.assert_close(added.float(), expected.float() + residual.float(), atol=tolerance, rtol=tolerance)
    batched = torch.randn(2, 10, 64, generator=g).to(dtype)  # leading dims flattened: 20 rows
    assert linear(batched).shape == (2, 10, 96)
    assert rows_run == [3, 3, 18, 18, 104, 104, 320, 320, 20]
