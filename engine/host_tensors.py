"""Building small integer tensors from Python lists on the host, cheaply.

Every engine step turns lists of ints (token ids, positions, slots, block tables) into tensors.
`torch.tensor` inspects each Python object, which at batch 48 costs ~0.1 ms a step for the block
table alone; `array.array` packs the ints in C and `torch.frombuffer` wraps them without a copy.
"""

from __future__ import annotations

import array

import torch

_TYPECODES = {torch.int32: "i", torch.int64: "q"}


def int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on the host, several times cheaper for long lists."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)
