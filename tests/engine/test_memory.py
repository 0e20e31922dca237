"""The GPU memory arithmetic (engine/memory.py): exact bytes from made-up device numbers."""

from __future__ import annotations

import pytest

from tandem.engine.memory import (GIB, MemoryPlanError, StepShape, activation_bytes, default_max_active,
                                  kv_cache_bytes)
from tandem.engine.profiler import profiled_batch_sizes

# Qwen2.5-0.5B's shapes, bf16, an 8,192-token step and 256 sampled rows
QWEN_STEP = StepShape(hidden_size=896, intermediate_size=4864, q_size=896, kv_size=128, vocab_size=151936,
                      num_batched_tokens=8192, max_active=256, dtype_bytes=2)


def test_activation_estimate_counts_tokens_and_logits():
    per_token = 3 * 896 + 896 + 2 * 128 + 3 * 4864
    expected = 2 * (8192 * per_token * 2 + 3 * 256 * 151936 * 4)
    assert activation_bytes(QWEN_STEP) == expected
    assert 1 * GIB < expected < 2 * GIB


def test_kv_takes_the_share_less_weights_activations_and_overhead():
    total, weights, acts = 140 * GIB, 1 * GIB, 2 * GIB
    got = kv_cache_bytes(total, free_bytes=139 * GIB, share=0.45, weight_bytes=weights, activations=acts)
    assert got == int(total * 0.45) - weights - acts - GIB


def test_two_engines_on_one_gpu_get_the_same_cache_whatever_their_start_order():
    total, weights, acts = 140 * GIB, 1 * GIB, 2 * GIB
    first = kv_cache_bytes(total, 139 * GIB, 0.45, weights, acts)
    free_after_first = 139 * GIB - first - acts - weights  # the second sees the first's cache taken
    second = kv_cache_bytes(total, free_after_first, 0.45, weights, acts)
    assert first == second


def test_a_share_eaten_by_the_weights_names_the_terms():
    with pytest.raises(MemoryPlanError, match=r"share of 0.05 of the device's 20.0 GiB is 1.0 GiB.*weights \(2.0 GiB\)"):
        kv_cache_bytes(20 * GIB, 20 * GIB, 0.05, 2 * GIB, GIB)


def test_a_share_the_device_has_not_free_is_an_error_when_planned():
    with pytest.raises(MemoryPlanError, match="only 10.0 GiB is free"):
        kv_cache_bytes(100 * GIB, 10 * GIB, 0.9, GIB, GIB)


def test_an_engine_made_on_its_own_takes_what_is_free():
    got = kv_cache_bytes(100 * GIB, 10 * GIB, 0.9, GIB, GIB, strict=False)
    assert got == 10 * GIB - GIB - GIB


def test_bad_share():
    with pytest.raises(MemoryPlanError, match="in \\(0, 1\\]"):
        kv_cache_bytes(GIB, GIB, 1.5, 0, 0)


@pytest.mark.parametrize("device, engines, expected", [
    ("cuda", 1, 256), ("cuda", 2, 128), ("cuda", 4, 64), ("mps", 1, 32), ("cpu", 1, 4), ("cpu", 3, 4)])
def test_default_max_active_by_device(device, engines, expected):
    assert default_max_active(device, engines) == expected


@pytest.mark.parametrize("max_active, sizes", [
    (1, [1]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (256, [1, 2, 4, 8, 16, 32, 64, 128, 256])])
def test_profiled_batch_sizes_are_powers_of_two_and_the_top(max_active, sizes):
    assert profiled_batch_sizes(max_active) == sizes
