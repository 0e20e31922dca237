"""The Llama/Qwen2 model family, its config and weight loading.

`load_model(name)` is the entry point: it returns the model on its device, the tokenizer, and
the `ModelConfig` the KV cache and sampler size themselves from.
"""

from tandem.engine.model.config import ModelConfig
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.loader import LoadedModel, build_empty_model, load_model, models_cache_dir
from tandem.engine.model.presets import DEFAULT_MODEL, PRESETS, build_hf_model

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "build_empty_model",
    "build_hf_model",
    "load_model",
    "models_cache_dir",
]
