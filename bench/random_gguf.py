"""`tandem bench random-gguf`: a float32 GGUF with random weights in a random preset's shape, for
llama.cpp's rows of `tandem bench cpu-vs-llamacpp` on a machine without the SmolLM2 package.

Decode speed depends on the shapes, not on the values, so Tandem's `qwen2.5-0.5b-random` preset
and this file (same layers, heads, widths and vocabulary; tied output projection; q/k/v biases
for qwen2) time the same work; they are not the same weights. The tokenizer is a stand-in:
GPT-2's 256 byte tokens, one merge, then `<r{i}>` up to the vocabulary size; the benchmark sends
token ids, so nothing is tokenized. `llama-quantize` makes the Q8_0 / Q4_1 files from it.
"""

from __future__ import annotations

import argparse


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes))]


def write(preset_name: str, path: str, seed: int = 0) -> None:
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType, TokenType

    from tandem.engine.model.presets import get_preset

    preset = get_preset(preset_name)
    cfg = preset.hf_kwargs
    hidden, layers, ffn = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)

    def weight(*shape: int):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(preset.std)

    writer = GGUFWriter(path, preset.architecture)
    writer.add_name(preset.name)
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_file_type(LlamaFileType.ALL_F32)
    tokens = byte_tokens() + ["ĠĠ"] + [f"<r{i}>" for i in range(257, vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.NORMAL] * vocab)
    writer.add_token_merges(["Ġ Ġ"])  # llama.cpp wants at least one merge for a BPE vocabulary
    writer.add_eos_token_id(vocab - 1)
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    biases = preset.architecture == "qwen2"
    for i in range(layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            writer.add_tensor(f"{blk}.{name}.weight", weight(rows, hidden))
            if biases:
                writer.add_tensor(f"{blk}.{name}.bias", weight(rows))
        writer.add_tensor(f"{blk}.attn_output.weight", weight(hidden, heads * head_dim))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", help="a random preset, e.g. qwen2.5-0.5b-random")
    parser.add_argument("path", help="the GGUF to write (name it *.F32.gguf for cpu-vs-llamacpp's --llama-gguf)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    write(args.preset, args.path, args.seed)
    print(args.path)
    return 0
