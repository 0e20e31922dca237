"""`measure_rates` on the tiny model, the profile cache, and the rates file routing loads."""

from __future__ import annotations

import pytest

from tandem.cluster.profile import load_cache, profile_key, store_in_cache, write_rates_file
from tandem.engine.profiler import measure_rates
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.routing import load_rate_profiles


@pytest.fixture(scope="module")
def rates():
    engine = LLMEngine(EngineConfig(model="tiny-llama-random", max_active=3, num_threads=1))
    result = measure_rates(engine, max_active=3, prompt_len=64, decode_tokens=4)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    return result


def test_rates_have_every_batch_size(rates):
    assert rates["prefill_tok_s"] > 0 and rates["decode_tok_s"] > 0
    assert sorted(rates["decode_tok_s_by_batch"]) == [1, 2, 3]
    assert rates["decode_tok_s"] == rates["decode_tok_s_by_batch"][1]
    assert rates["spread"]["repeats"] == 3 and rates["spread"]["prefill_tok_s"] >= 0


def test_rates_file_loads_in_the_router(tmp_path, rates):
    path = tmp_path / "rates.json"
    write_rates_file(path, {"cpu0": rates})
    profile = load_rate_profiles(path)["cpu0"]
    assert profile.is_batch_aware and profile.decode_rate(3) == pytest.approx(rates["decode_tok_s_by_batch"][3])


def test_cache_round_trip(tmp_path, rates):
    path = tmp_path / "cache" / "rates-cache.json"
    key = profile_key("tiny-llama-random", "cpu", "float32", 1, 3)
    store_in_cache(path, key, rates)
    store_in_cache(path, "other|cpu|float32|threads=2", rates)
    cache = load_cache(path)
    assert set(cache) == {key, "other|cpu|float32|threads=2"}
    assert cache[key]["prefill_tok_s"] == rates["prefill_tok_s"]
    assert load_cache(tmp_path / "missing.json") == {}


def test_a_profiled_engine_with_a_host_tier_writes_a_sim_profile_that_loads_with_its_reload_rate():
    """`tandem profile --sim-profiles` of a cuda engine (whose host KV tier is on by default):
    the sim profile keeps the tier's reload rate, under the name the sim profile reads."""
    from tandem.cluster.profile_cli import sim_profile_fields
    from tandem.routing.step_time import sim_profile_from_dict

    entry = {"prefill_tok_s": 226_000.0, "decode_tok_s": 800.0, "decode_tok_s_by_batch": {1: 800.0, 16: 12_000.0},
             "reload_tok_s": 1_132_228.6, "spread": {"repeats": 3},
             "sim": {"description": "test", "device_kind": "cuda", "decode_s_per_context_token": 2.9e-9,
                     "prefill_tok_s_by_tokens": {512: 226_000.0, 8192: 519_000.0}, "max_active": 256,
                     "num_kv_tokens": 8_388_608, "max_num_batched_tokens": 8192}}
    profile = sim_profile_from_dict(sim_profile_fields(entry), "test")
    assert profile.host_reload_tok_s == 1_132_228.6
    assert profile.step_time().reload_s(1_132_228.6) == 1.0
    without_tier = sim_profile_from_dict(sim_profile_fields({k: v for k, v in entry.items() if k != "reload_tok_s"}))
    assert without_tier.host_reload_tok_s is None
