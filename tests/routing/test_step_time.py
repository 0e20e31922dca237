"""The step-time model every emulated engine uses, and the sim profiles it is read from."""

import json

import pytest

from tandem.routing.errors import ConfigError
from tandem.routing.rates import RateProfile
from tandem.routing.step_time import StepTimeModel, load_sim_profile, shipped_profiles, sim_profile_from_dict


def test_a_step_costs_its_prefill_its_batch_decode_and_its_context():
    model = StepTimeModel(RateProfile(1000.0, 100.0, {1: 100.0, 4: 200.0}), decode_s_per_context_token=1e-6)
    assert model.step_s(500, 0) == pytest.approx(0.5)
    assert model.step_s(0, 4, 2000) == pytest.approx(4 / 200 + 2000e-6)
    assert model.step_s(0, 2) == pytest.approx(2 / (100 + (200 - 100) / 3))  # interpolated, as the router reads it
    assert model.step_s(100, 1, 1000) == pytest.approx(0.1 + 0.01 + 0.001)
    assert model.step_s(0, 0, 0) == 0.0


def test_the_design_profile_times_its_worked_example_as_the_router_scores_it():
    """The M2 Metal profile's router rates are the design's isolated ones; its CPU's too."""
    cpu = load_sim_profile("m2-cpu-qwen2.5-0.5b")
    assert (cpu.prefill_tok_s, cpu.decode_tok_s) == (73.0, 45.0)
    assert cpu.step_time().step_s(20, 0) + 128 * cpu.step_time().step_s(0, 1) == pytest.approx(3.118, abs=1e-3)


def test_every_shipped_profile_loads():
    assert {"h200-qwen2.5-0.5b", "m2-cpu-qwen2.5-0.5b", "m2-metal-qwen2.5-0.5b"} <= set(shipped_profiles())
    for name in shipped_profiles():
        profile = load_sim_profile(name)
        assert profile.description and profile.step_time().step_s(1, 1) > 0


def test_a_profile_file_loads_and_a_bad_one_is_named(tmp_path):
    good = tmp_path / "dev.json"
    good.write_text(json.dumps({"prefill_tok_s": 10.0, "decode_tok_s": 2.0, "max_active": 8, "num_kv_tokens": 4096}))
    profile = load_sim_profile(str(good))
    assert (profile.max_active, profile.num_kv_tokens, profile.rate_fields()["decode_tok_s"]) == (8, 4096, 2.0)
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        load_sim_profile(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="prefill_tok_s"):
        sim_profile_from_dict({"prefill_tok_s": -1, "decode_tok_s": 2.0})
    with pytest.raises(ConfigError, match="decode_tok_s_by_batch"):
        sim_profile_from_dict({"prefill_tok_s": 1, "decode_tok_s": 2.0, "decode_tok_s_by_batch": {"0": 1.0}})


def test_a_prefill_table_times_a_step_by_its_size_and_dilates_with_the_rest():
    model = StepTimeModel(RateProfile(1000.0, 100.0), prefill_tok_s_by_tokens={512: 1000.0, 2048: 4000.0})
    assert model.step_s(256, 0) == pytest.approx(256 / 1000)  # clamped below the table
    assert model.step_s(1280, 0) == pytest.approx(1280 / 2500)  # halfway between 512 and 2048
    assert model.step_s(8192, 0) == pytest.approx(8192 / 4000)  # clamped above
    profile = sim_profile_from_dict({"prefill_tok_s": 1000.0, "decode_tok_s": 100.0,
                                     "prefill_tok_s_by_tokens": {"512": 1000.0, "2048": 4000.0}})
    slow = profile.dilated(4.0).step_time()
    assert slow.step_s(2048, 0) == pytest.approx(4 * profile.step_time().step_s(2048, 0))


def test_a_host_reload_rate_times_reloads_and_dilates_with_the_rest():
    profile = sim_profile_from_dict({"prefill_tok_s": 1000.0, "decode_tok_s": 100.0, "host_reload_tok_s": 50_000.0})
    assert profile.step_time().reload_s(1000) == pytest.approx(0.02)
    assert profile.dilated(2.0).step_time().reload_s(1000) == pytest.approx(0.04)
    plain = sim_profile_from_dict({"prefill_tok_s": 1000.0, "decode_tok_s": 100.0})
    assert plain.host_reload_tok_s is None and plain.dilated(2.0).host_reload_tok_s is None
    with pytest.raises(ValueError, match="host_reload_tok_s"):
        plain.step_time().reload_s(1000)
    with pytest.raises(ConfigError):
        sim_profile_from_dict({"prefill_tok_s": 1000.0, "decode_tok_s": 100.0, "host_reload_tok_s": 0})


