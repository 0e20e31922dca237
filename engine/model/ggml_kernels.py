"""ggml's CPU dot products as Tandem's quantized linears: the kernels llama.cpp itself runs.

PyTorch's weight-only int4/int8 CPU kernels dequantize each weight to float and multiply it by
float activations. llama.cpp instead quantizes the activations once per row (to Q8_0 / Q8_1) and
multiplies 4- or 8-bit integers directly, which on a small model's decode is what sets the speed:
at one row ggml's Q4_1 dot products take about half the time of `_weight_int4pack_mm_for_cpu`
on an AVX2 CPU (per-shape timings: docs/benchmarks/cpu-vs-llamacpp-2core.md, "llama.cpp's own
kernels in Tandem"). At four rows the two are even (each ggml dot product is one row against one
row), so the engine keeps PyTorch's kernels unless asked (`EngineConfig.cpu_kernels = "ggml"`).

With `cpu_kernels="ggml"` a GGUF model's Q4_0 / Q4_1 / Q8_0 tensors are used as they are, byte
for byte (q and k rows reordered back to HF's RoPE layout, which moves whole rows of blocks);
other tensors, and other sources, are quantized by ggml's own `ggml_quantize_chunk`. `int4` means
Q4_1 and `int8` Q8_0; the output projection is Q8_0 (or the GGUF's own type), as llama.cpp runs
it. The rest of the model runs in float32: ggml's kernels take float32 rows.

libggml is built when Tandem is installed, or by `python -m tandem.engine.model.ggml_kernels build`
(engine/model/ggml_build.py), never while an engine starts. What an engine may build at start is
the small op library against the torch in use: `ggml_linear.cpp`, which registers
`torch.ops.tandem_ggml.linear` (a dispatcher op, so compiled graphs call it like any aten op), and
`ggml_decode.cpp` (engine/model/ggml_decode.py), compiled once per torch version beside libggml,
in under a minute where a compiler is present. `unavailable()` says whether the ops can be had
without building ggml, and why not, which is what the default kernels (`"auto"`) ask.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tandem.engine.model import ggml_build
from tandem.engine.model.file_lock import file_lock
from tandem.engine.model.quant import gguf_projection_shards, replace_linears

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml_type values (the same numbers as GGUF's tensor types)
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}  # weights per block, bytes per block
FOR_QUANTIZATION = {"int4": Q4_1, "int8": Q8_0}
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("ggml_linear.cpp", "ggml_decode.cpp"))


# -- building and loading ----------------------------------------------------------------------
def _op_library() -> Path:
    """The op library for this torch and these sources, beside the libggml it links."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in _SOURCES)).hexdigest()[:10]
    return ggml_build.ggml_dir() / f"op-torch{torch.__version__.split('+')[0]}-{digest}" / "tandem_ggml.so"


def unavailable() -> str | None:
    """None when the ops can be loaded now (the op library is built, or libggml is and a compiler can
    build the op library in this process); else why not, in words a user can act on."""
    if _op_library().is_file():
        return None
    if not ggml_build.is_built():
        at_install = ggml_build.install_note()
        why = f"building it at install failed ({at_install})" if at_install else "it was not built at install"
        return f"ggml is not built on this machine: {why}; run `python -m tandem.engine.model.ggml_kernels build`"
    missing = _missing_op_tools()
    if missing:
        return f"the ggml op library for torch {torch.__version__} is not built and {' and '.join(missing)} is not on PATH"
    return None


def op_library_pending() -> bool:
    """Whether loading the ops will first build the op library (libggml is built, the op library
    for this torch is not): the slow part of a first start, worth a line in the log."""
    return not _op_library().is_file() and ggml_build.is_built()


def _missing_op_tools() -> list[str]:
    """The op library's build tools not found: the C++ compiler, and ninja, which torch's
    extension builder runs (a dependency of Tandem's, in the environment's scripts folder)."""
    compiler = os.environ.get("CXX", "c++")
    return [tool for tool, found in ((compiler, shutil.which(compiler)), ("ninja", _ninja())) if not found]


def _ninja() -> str | None:
    return shutil.which("ninja") or shutil.which("ninja", path=sysconfig.get_path("scripts"))


