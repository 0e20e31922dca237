"""Llama and Qwen2 decoders as our own PyTorch modules, over a flat varlen batch.

Both families are the same network (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP); Qwen2
adds a bias on the q/k/v projections. We write it ourselves rather than call transformers so
that the forward takes the engine's layout: every scheduled token of every request in one flat
`[T]` batch with its own position, K/V written into a paged cache, and attention delegated to
a swappable backend (the reference torch path, or a fast path with the same interface).

q/k/v and gate/up are each one merged matmul (one weight read instead of three or two); the
loader in `weights.py` merges the HF checkpoint's separate matrices. The arithmetic follows
transformers' order (norms in float32, RoPE tables cast to the model dtype) so logits match HF.

On the CPU this is the production path, where every eager op costs a dispatch (and, past 32k
elements, a thread-pool fork/join), so a layer is kept to few ops: q and k are rotated
in one pass, and the attention backend does the step's per-batch bookkeeping once per forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.torch_ref import TorchRefAttention
from tandem.engine.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype == torch.float32:  # skip two no-op casts: each is still a dispatch
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to the model's context, computed once; a step only gathers rows."""

    def __init__(self, head_dim: int, rope_theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.register_buffer("cos_cached", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin_cached", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        """(Re)compute the tables in float32 on their device; needed after `to_empty`."""
        device = self.cos_cached.device
        if device.type == "meta":
            return
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        positions = torch.arange(self.cos_cached.shape[0], dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached.copy_(emb.cos())
        self.sin_cached.copy_(emb.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos_cached[positions].unsqueeze(1), self.sin_cached[positions].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.attn = attn_backend

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads rotate in one pass (their columns are adjacent): five ops instead of ten.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def adopt_layer_parts(module: nn.Module, layer: nn.Module) -> None:
    """Give `module` a reference `DecoderLayer`'s norms, projections, attention backend and head
    geometry (shared with the layer, not copied): what every fused layer runs on."""
    attn, mlp = layer.self_attn, layer.mlp
    module.input_layernorm = layer.input_layernorm
    module.post_attention_layernorm = layer.post_attention_layernorm
    module.qkv_proj, module.o_proj = attn.qkv_proj, attn.o_proj
    module.gate_up_proj, module.down_proj = mlp.gate_up_proj, mlp.down_proj
    module.attn = attn.attn
    module.num_heads, module.num_kv_heads, module.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    module.q_size, module.kv_size, module.scale = attn.q_size, attn.kv_size, attn.scale


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attn_backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """The Llama/Qwen2 causal LM; `forward` returns final hidden states, `compute_logits` projects them."""

    def __init__(self, config: ModelConfig, attn_backend=None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend if attn_backend is not None else TorchRefAttention())
        # Tied models read the embedding matrix directly, so the tie survives `to_empty` and `to`.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_proj: nn.Module | None = None  # a packed output projection (engine/model/cpu_linear.py)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T]; kv_caches[layer] [2, NB, BS, Hkv, D] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the embedding matrix when tied, else the output head's."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; call it only on the rows that get sampled."""
        if self.logits_proj is not None:
            return self.logits_proj(hidden_states).float()
        return F.linear(hidden_states, self.output_weight()).float()
