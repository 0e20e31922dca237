"""The few-call CPU decoder layers compute what the reference layers compute."""

import pytest
import torch

from tandem.engine.model.cpu_layers import CPUDecoderLayer, fuse_cpu_model
from tests.conftest import greedy_tokens


@pytest.mark.parametrize("preset", ["tiny-llama-random", "tiny-qwen2-random"])
def test_fused_cpu_engine_matches_the_reference_in_float32(preset):
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(3)]
    engine, fused = _greedy(preset, prompts, pack=True)
    assert any(isinstance(m, CPUDecoderLayer) for m in engine.model_runner.model.modules())
    engine, reference = _greedy(preset, prompts, pack=False)
    assert not any(isinstance(m, CPUDecoderLayer) for m in engine.model_runner.model.modules())
    assert fused == reference


def _greedy(preset, prompts, pack, max_tokens=12):
    from tandem.engine.config import EngineConfig

    config = EngineConfig(model=preset, dtype="float32", max_active=4, pack_cpu_weights=pack)
    return greedy_tokens(config, prompts, max_tokens)


def test_fused_layer_matches_reference_layer_on_a_prefill():
    from tandem.engine.attention.metadata import AttentionMetadata
    from tandem.engine.model.loader import load_model

    reference = load_model("tiny-qwen2-random", torch.device("cpu"), torch.float32).model
    fused = fuse_cpu_model(load_model("tiny-qwen2-random", torch.device("cpu"), torch.float32).model)
    cfg = reference.config
    num_tokens, block_size = 20, 16
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens], block_size=block_size)
    ids, positions = torch.arange(5, 5 + num_tokens), torch.arange(num_tokens)

    def caches():
        return [torch.zeros(2, 2, block_size, cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]

    ours = fused(ids, positions, caches(), meta)
    theirs = reference(ids, positions, caches(), meta)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
