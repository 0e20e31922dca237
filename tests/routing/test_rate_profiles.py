"""Rate profiles: batch-aware lookup, EWMA calibration, the JSON file and its errors."""

import json

import pytest

from tandem.routing import CalibrationConfig, ConfigError, RateProfile, calibrate, load_rate_profiles


def test_decode_rate_by_batch_interpolates_and_clamps():
    rates = RateProfile(1000, 100, {1: 100, 4: 250, "8": 300})
    assert rates.decode_tok_s_by_batch == {1: 100.0, 4: 250.0, 8: 300.0}
    assert [rates.decode_rate(b) for b in (1, 2, 4, 6, 8, 16)] == [100, 150, 250, 275, 300, 300]
    assert rates.decode_step_s(4) == 4 / 250
    assert RateProfile(1000, 100).decode_rate(7) == 100


def test_invalid_profiles_name_the_field():
    with pytest.raises(ValueError, match="prefill_tok_s must be > 0"):
        RateProfile(-1, 10)
    with pytest.raises(ValueError, match=r"decode_tok_s_by_batch\[2\] must be > 0"):
        RateProfile(1, 10, {2: 0})


def test_calibration_ewma():
    rates = RateProfile(100, 10, {1: 10, 3: 30})
    config = CalibrationConfig(alpha=0.25)
    assert calibrate(rates, config, 300, 0, 2, 1.0).prefill_tok_s == 150
    updated = calibrate(rates, config, 0, 100, 2, 2.0)  # 50 tok/s observed at batch 2 (table: 20)
    # factor 0.75 + 0.25 * 50 / 20 = 1.375, applied to every batch size
    assert updated.decode_tok_s_by_batch == pytest.approx({1: 13.75, 3: 41.25})
    assert updated.decode_rate(2) == pytest.approx(27.5)
    assert updated.decode_tok_s == pytest.approx(13.75)
    assert calibrate(RateProfile(100, 10), config, 0, 50, 1, 1.0).decode_tok_s == 20
    assert calibrate(rates, config, 10, 10, 2, 1.0) is rates  # mixed, as much decode as prefill: skipped
    assert calibrate(rates, config, 5, 10, 10, 1.0) is rates
    # Mostly prefill: one forward over all 400 tokens, 200 tok/s observed
    assert calibrate(rates, config, 397, 3, 3, 2.0).prefill_tok_s == pytest.approx(0.75 * 100 + 0.25 * 200)
    assert calibrate(rates, config, 397, 3, 3, 2.0).decode_tok_s_by_batch == rates.decode_tok_s_by_batch
    with pytest.raises(ValueError, match="elapsed_s"):
        calibrate(rates, config, 10, 0, 1, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        CalibrationConfig(alpha=0)


def test_load_rate_profiles(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({
        "cuda0": {"prefill_tok_s": 2551, "decode_tok_s": 293, "decode_tok_s_by_batch": {"1": 293, "4": 800}},
        "cpu0": {"prefill_tok_s": 73, "decode_tok_s": 45},
    }))
    profiles = load_rate_profiles(path)
    assert profiles["cpu0"] == RateProfile(73, 45)
    assert profiles["cuda0"].decode_rate(4) == 800


@pytest.mark.parametrize("body, field, message", [
    ({"cpu0": {"prefill_tok_s": -73, "decode_tok_s": 45}}, "cpu0.prefill_tok_s", "greater than 0"),
    ({"cpu0": {"prefill_tok_s": 73}}, "cpu0.decode_tok_s", "required field is missing"),
    ({"cpu0": {"prefill_tok_s": 73, "decode_tok_s": 45, "decode_tok_s": 45, "decod_tok_s": 1}},
     "cpu0.decod_tok_s", "Extra inputs"),
    ({"cpu0": {"prefill_tok_s": 73, "decode_tok_s": 45, "decode_tok_s_by_batch": {"0": 5}}},
     "cpu0", "batch size must be >= 1"),
])
def test_bad_profile_file_names_the_field(tmp_path, body, field, message):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError) as exc:
        load_rate_profiles(path)
    assert field in str(exc.value) and message in str(exc.value)


def test_unreadable_profile_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_rate_profiles(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_rate_profiles(tmp_path / "bad.json")
