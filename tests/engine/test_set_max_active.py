"""Changing max_active on a built engine (the sweep reuses one engine across max_active values)."""

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams


def test_set_max_active_limits_running_requests_and_rejects_more_than_built_for():
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", max_active=4))
    engine.set_max_active(1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * 8, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.get_stats().num_running)
    assert peak == 1
    engine.set_max_active(4)
    assert engine.scheduler.config.max_active == engine.config.max_active == 4
    with pytest.raises(ValueError, match="built for 4"):
        engine.set_max_active(5)
    with pytest.raises(ValueError, match="max_active"):
        engine.set_max_active(0)