def auto_excluded(device_type: str, dtype: str, cpu_compile: bool, pack_cpu_weights: bool = True) -> str | None:
    """Why `cpu_kernels="auto"` runs eager for an engine of these settings whatever the machine,
    or None where ggml's graph is its choice once ggml is built. Pure: the engine and the
    start-up log (cluster/launcher.py) decide alike."""
    if device_type != "cpu":
        return f"device {device_type}"
    if dtype not in ("auto", "float32"):
        return f"eager: ggml's graph runs {dtype} only when asked (cpu_kernels ggml-graph)"
    if cpu_compile:
        return "eager: cpu_compile decodes through compiled graphs"
    if not pack_cpu_weights:
        return "eager: pack_cpu_weights is off"
    return None


def auto_kernels(config: EngineConfig) -> tuple[str, str]:
    """What `cpu_kernels="auto"` runs for `config` on this machine, and why, in words for the
    start-up log: ("ggml-graph", ...) for a cpu engine with float32 weights where ggml is built,
    else ("torch", why not). Other choices are returned as they are."""
    if config.cpu_kernels != "auto":
        return config.cpu_kernels, "as configured"
    excluded = auto_excluded(config.device_type, config.dtype, config.cpu_compile, config.pack_cpu_weights)
    if excluded:
        return "torch", excluded if config.device_type == "cpu" else f"device {config.device}"
    reason = unavailable()
    if reason:
        return "torch", f"eager: {reason}"
    try:
        load()  # builds the op library on a first start with this torch (once, about 35 s of CPU)
    except Exception as exc:  # a failed build must not fail the engine: it runs eager and says why
        return "torch", f"eager: the ggml op library could not be built ({type(exc).__name__}: {str(exc)[:300]})"
    return "ggml-graph", "ggml graph for decode, eager for prefill"


def build() -> Path:
    """Build ggml (fetching its sources) and the op library where missing; returns the op library's
    path. The explicit way to get ggml's kernels (`main`, tests). Under a file lock: several
    processes starting at once build it once."""
    library = _op_library()
    if library.is_file():
        return library
    ggml_build.ggml_dir().mkdir(parents=True, exist_ok=True)
    with file_lock(ggml_build.ggml_dir() / ".build.lock"):
        if not ggml_build.is_built():
            logger.info("building ggml's CPU kernels (about a minute, once)")
            ggml_build.build_ggml()
        if not library.is_file():  # another process may have built it while this one waited
            _build_op_library(library)
    return library


def _build_op_library(library: Path) -> None:
    from torch.utils import cpp_extension

    missing = _missing_op_tools()
    if missing:
        raise RuntimeError(f"building the ggml op library needs {' and '.join(missing)} on PATH")
    ninja_dir = os.path.dirname(_ninja())
    if shutil.which("ninja") is None:  # the environment's own, not on PATH when it is not activated
        os.environ["PATH"] = f"{ninja_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    libs = ggml_build.libs_dir()
    op_dir = library.parent
    op_dir.mkdir(parents=True, exist_ok=True)
    logger.info("building the ggml op library for torch %s (once per torch version)", torch.__version__)
    cpp_extension.load(name="tandem_ggml", sources=[str(source) for source in _SOURCES],
                       extra_include_paths=[str(ggml_build.include_dir())],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],  # like ggml: this machine's build
                       extra_ldflags=[f"-L{libs}", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{libs}", "-fopenmp"],
                       build_directory=str(op_dir), is_python_module=False, verbose=False)


@functools.cache
def load() -> bool:
    """Load the ops, building the op library first where it is missing (libggml must be built:
    at install, or by `build`); raises RuntimeError saying how to get ggml otherwise."""
    library = _op_library()
    if not library.is_file():
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        build()  # libggml is built, so this builds the op library alone, under build's lock
    if not hasattr(torch.ops.tandem_ggml, "linear"):  # a build in this process has loaded it already
        torch.ops.load_library(str(library))

    @torch.library.register_fake("tandem_ggml::linear")
    def _linear_shape(x, weight, type, out_features, residual=None):
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

    return True


# -- the linear layer --------------------------------------------------------------------------
def row_bytes(ggml_type: int, in_features: int) -> int:
    per_block, block_bytes = BLOCK[ggml_type]
    if in_features % per_block:
        raise ValueError(f"{TYPE_NAMES[ggml_type]} needs in_features divisible by {per_block}, got {in_features}")
    return in_features // per_block * block_bytes


