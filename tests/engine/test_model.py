"""Our Llama/Qwen2 modules against HF transformers on identical random weights.

Every way the engine feeds the model (a whole prompt, one decode token at a time on top of the
paged cache, two requests in one flat batch, a prompt split into chunks) must give HF's
full-sequence logits at every position.
"""

import pytest
import torch

from tandem.engine.model import build_hf_model, load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
TINY_PRESETS = ["tiny-llama-random", "tiny-qwen2-random"]


@pytest.fixture(scope="module", params=TINY_PRESETS)
def models(request):
    torch.manual_seed(0)
    return load_model(request.param, "cpu", torch.float32).model, build_hf_model(request.param)


def new_kv_caches(model, dtype=torch.float32):
    c = model.config
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)]


@torch.inference_mode()
def run_step(model, kv_caches, make_step, chunks):
    """chunks: per request (num_cached_tokens, new token ids) -> per request logits [len(ids), vocab]."""
    positions, meta = make_step([(cached, len(ids)) for cached, ids in chunks], BLOCK_SIZE)
    input_ids = torch.tensor([t for _, ids in chunks for t in ids])
    logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
    assert logits.dtype == torch.float32
    return logits.split([len(ids) for _, ids in chunks])


@torch.inference_mode()
def hf_logits(hf_model, ids):
    return hf_model(torch.tensor([ids])).logits[0].float()


def prompt(length, seed):
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_logits_close(ours, theirs, atol=1e-4):
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-4)


def test_prefill_matches_hf(models, make_step):
    model, hf = models
    ids = prompt(21, seed=1)
    (logits,) = run_step(model, new_kv_caches(model), make_step, [(0, ids)])
    assert_logits_close(logits, hf_logits(hf, ids))


def test_decode_against_cache_matches_hf(models, make_step):
    model, hf = models
    ids, num_prefill = prompt(20, seed=2), 9
    expected = hf_logits(hf, ids)
    kv_caches = new_kv_caches(model)
    (logits,) = run_step(model, kv_caches, make_step, [(0, ids[:num_prefill])])
    assert_logits_close(logits, expected[:num_prefill])
    for pos in range(num_prefill, len(ids)):
        (logits,) = run_step(model, kv_caches, make_step, [(pos, [ids[pos]])])
        assert_logits_close(logits, expected[pos : pos + 1])


def test_chunked_prefill_matches_hf(models, make_step):
    model, hf = models
    ids = prompt(21, seed=3)
    kv_caches = new_kv_caches(model)
    (first,) = run_step(model, kv_caches, make_step, [(0, ids[:10])])
    (second,) = run_step(model, kv_caches, make_step, [(10, ids[10:])])
    assert_logits_close(torch.cat([first, second]), hf_logits(hf, ids))


def test_two_requests_in_one_flat_batch(models, make_step):
    model, hf = models
    a, b = prompt(14, seed=4), prompt(13, seed=5)
    expected_a, expected_b = hf_logits(hf, a), hf_logits(hf, b)
    kv_caches = new_kv_caches(model)
    # both prefill; then a decodes while b prefills a chunk; then both decode
    la, lb = run_step(model, kv_caches, make_step, [(0, a[:13]), (0, b[:7])])
    assert_logits_close(la, expected_a[:13])
    assert_logits_close(lb, expected_b[:7])
    la, lb = run_step(model, kv_caches, make_step, [(13, a[13:]), (7, b[7:12])])
    assert_logits_close(la, expected_a[13:])
    assert_logits_close(lb, expected_b[7:12])
    a_next = int(la[-1].argmax())
    la, lb = run_step(model, kv_caches, make_step, [(14, [a_next]), (12, b[12:])])
    assert_logits_close(la, hf_logits(hf, a + [a_next])[-1:])
    assert_logits_close(lb, expected_b[12:])


def test_bfloat16_matches_hf_bfloat16(make_step):
    model = load_model("tiny-qwen2-random", "cpu", torch.bfloat16).model
    hf = build_hf_model("tiny-qwen2-random").to(torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = prompt(12, seed=6)
    kv_caches = new_kv_caches(model, torch.bfloat16)
    (first,) = run_step(model, kv_caches, make_step, [(0, ids[:8])])
    (second,) = run_step(model, kv_caches, make_step, [(8, ids[8:])])
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf, ids), atol=3e-2, rtol=3e-2)