def test_a_context_cost_by_batch_is_read_at_the_step_s_batch_and_dilates_with_the_rest():
    model = StepTimeModel(RateProfile(1000.0, 100.0), decode_s_per_context_token=1.0,
                          decode_s_per_context_token_by_batch={16: 4e-8, 256: 1e-8})
    assert model.context_cost(1) == pytest.approx(4e-8)  # clamped below the table: the scalar is not used
    assert model.context_cost(136) == pytest.approx(2.5e-8)  # halfway between 16 and 256
    assert model.step_s(0, 16, 16 * 4096) == pytest.approx(16 / 100 + 16 * 4096 * 4e-8)
    assert model.step_s(0, 512, 1000) == pytest.approx(512 / 100 + 1000 * 1e-8)
    profile = sim_profile_from_dict({"prefill_tok_s": 1000.0, "decode_tok_s": 100.0,
                                     "decode_s_per_context_token_by_batch": {"16": 4e-8, "256": 1e-8}})
    assert profile.step_time().context_cost(16) == pytest.approx(4e-8)
    assert profile.dilated(3.0).step_time().context_cost(16) == pytest.approx(1.2e-7)
    assert profile.step_time_fields() == {"decode_s_per_context_token_by_batch": {16: 4e-8, 256: 1e-8}}
    assert load_sim_profile("h200-qwen2.5-0.5b").step_time_fields() == {}  # no context cost, no prefill table
    with pytest.raises(ConfigError, match="decode_s_per_context_token_by_batch"):
        sim_profile_from_dict({"prefill_tok_s": 1, "decode_tok_s": 2.0, "decode_s_per_context_token_by_batch": {"4": -1}})


def test_with_a_prefill_table_a_mixed_step_is_one_forward_over_all_its_tokens():
    """The table's time for (prompt + decode) tokens, plus the decodes' context cost: a step's
    own cost is paid once. Without the table, the prefill and decode terms add."""
    rates = RateProfile(1000.0, 100.0, {1: 100.0, 16: 1000.0})
    table = StepTimeModel(rates, prefill_tok_s_by_tokens={64: 32.0, 512: 256.0},
                          decode_s_per_context_token_by_batch={16: 1e-4})
    assert table.step_s(48, 16, 1000) == pytest.approx(64 / 32.0 + 1000 * 1e-4)
    assert table.step_s(48, 0) == pytest.approx(48 / 32.0)  # a prefill alone: as before
    assert table.step_s(0, 16, 1000) == pytest.approx(16 / 1000.0 + 1000 * 1e-4)  # a decode step alone
    plain = StepTimeModel(rates, decode_s_per_context_token=1e-4)
    assert plain.step_s(48, 16, 1000) == pytest.approx(48 / 1000.0 + 16 / 1000.0 + 1000 * 1e-4)


def test_a_host_floor_is_read_at_the_step_s_sequences_and_dilates_with_the_rest():
    """The host's work per step behind the server, a floor under a step of route-sim's engine
    model: interpolated by the step's sequences, clamped to the ends, none for an empty step."""
    model = StepTimeModel(RateProfile(1000.0, 100.0), host_s_per_step_by_batch={1: 0.001, 17: 0.003})
    assert model.floor_s(1) == pytest.approx(0.001) and model.floor_s(9) == pytest.approx(0.002)
    assert model.floor_s(64) == pytest.approx(0.003) and model.floor_s(0) == 0.0
    assert model.step_s(0, 1) == pytest.approx(0.01)  # the device's time is not changed by it
    assert StepTimeModel(RateProfile(1000.0, 100.0)).floor_s(8) == 0.0
    profile = sim_profile_from_dict({"prefill_tok_s": 1000.0, "decode_tok_s": 100.0,
                                     "host_s_per_step_by_batch": {"16": 0.002}})
    assert profile.dilated(2.0).step_time().floor_s(16) == pytest.approx(0.004)
    assert profile.step_time_fields() == {"host_s_per_step_by_batch": {16: 0.002}}
    with pytest.raises(ConfigError, match="host_s_per_step_by_batch"):
        sim_profile_from_dict({"prefill_tok_s": 1, "decode_tok_s": 2.0, "host_s_per_step_by_batch": {"4": -1}})
