"""Attention backends behind one interface.

`TorchRefAttention` is the reference path: plain PyTorch (gather from the block table, then
SDPA), runs on cpu, cuda and mps. Fast paths (CUDA graphs, paged decode kernels) implement
the same `forward` and are tested against it.
"""

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.torch_ref import TorchRefAttention

__all__ = ["AttentionMetadata", "TorchRefAttention"]
