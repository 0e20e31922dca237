"""The model shape the engine needs, read once from a transformers config.

Our modules, the KV cache sizing and the sampler all read this small dataclass instead of a
transformers config, whose attribute names move between versions (transformers 5 moved
`rope_theta` into `rope_parameters`) and between families (Qwen2 always has a qkv bias, Llama
has an `attention_bias` flag). Anything our modules do not implement (scaled RoPE, sliding
windows, MLP bias) is refused here with a clear error rather than silently computed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # "llama" | "qwen2"
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        architecture = getattr(hf_config, "model_type", None)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _check_supported_features(hf_config)
        num_heads = hf_config.num_attention_heads
        llama_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            hidden_size=hf_config.hidden_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=_rope_theta(hf_config),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=True if architecture == "qwen2" else llama_bias,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=_as_id_list(getattr(hf_config, "eos_token_id", None)),
            architecture=architecture,
            o_proj_bias=architecture == "llama" and llama_bias,
        )


def _rope_parameters(hf_config: Any) -> dict:
    """transformers 5 keeps RoPE settings in `rope_parameters`; 4.x used `rope_theta`/`rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _rope_theta(hf_config: Any) -> float:
    return float(_rope_parameters(hf_config)["rope_theta"])


def _check_supported_features(hf_config: Any) -> None:
    rope_type = _rope_parameters(hf_config).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} is not implemented; only the default RoPE is")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not implemented")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("MLP bias is not implemented")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"activation {hf_config.hidden_act!r} is not implemented; only silu (SwiGLU) is")


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
