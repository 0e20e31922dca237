"""Smoke test of the CPU step breakdown: both modes run on a tiny model and write their JSON.

No timing asserts; only the report's shape, and that the weight bytes it divides by do not
depend on whether the weights are packed.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.cpu_step import bytes_read_per_step
from tandem.cluster.cli import main
from tandem.engine.model.cpu_linear import available, pack_model
from tandem.engine.model.loader import load_model


def test_breakdown_writes_its_parts(tmp_path):
    main(["bench", "cpu-step", "--model", "tiny-qwen2-random", "--threads", "1", "--reps", "2", "--dtype", "float32",
          "--out", str(tmp_path), "--tag", "_t"])
    report = json.loads((tmp_path / "cpu_step_float32_t1_b4_t.json").read_text())
    for key in ("step_ms", "forward_ms", "linears_ms", "logits_ms", "attention_ms", "read_floor_ms"):
        assert report[key] > 0, key
    assert report["prefill"]["prompt_tokens"] == 516
    assert {row["kind"] for row in report["linears_by_kind"]} == {
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "logits"}
    assert report["op_profile"] and all(row["calls"] >= 1 for row in report["op_profile"])


def test_throughput_mode(tmp_path):
    main(["bench", "cpu-step", "--model", "tiny-qwen2-random", "--threads", "1", "--dtype", "float32", "--requests", "2",
          "--max-tokens", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "cpu_step_float32_t1_b4_throughput.json").read_text())
    assert report["throughput"]["generated"] == 6 and report["throughput"]["tok_s"] > 0


def test_bytes_read_do_not_depend_on_packing():
    if not available(torch.float32):
        pytest.skip("this torch build has no packed float32 linear")
    plain = load_model("tiny-qwen2-random", torch.device("cpu"), torch.float32).model
    packed = load_model("tiny-qwen2-random", torch.device("cpu"), torch.float32).model
    pack_model(packed)
    # the packed output projection is a copy of the embedding, which a step then reads only a few rows of
    assert bytes_read_per_step(packed) == bytes_read_per_step(plain)
