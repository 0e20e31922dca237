"""One engine's settings: which model, on which device, and how big its batch and cache are.

Defaults size themselves from the device, so `LLMEngine(EngineConfig())` works on any machine
and runs fast there: a GPU engine runs hundreds of requests at once with a KV cache that fills
its share of the device's memory (engine/memory.py), a CPU engine a few with a 1 GiB cache. They are stated here once: the cluster's config model (cluster/config.py) and the
command lines refer to these names. torch is imported only where a dtype is resolved, so the
cluster's config and `tandem serve --help` do not pay for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.engine.kv_cache.manager import DEFAULT_OFFLOAD_MIN_HITS
from tandem.engine.memory import default_max_active

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MAX_ACTIVE = 4  # the design's experiment, and a CPU backend's default (engine/memory.py)
DEFAULT_BLOCK_SIZE = 16
DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
# Weight-only quantized dtypes (cpu): int8 / int4 weights; bfloat16 activations on PyTorch's kernels
# (engine/model/quant.py), float32 on ggml's (engine/model/ggml_kernels.py).
QUANTIZED_DTYPES = ("int8", "int4")
# Whose kernels run a cpu engine: PyTorch's, or ggml's (llama.cpp's) for the quantized linears;
# "ggml-graph" also runs each decode step as one ggml graph (engine/model/ggml_decode.py), for float32
# weights too. "auto" (the default) is ggml-graph for float32 weights when ggml is built on this
# machine, else torch: decode steps through ggml's graph, prefill and mixed steps through PyTorch's
# packed float32 linears, the fastest path of each at the same precision (ggml_kernels.auto_kernels).
CPU_KERNELS = ("auto", "torch", "ggml", "ggml-graph")
GGML_KERNELS = ("ggml", "ggml-graph")


def default_max_num_batched_tokens(device_type: str) -> int:
    """Tokens per engine step when the config leaves it open. A CPU's step time grows with its
    tokens, so small steps keep decodes moving; an H200 runs a 516-token prefill in ~10 ms of
    launch-bound time, so big steps pay (docs/benchmarks/fast-path-h200.md compares step sizes)."""
    return {"cpu": 512, "cuda": 8192}.get(device_type, 2048)


def default_async_scheduling(device_type: str) -> bool:
    """Whether an engine plans step N+1 while step N runs when the config leaves it open: where a
    step runs on a device beside the host (cuda, and the sim device that emulates one), the
    host's scheduling and output processing then overlap the step; on a CPU they would compete
    with it for the same cores."""
    return device_type in ("cuda", "sim")


def check_cpu_kernels(kernels: str, dtype: str, cpu_compile: bool) -> None:
    """What each choice of CPU kernels can run (asked by the engine's config and, before Ray starts
    anything, by the cluster's); raises ValueError for a pair that cannot work."""
    if kernels == "ggml" and dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"cpu_kernels ggml runs quantized weights: use dtype {' or '.join(QUANTIZED_DTYPES)}, "
                         f"not {dtype}")
    if kernels == "ggml-graph" and dtype not in (*QUANTIZED_DTYPES, "float32", "auto"):
        raise ValueError(f"cpu_kernels ggml-graph runs int8, int4 or float32 weights: use one of those dtypes, "
                         f"not {dtype}")
    if kernels == "ggml-graph" and cpu_compile:
        raise ValueError("cpu_kernels ggml-graph runs decode steps as ggml graphs, which cpu_compile would replace: "
                         "use one or the other")


