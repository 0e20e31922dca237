"""How much of an accelerator's memory an engine's KV cache gets, and how many requests it runs.

An engine on a GPU owns a share of the device (`gpu_memory_share`, vLLM's
`--gpu-memory-utilization` for one engine; two engines on one GPU take half of it each). Inside
that share it needs its weights, the activations of its largest step and a fixed overhead (CUDA
graphs' pools, cuBLAS workspaces, the sampler's buffers); what is left is KV cache:

    kv bytes = total x share - weights - activations - overhead

and never more than is free on the device right now less the activations and overhead still to
come (another process, or another engine of this one, may hold the rest). A share that leaves
nothing is a start-up error that says which term ate it, not an allocator failure minutes later.

Shares are fractions of the device's *total* memory, not of what is free when an engine starts,
so engines that start side by side on one GPU each get what the plan gave them whatever the
order in which they load. This module is plain arithmetic (no torch): the engine passes in the
device's numbers, and tests pin the sizing exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
# The share of each GPU's memory Tandem's engines on it use together (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Beyond weights, activations and KV: CUDA graph pools, cuBLAS/Triton workspaces, the sampler's
# per-row buffers and allocator fragmentation.
OVERHEAD_BYTES = 1 * GIB
# Activations are estimated from the step's shapes (below) and doubled: transient copies
# (residual adds, the attention kernel's scratch, the allocator's rounding) are not modelled.
ACTIVATION_SAFETY = 2
# Concurrent requests a cuda engine runs by default when it has its GPU to itself; engines that
# share a GPU divide it. Below this the H200's decode steps are host-bound: the device idles.
CUDA_MAX_ACTIVE_PER_GPU = 256
MPS_MAX_ACTIVE = 32
CPU_MAX_ACTIVE = 4  # a CPU's decode step grows with its batch; small batches keep TTFT low


class MemoryPlanError(ValueError):
    """The device cannot hold what the engine was asked to put on it."""


@dataclass(frozen=True)
class StepShape:
    """What one engine step's activations depend on."""

    hidden_size: int
    intermediate_size: int
    q_size: int  # num_attention_heads x head_dim
    kv_size: int  # num_key_value_heads x head_dim
    vocab_size: int
    num_batched_tokens: int  # the largest step's tokens (max_num_batched_tokens)
    max_active: int  # rows that get logits in one step
    dtype_bytes: int


def default_max_active(device_type: str, engines_on_device: int = 1) -> int:
    """Requests an engine runs at once when not told: a GPU's batch is divided among the
    engines that share it; a CPU keeps the small batch its step time needs."""
    if device_type == "cuda":
        return max(1, CUDA_MAX_ACTIVE_PER_GPU // max(1, engines_on_device))
    if device_type == "mps":
        return max(1, MPS_MAX_ACTIVE // max(1, engines_on_device))
    return CPU_MAX_ACTIVE


def activation_bytes(shape: StepShape) -> int:
    """An upper estimate of the largest step's live activations: per token the residual stream
    and its normed copy, q/k/v, the attention output and the MLP's gate, up and product; per
    sampled row float32 logits, their probabilities and the sampler's working copy."""
    per_token = 3 * shape.hidden_size + shape.q_size + 2 * shape.kv_size + 3 * shape.intermediate_size
    tokens = shape.num_batched_tokens * per_token * shape.dtype_bytes
    logits = 3 * shape.max_active * shape.vocab_size * 4
    return ACTIVATION_SAFETY * (tokens + logits)


def kv_cache_bytes(total_bytes: int, free_bytes: int, share: float, weight_bytes: int, activations: int,
                   overhead_bytes: int = OVERHEAD_BYTES, strict: bool = True) -> int:
    """Bytes of KV cache for an engine that owns `share` of a device with `total_bytes`, measured
    after its weights are loaded (`free_bytes` is then what is still free on the device).

    `strict` (a share the cluster planned): less free memory than the share needs is an error.
    Otherwise (an engine made on its own, with the default share) it takes what is free, as a
    second engine in one process must."""
    if not 0 < share <= 1:
        raise MemoryPlanError(f"gpu memory share must be in (0, 1], got {share}")
    budget = int(total_bytes * share)
    by_share = budget - weight_bytes - activations - overhead_bytes
    if by_share <= 0:
        raise MemoryPlanError(
            f"a share of {share:.2f} of the device's {_gib(total_bytes)} is {_gib(budget)}, which "
            f"weights ({_gib(weight_bytes)}), activations ({_gib(activations)}) and overhead "
            f"({_gib(overhead_bytes)}) use up, leaving nothing for the KV cache: raise "
            "--gpu-memory-utilization or put fewer engines on this GPU")
    by_free = free_bytes - activations - overhead_bytes
    if not strict and by_free > 0:
        return min(by_share, by_free)
    if by_free < by_share:
        raise MemoryPlanError(
            f"a share of {share:.2f} of the device's {_gib(total_bytes)} leaves {_gib(by_share)} for the KV "
            f"cache, but only {_gib(free_bytes)} is free (other processes hold the rest) and activations "
            f"and overhead need {_gib(activations + overhead_bytes)} of it: lower --gpu-memory-utilization "
            "or free the device")
    return by_share


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"