class GGMLLinear(nn.Module):
    """`F.linear` with the weight as rows of ggml blocks ([out_features, row bytes] uint8)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.shape[1] != row_bytes(ggml_type, in_features):
            raise ValueError(f"{TYPE_NAMES[ggml_type]} blocks for {in_features} inputs must be uint8 "
                             f"[rows, {row_bytes(ggml_type, in_features)}]; got {blocks.dtype} {list(blocks.shape)}")
        self.out_features, self.in_features, self.ggml_type = blocks.shape[0], in_features, ggml_type
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, ggml_type: int) -> GGMLLinear:
        """Quantized by ggml itself (`ggml_quantize_chunk`), as llama-quantize does."""
        blocks = torch.ops.tandem_ggml.quantize(weight.detach().float(), ggml_type)
        return cls(blocks, ggml_type, weight.shape[1], bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.tandem_ggml.linear(x, self.blocks, self.ggml_type, self.out_features, residual)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] as the kernel sees it (through the kernel itself, against float32 rows)."""
        eye = torch.eye(self.in_features)
        return torch.ops.tandem_ggml.linear(eye, self.blocks, self.ggml_type, self.out_features, None).t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={TYPE_NAMES[self.ggml_type]}"


# -- a whole model -----------------------------------------------------------------------------
_USABLE = {"int4": (Q4_0, Q4_1), "int8": (Q8_0,)}  # GGUF block types a quantization keeps as they are


def gguf_blocks(gguf_path: Path, config, quantization: str) -> tuple[dict[str, tuple[torch.Tensor, int]],
                                                                      tuple[torch.Tensor, int] | None]:
    """The GGUF's blocks usable as they are: {module name: (blocks, type)} for merged projections
    whose shards share one usable type, and the output projection's (or the tied embedding's)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    head = None
    by_name = {t.name: t for t in reader.tensors}
    for name in ("output.weight", "token_embd.weight"):
        tensor = by_name.get(name)
        if tensor is not None:
            kind = int(tensor.tensor_type)
            head = (torch.from_numpy(np.array(tensor.data)), kind) if kind in (Q4_0, Q4_1, Q8_0) else None
            break
    merged = {}
    for key, shards in gguf_projection_shards(reader, config, _USABLE[quantization]).items():
        kinds = {kind for _, kind in shards}
        if len(kinds) == 1:
            merged[key] = (torch.cat([blocks for blocks, _ in shards]), kinds.pop())
    return merged, head


def quantize_model(model: nn.Module, quantization: str, gguf_path: Path | None = None) -> int:
    """Replace every `nn.Linear` of a `LlamaForCausalLM` and its output projection with a
    `GGMLLinear`, in place; returns how many. GGUF blocks are kept where their type suits
    `quantization` (module docstring); the rest is quantized by ggml."""
    if quantization not in FOR_QUANTIZATION:
        raise ValueError(f"quantization must be one of {', '.join(FOR_QUANTIZATION)}; got {quantization!r}")
    load()
    target = FOR_QUANTIZATION[quantization]
    from_gguf, head = gguf_blocks(gguf_path, model.config, quantization) if gguf_path else ({}, None)

    def quantized(full_name: str, child: nn.Linear) -> GGMLLinear:
        if full_name in from_gguf:
            blocks, kind = from_gguf[full_name]
            return GGMLLinear(blocks, kind, child.in_features, child.bias)
        return GGMLLinear.from_float(child.weight, child.bias, target)

    count = replace_linears(model, quantized)
    hidden = model.output_weight().shape[1]
    if head is not None and head[0].shape[1] == row_bytes(head[1], hidden):
        model.logits_proj = GGMLLinear(head[0], head[1], hidden, None)
    else:
        model.logits_proj = GGMLLinear.from_float(model.output_weight(), None, Q8_0)
    return count + 1


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tandem.engine.model.ggml_kernels",
                                     description="Build ggml's CPU kernels (EngineConfig.cpu_kernels) now, "
                                                 "where installing did not (downloads llama-cpp-python's sdist "
                                                 "unless $TANDEM_GGML_SOURCE names a llama.cpp tree).")
    parser.add_argument("command", choices=("build", "where"), help="build: build now; where: print the build folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "where":
        print(ggml_build.ggml_dir())
        return
    print(build())
    load()
    print("ok: torch.ops.tandem_ggml.linear is available")


if __name__ == "__main__":
    main()
