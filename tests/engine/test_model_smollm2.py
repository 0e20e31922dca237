"""Our model on the real SmolLM2-135M-Instruct weights against HF transformers.

The first run on a machine converts the package's GGUF into the model cache (~20-30 s); later
runs load the converted safetensors in about a second.
"""

import pytest
import torch

from tandem.engine.model import load_model

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", "cpu", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(loaded.hf_path, dtype=torch.float32).eval()
    return loaded, hf


def new_kv_caches(config):
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape) for _ in range(config.num_hidden_layers)]


@torch.inference_mode()
def run_step(model, kv_caches, make_step, chunks):
    positions, meta = make_step([(cached, len(ids)) for cached, ids in chunks], BLOCK_SIZE)
    input_ids = torch.tensor([t for _, ids in chunks for t in ids])
    return model.compute_logits(model(input_ids, positions, kv_caches, meta)).split([len(i) for _, i in chunks])


@torch.inference_mode()
def hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0].float()


def test_config_and_tokenizer(smollm2):
    loaded, _ = smollm2
    c = loaded.model_config
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.vocab_size) == ("llama", 576, 30, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (9, 3, 64, True)
    assert c.eos_token_ids == [2] and loaded.sampling_vocab_size is None
    assert loaded.tokenizer("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]


def test_batched_prefill_and_decode_match_hf(smollm2, make_step):
    loaded, hf = smollm2
    tok = loaded.tokenizer
    a = tok("The capital of France is Paris, and the capital of Germany is")["input_ids"]
    b = tok("def fibonacci(n):\n    if n < 2:\n        return n")["input_ids"]
    expected_a, expected_b = hf_logits(hf, a), hf_logits(hf, b)
    kv_caches = new_kv_caches(loaded.model_config)
    la, lb = run_step(loaded.model, kv_caches, make_step, [(0, a[:-3]), (0, b[:10])])
    torch.testing.assert_close(la, expected_a[:-3], atol=5e-4, rtol=1e-4)
    torch.testing.assert_close(lb, expected_b[:10], atol=5e-4, rtol=1e-4)
    la, lb = run_step(loaded.model, kv_caches, make_step, [(len(a) - 3, a[-3:]), (10, b[10:])])
    torch.testing.assert_close(la, expected_a[-3:], atol=5e-4, rtol=1e-4)
    torch.testing.assert_close(lb, expected_b[10:], atol=5e-4, rtol=1e-4)


def test_greedy_decode_says_paris(smollm2, make_step):
    loaded, _ = smollm2
    ids = loaded.tokenizer("The capital of France is")["input_ids"]
    kv_caches = new_kv_caches(loaded.model_config)
    (logits,) = run_step(loaded.model, kv_caches, make_step, [(0, ids)])
    generated = []
    for _ in range(4):
        generated.append(int(logits[-1].argmax()))
        (logits,) = run_step(loaded.model, kv_caches, make_step, [(len(ids) + len(generated) - 1, generated[-1:])])
    assert "Paris" in loaded.tokenizer.decode(generated)