def cache_root() -> Path:
    """Tandem's one cache directory: converted models (`models/`) and measured rates
    (`rates-cache.json`). `$TANDEM_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tandem`, else
    `~/.cache/tandem`."""
    explicit = os.environ.get("TANDEM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tandem"


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str = "cpu"  # cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 elsewhere; int8 | int4: quantized weights (cpu)
    max_active: int | None = None  # None: by device (engine/memory.py's default_max_active)
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb, else the memory share
    kv_cache_memory_gb: float | None = None  # None: cuda from gpu_memory_share, else 1 GiB
    # A second KV tier in host memory (pinned on cuda) that keeps the prefix-cache blocks the
    # device evicts, to reload instead of recompute (engine/kv_cache/host_tier.py). Its size in
    # blocks, else in GiB (converted with the device cache's bytes per block); 0 and 0: no tier.
    kv_host_blocks: int = 0
    kv_host_memory_gb: float = 0.0
    # Offload only blocks hit at least this often (engine/kv_cache/manager.py); 0: every evicted block.
    kv_host_offload_min_hits: int = DEFAULT_OFFLOAD_MIN_HITS
    # cuda: the share of the device's total memory this engine may use (weights, activations, KV);
    # None: engine/memory.py's default, clamped to what is free (an engine made on its own). The
    # cluster sets it for each engine it plans, and then a share the device cannot give is an error.
    gpu_memory_share: float | None = None
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    max_num_batched_tokens: int | None = None  # None: 512 on cpu, 8192 on cuda, 2048 elsewhere
    num_threads: int | None = None  # torch threads for a cpu engine; None leaves torch's default
    seed: int = 0
    attention_backend: str = "auto"  # auto (triton on cuda, else torch) | torch (the reference path) | triton
    enforce_eager: bool = False  # fast path without CUDA graphs (debugging, profiling)
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: on for cuda and sim
    pack_cpu_weights: bool = True  # cpu: linears in oneDNN's packed layout where torch supports it
    cpu_compile: bool = False  # cpu: decode steps through torch.compile'd graphs (engine/model/cpu_compile.py)
    # A waiting request older than this is admitted as if it were of the most urgent class, so
    # urgent traffic delays batch work by at most about this long (engine/scheduler.py).
    max_priority_wait_s: float = 5.0
    cpu_kernels: str = "auto"  # auto | torch (PyTorch's) | ggml | ggml-graph (llama.cpp's; CPU_KERNELS above)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.dtype in QUANTIZED_DTYPES and self.device_type != "cpu":
            raise ValueError(f"dtype {self.dtype} (weight-only quantization) runs on the cpu only, not {self.device!r}")
        if self.cpu_compile and (self.device_type != "cpu" or not self.pack_cpu_weights):
            raise ValueError("cpu_compile is for cpu engines with pack_cpu_weights (it compiles the few-op layers); "
                             f"got device {self.device!r}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}; got {self.cpu_kernels!r}")
        check_cpu_kernels(self.cpu_kernels, self.dtype, self.cpu_compile)
        if self.max_active is None:
            self.max_active = default_max_active(self.device_type)
        if self.gpu_memory_share is not None and not 0 < self.gpu_memory_share <= 1:
            raise ValueError(f"gpu_memory_share must be in (0, 1], got {self.gpu_memory_share}")
        if self.max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {self.max_active}")
        if self.kv_host_blocks < 0:
            raise ValueError(f"kv_host_blocks must be >= 0, got {self.kv_host_blocks}")
        if self.kv_host_offload_min_hits < 0:
            raise ValueError(f"kv_host_offload_min_hits must be >= 0, got {self.kv_host_offload_min_hits}")
        if not self.kv_host_memory_gb >= 0:
            raise ValueError(f"kv_host_memory_gb must be >= 0, got {self.kv_host_memory_gb}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.max_priority_wait_s >= 0:
            raise ValueError(f"max_priority_wait_s must be >= 0 seconds, got {self.max_priority_wait_s}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton; got {self.attention_backend!r}")

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device_type == "cuda" else torch.float32
        if self.dtype in QUANTIZED_DTYPES:
            # The activations: PyTorch's int8/int4 kernels' float32 paths are scalar; ggml's take float32.
            return torch.float32 if self.cpu_kernels in GGML_KERNELS else torch.bfloat16
        return getattr(torch, self.dtype)

    @property
    def weight_quantization(self) -> str | None:
        """int8 | int4 when the weights are quantized, else None."""
        return self.dtype if self.dtype in QUANTIZED_DTYPES else None

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return default_max_num_batched_tokens(self.device_type)

    @property
    def kv_cache_from_share(self) -> bool:
        """True when the KV cache is sized from the GPU's memory share, not a fixed size."""
        return self.device_type == "cuda" and self.kv_cache_memory_gb is None and self.num_kv_blocks is None

    def resolved_kv_host_blocks(self, bytes_per_block: int) -> int:
        """Blocks of the host KV tier (0: none): `kv_host_blocks`, else `kv_host_memory_gb` worth."""
        if self.kv_host_blocks:
            return self.kv_host_blocks
        return int(self.kv_host_memory_gb * (1 << 30)) // bytes_per_block

    @property
    def resolved_kv_cache_bytes(self) -> int:
        """The fixed KV size (`kv_cache_memory_gb`, else 1 GiB); a cuda engine without one sizes
        its cache from its memory share instead (LLMEngine._num_kv_blocks)."""
        return int((self.kv_cache_memory_gb or 1.0) * (1 << 30))
