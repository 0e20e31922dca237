"""The Triton paged attention's kernels, run on the CPU by Triton's interpreter against the
reference path (tests/engine/interpreted_triton_attention.py): in a process of its own, since
the interpreter is chosen when Triton is first imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")


def test_triton_paged_attention_matches_the_reference_on_every_kind_of_step():
    script = Path(__file__).with_name("interpreted_triton_attention.py")
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 14, result.stdout


def test_a_step_splits_its_contexts_only_while_its_programs_are_too_few_and_its_partials_small():
    from tandem.engine.attention.triton_paged import MAX_PARTIAL_ROWS, num_context_splits

    assert num_context_splits(32, 80) == 16  # 16 decodes and a short prompt, 2 KV heads: split as far as allowed
    assert num_context_splits(1000, 300) == 4  # 4,096 programs at most: 4 splits of 1,000
    assert num_context_splits(5000, 300) == 1  # a step that fills the GPU alone
    assert num_context_splits(32, MAX_PARTIAL_ROWS // 2) == 2  # partials of 2 x the tokens at most
    assert num_context_splits(32, MAX_PARTIAL_ROWS * 2) == 1
