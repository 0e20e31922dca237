"""`tandem generate` end to end, as a user runs it."""

import json
import subprocess
import sys

import pytest


def tandem(*args, check=True):
    return subprocess.run([sys.executable, "-m", "tandem.cluster.cli", *args], capture_output=True,
                          text=True, timeout=300, check=check)


@pytest.mark.slow
def test_generate_json_on_default_model():
    out = tandem("generate", "The capital of France is", "--max-tokens", "8", "--json")
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]
    assert len(result["token_ids"]) == 8
    assert result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "cached_tokens": 0}


@pytest.mark.slow
def test_generate_chat_stops_at_eos():
    out = tandem("generate", "What is the capital of France?", "--chat", "--max-tokens", "64", "--json")
    result = json.loads(out.stdout)
    assert "Paris" in result["text"] and result["finish_reason"] == "stop"


def test_generate_bad_input_is_a_clear_error():
    out = tandem("generate", "hi", "--model", "tiny-llama-random", "--max-tokens", "0", check=False)
    assert out.returncode == 2 and "max_tokens" in out.stderr
    out = tandem("generate", "hi", "--model", "nope-model", check=False)
    assert out.returncode == 2 and "nope-model" in out.stderr


def test_help_explains():
    out = tandem("--help")
    assert "generate" in out.stdout
    out = tandem("generate", "--help")
    assert "--max-tokens" in out.stdout and "--chat" in out.stdout
