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
    assert result.stdout.count("ok ") == 8, result.stdout
