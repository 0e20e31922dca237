"""SGLang-style new_token_ratio: linear decay per decode step to a floor, reset when idle."""

import pytest

from tandem.routing import NewTokenRatio, NewTokenRatioConfig


def test_off_by_default_is_one():
    ratio = NewTokenRatio(None)
    ratio.on_decode_steps(1000)
    assert ratio.ratio == 1.0


def test_sglang_defaults_decay_over_600_steps():
    ratio = NewTokenRatio(NewTokenRatioConfig())
    assert ratio.ratio == 0.7
    ratio.on_decode_steps(300)
    assert ratio.ratio == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    ratio.on_decode_steps(300)
    assert ratio.ratio == pytest.approx(0.098)
    ratio.on_decode_steps(50)
    assert ratio.ratio == 0.098
    ratio.reset()
    assert ratio.ratio == 0.7


def test_bad_config():
    with pytest.raises(ValueError, match="min_ratio"):
        NewTokenRatioConfig(init_ratio=0.5, min_ratio=0.6)
    with pytest.raises(ValueError, match="decay_steps"):
        NewTokenRatioConfig(decay_steps=0)
