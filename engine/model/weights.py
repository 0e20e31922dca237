"""Copy HF-named checkpoint tensors into our modules, merging q/k/v and gate/up on the way.

The loader streams `(name, tensor)` pairs (from safetensors files, a transformers state dict or a
seeded generator) through one function, so every source is mapped, merged and checked the same
way. Each tensor is copied into a parameter that already lives on the target device and dtype,
so a checkpoint never needs a second full copy in memory. Every parameter must be filled
exactly once: a missing or unexpected tensor is an error, not a silently random weight.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tandem.engine.model.llama import LlamaForCausalLM

# HF projection name -> (our merged module, shard name)
_MERGED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# Buffers some checkpoints carry; ours are computed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shard_ranges(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    """Row ranges of each shard inside its merged weight (the output dim is the first)."""
    config = model.config
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
    }


def _target(name: str, ranges: dict[str, tuple[int, int]]) -> tuple[str, tuple[int, int] | None, str]:
    """HF name -> (our parameter name, row range or None for the whole tensor, shard key)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _MERGED:
        merged, shard = _MERGED[parts[-2]]
        ours = ".".join(parts[:-2] + [merged, parts[-1]])
        return ours, ranges[shard], f"{ours}:{shard}"
    return name, None, name


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of `model` from HF-named tensors; raise on anything missing or unknown."""
    params = dict(model.named_parameters())
    ranges = _shard_ranges(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied checkpoints sometimes also store the (identical) head
        ours, rows, key = _target(name, ranges)
        if ours not in params:
            unexpected.append(name)
            continue
        dest = params[ours] if rows is None else params[ours][rows[0] : rows[1]]
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(key)
    _check_complete(params, loaded, unexpected)


def _expected_keys(params: dict[str, torch.nn.Parameter]) -> set[str]:
    keys = set()
    for name in params:
        module = name.split(".")[-2]
        if module == "qkv_proj":
            keys.update(f"{name}:{s}" for s in ("q", "k", "v"))
        elif module == "gate_up_proj":
            keys.update(f"{name}:{s}" for s in ("gate", "up"))
        else:
            keys.add(name)
    return keys


def _check_complete(params: dict[str, torch.nn.Parameter], loaded: set[str], unexpected: list[str]) -> None:
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not use: {', '.join(unexpected[:8])}")
    missing = sorted(_expected_keys(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}")
