"""Weight-only int8/int4 CPU linears, GGUF Q4 blocks repacked as they are, and the quantized
engine modes agreeing with float32 on tiny models (seconds on two cores)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model import quant
from tandem.engine.model.quant import Int4Linear, Int8Linear
from tests.conftest import greedy_tokens


def needs(quantization):
    if not quant.available(quantization, torch.bfloat16):
        pytest.skip(f"this torch build has no {quantization} CPU linear kernel")


def _weight(n=96, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_linear_matches_its_dequantized_weight():
    needs("int8")
    weight, bias = _weight(), torch.randn(96) * 0.1
    layer = Int8Linear(weight, bias, torch.bfloat16)
    assert (layer.dequantized() - weight).abs().max() <= weight.abs().amax(1).max() / 127
    x = torch.randn(5, 128)
    expected = F.linear(x, layer.dequantized(), bias)
    torch.testing.assert_close(layer(x.bfloat16()).float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_linear_follows_q4_arithmetic(group_size):
    needs("int4")
    weight = _weight()
    layer = Int4Linear.from_float(weight, None, group_size, torch.bfloat16)
    x = torch.randn(3, 128)
    identity = layer(torch.eye(128, dtype=torch.bfloat16)).float().t()  # the dequantized weight
    step = (weight.view(96, -1, group_size).amax(-1) - weight.view(96, -1, group_size).amin(-1)) / 15
    assert ((identity - weight).view(96, -1, group_size).abs().amax(-1) <= step * 0.6 + 2e-3).all()
    torch.testing.assert_close(layer(x.bfloat16()).float(), F.linear(x, identity), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_repack_without_loss(kind):
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    weight = (_weight(64, 128) * 10).numpy()
    ggml_type = getattr(gguf.GGMLQuantizationType, kind)
    blocks = quants.quantize(weight, ggml_type)
    q, scale, zero = quant._q4_blocks(blocks, kind)
    ours = ((q.view(64, -1, 32).float() - 8) * scale[..., None] + zero[..., None]).view(64, 128)
    np.testing.assert_allclose(ours.numpy(), quants.dequantize(blocks, ggml_type), rtol=1e-6, atol=1e-6)


def test_unpermute_rows_inverts_llamacpp_order():
    heads, head_dim = 3, 8
    rows = torch.arange(heads * head_dim)[:, None].float()
    # llama.cpp's convert script: reshape(heads, 2, dim/2).swapaxes(1, 2)
    permuted = rows.reshape(heads, 2, head_dim // 2, 1).transpose(1, 2).reshape(rows.shape)
    assert torch.equal(quant.unpermute_rows(permuted, heads), rows)


def test_quantized_dtypes_are_cpu_only_with_bf16_activations():
    from tandem.engine.config import EngineConfig

    config = EngineConfig(dtype="int4")
    assert config.weight_quantization == "int4" and config.torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="float32").weight_quantization is None
    with pytest.raises(ValueError, match="cpu only"):
        EngineConfig(dtype="int8", device="cuda")


def _greedy(model, dtype, prompts, max_tokens=12):
    from tandem.engine.config import EngineConfig

    return greedy_tokens(EngineConfig(model=model, dtype=dtype, max_active=4), prompts, max_tokens)


def _prefill_logits(model, num_tokens=20, block_size=16):
    """Logits of one `num_tokens` prompt through the model's forward (no engine)."""
    from tandem.engine.attention.metadata import AttentionMetadata

    cfg = model.config
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens], block_size=block_size)
    dtype = model.model.embed_tokens.weight.dtype
    caches = [torch.zeros(2, 2, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
              for _ in range(cfg.num_hidden_layers)]
    hidden = model(torch.arange(5, 5 + num_tokens), torch.arange(num_tokens), caches, meta)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("preset", ["tiny-llama-random", "tiny-qwen2-random"])
def test_quantized_model_equals_bf16_model_with_its_dequantized_weights(preset, quantization):
    """The kernels compute what their weights say: the quantized model's logits against a bf16
    model holding the dequantized weights. (The quantization error itself is measured on
    SmolLM2 in docs/benchmarks/cpu-vs-llamacpp-2core.md; tiny random weights have near ties.)"""
    needs(quantization)
    from tandem.engine.model.loader import load_model

    quantized = load_model(preset, "cpu", torch.bfloat16, quantization=quantization).model
    reference = load_model(preset, "cpu", torch.bfloat16).model
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, linear in reference.named_modules():
            if isinstance(modules.get(name), (Int8Linear, Int4Linear)):
                linear.weight.copy_(modules[name].dequantized())
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.model.modules())
    head = quantized.logits_proj.dequantized()
    ours = _prefill_logits(quantized)
    reference.logits_proj = torch.nn.Linear(head.shape[1], head.shape[0], bias=False).to(torch.bfloat16)
    reference.logits_proj.weight.data.copy_(head)
    theirs = _prefill_logits(reference)
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 0.03 * scale


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_engine_generates(dtype):
    needs(dtype)
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(3)]
    engine, out = _greedy("tiny-qwen2-random", dtype, prompts)
    assert engine.dtype == torch.bfloat16 and [len(o) for o in out] == [12, 12, 12]


def test_serve_flag_and_yaml_set_cpu_backends_only():
    import argparse

    from tandem.cluster.config import BackendConfig
    from tandem.cluster.plan import plan_backends
    from tandem.cluster.serve_cli import add_arguments, load_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = load_config(parser.parse_args(["--backends", "cpu,cuda", "--cpu-dtype", "int4"]))
    assert config.cpu_dtype == "int4"
    plans = plan_backends(config, num_gpus=1, mps_available=False)
    assert [(p.device, p.dtype) for p in plans] == [("cpu", "int4"), ("cuda", "auto")]
    assert BackendConfig(device="cpu", dtype="int8").dtype == "int8"
    with pytest.raises(ValueError, match="cpu backends"):
        BackendConfig(device="cuda", dtype="int8")
