"""The model and reference attention on a CUDA device (skipped where there is none).

Weights are materialised straight on the GPU (meta device, then `to_empty`), RoPE tables are
rebuilt there, and the reference attention runs on device tensors: the logits must still match
HF transformers running the same weights on the same device.
"""

import pytest
import torch

from tandem.engine.model import build_hf_model, load_model
from tandem.engine.model.weights import load_hf_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK_SIZE = 16


def new_kv_caches(config, dtype, num_blocks=32):
    shape = (2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(config.num_hidden_layers)]


@torch.inference_mode()
def run_step(model, kv_caches, make_step, chunks):
    positions, meta = make_step([(c, len(ids)) for c, ids in chunks], BLOCK_SIZE, "cuda")
    input_ids = torch.tensor([t for _, ids in chunks for t in ids], device="cuda")
    return model.compute_logits(model(input_ids, positions, kv_caches, meta)).split([len(i) for _, i in chunks])


@pytest.mark.parametrize("preset", ["tiny-llama-random", "tiny-qwen2-random"])
def test_tiny_models_match_hf_on_cuda(preset, make_step):
    torch.manual_seed(0)
    hf = build_hf_model(preset)
    loaded = load_model(preset, "cuda", torch.float32)
    load_hf_weights(loaded.model, hf.state_dict().items())
    hf = hf.to("cuda")
    a, b = torch.randint(0, 256, (30,)).tolist(), torch.randint(0, 256, (22,)).tolist()
    with torch.inference_mode():
        expected_a, expected_b = (hf(torch.tensor([x], device="cuda")).logits[0].float() for x in (a, b))
    kv_caches = new_kv_caches(loaded.model_config, torch.float32)
    la, lb = run_step(loaded.model, kv_caches, make_step, [(0, a[:20]), (0, b[:12])])
    got_a, got_b = [la], [lb]
    for step in range(10):  # both decode, one token each per step
        la, lb = run_step(loaded.model, kv_caches, make_step, [(20 + step, [a[20 + step]]), (12 + step, [b[12 + step]])])
        got_a.append(la)
        got_b.append(lb)
    torch.testing.assert_close(torch.cat(got_a), expected_a, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(torch.cat(got_b), expected_b, atol=1e-3, rtol=1e-3)


def test_qwen25_random_bf16_prefill_and_decode_agree(make_step):
    loaded = load_model("qwen2.5-0.5b-random", "cuda", torch.bfloat16)
    model, tok = loaded.model, loaded.tokenizer
    assert model.model.embed_tokens.weight.device.type == "cuda"
    ids = tok("The quick brown fox jumps over the lazy dog")["input_ids"]
    (full,) = run_step(model, new_kv_caches(loaded.model_config, torch.bfloat16), make_step, [(0, ids)])
    kv_caches = new_kv_caches(loaded.model_config, torch.bfloat16)
    run_step(model, kv_caches, make_step, [(0, ids[:-1])])
    (last,) = run_step(model, kv_caches, make_step, [(len(ids) - 1, ids[-1:])])
    assert torch.isfinite(full).all()
    torch.testing.assert_close(last[0], full[-1], atol=0.1, rtol=0.05)
    next_id = int(last[0, : loaded.sampling_vocab_size].argmax())
    assert next_id < len(tok) and isinstance(tok.decode([next_id]), str)
