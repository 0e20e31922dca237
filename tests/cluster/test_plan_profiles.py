"""Identical devices share one profile: one measurement per key, repeats with a median and a
spread, a warning past 10% (such a measurement is used but not cached), and a re-profile
compared with the entry it replaces.

`resolve_profiles` is what `tandem serve` (cluster/launcher.py) and `tandem profile` both call;
the last test runs `tandem profile` in-process on two identical CPU backends of the tiny model.
"""

from __future__ import annotations

import json

import pytest

from tandem.cluster.config import ConfigError
from tandem.cluster.profile import (gpu_model, load_cache, profile_key, rate_difference, resolve_profiles,
                                    spread_warning)


def entry(prefill: float, spread: float = 0.02) -> dict:
    return {"prefill_tok_s": prefill, "decode_tok_s": 100.0, "decode_tok_s_by_batch": {1: 100.0, 2: 190.0},
            "spread": {"repeats": 3, "prefill_tok_s": spread, "decode_tok_s_by_batch": 0.01}}


class Recorder:
    def __init__(self, *results: dict) -> None:
        self.results, self.measured, self.stored, self.lines = list(results), [], {}, []

    def measure(self, backend_id: str) -> dict:
        self.measured.append(backend_id)
        return self.results.pop(0)

    def store(self, key: str, value: dict) -> None:
        self.stored[key] = value

    def resolve(self, wanted, cache=None, mode="auto", previous=None):
        return resolve_profiles(wanted, cache or {}, mode, self.measure, self.store, self.lines.append, previous)


H200 = profile_key("qwen2.5-0.5b-random", "cuda", "bfloat16", 1, 16, "H200")


def test_identical_gpus_are_measured_once_and_share_the_entry():
    rec = Recorder(entry(38_600.0))
    found = rec.resolve([("cuda0", H200), ("cuda1", H200)])
    assert rec.measured == ["cuda0"] and list(rec.stored) == [H200]
    assert found["cuda0"] is found["cuda1"]
    assert any("profiling backend cuda0" in line and "for cuda0, cuda1" in line for line in rec.lines)
    assert any("cuda1: the same device and engine as cuda0" in line for line in rec.lines)


def test_different_keys_are_measured_separately():
    a100 = profile_key("qwen2.5-0.5b-random", "cuda", "bfloat16", 1, 16, "A100")
    cpu = profile_key("qwen2.5-0.5b-random", "cpu", "float32", 14, 4)
    rec = Recorder(entry(38_000.0), entry(20_000.0), entry(600.0))
    found = rec.resolve([("cuda0", H200), ("cuda1", a100), ("cpu0", cpu)])
    assert rec.measured == ["cuda0", "cuda1", "cpu0"]
    assert [found[b]["prefill_tok_s"] for b in ("cuda0", "cuda1", "cpu0")] == [38_000.0, 20_000.0, 600.0]


def test_max_active_and_threads_are_part_of_the_key():
    keys = {profile_key("m", "cpu", "float32", t, m) for t in (1, 2) for m in (4, 8)}
    assert len(keys) == 4


def test_the_cache_serves_every_identical_backend_and_never_refuses_what_it_lacks():
    rec = Recorder()
    found = rec.resolve([("cuda0", H200), ("cuda1", H200)], cache={H200: entry(38_000.0)}, mode="never")
    assert rec.measured == [] and found["cuda1"]["prefill_tok_s"] == 38_000.0
    with pytest.raises(ConfigError, match="no rates for backend cuda0"):
        Recorder().resolve([("cuda0", H200)], mode="never")


def test_a_wide_spread_is_a_warning_naming_the_flag_that_measures_again():
    assert spread_warning(entry(1.0, spread=0.08)) is None
    message = spread_warning(entry(1.0, spread=0.30))
    assert message.startswith("warning") and "30%" in message and "more than 10%" in message
    assert "--profile always" in message and "not stored" in message
    rec = Recorder(entry(38_000.0, spread=0.30))
    rec.resolve([("cuda0", H200)])
    assert any(line.strip().startswith("warning: the profile's 3 repeats spread 30%") for line in rec.lines)


def test_a_noisy_measurement_is_used_for_this_run_but_not_stored():
    rec = Recorder(entry(38_000.0, spread=0.30))
    found = rec.resolve([("cuda0", H200), ("cuda1", H200)])
    assert found["cuda0"]["prefill_tok_s"] == 38_000.0 and found["cuda1"] is found["cuda0"]
    assert rec.stored == {}
    warning = next(line for line in rec.lines if "warning" in line)
    assert "not stored in the profile cache" in warning and "this run only" in warning
    assert "tandem serve --profile always" in warning


def test_a_steady_measurement_is_stored():
    rec = Recorder(entry(38_000.0, spread=0.05))
    found = rec.resolve([("cuda0", H200)])
    assert rec.stored == {H200: found["cuda0"]}
    assert not any("warning" in line for line in rec.lines)


def test_a_noisy_reprofile_keeps_the_cached_entry_and_uses_the_new_one_for_this_run():
    cached = entry(38_000.0)
    rec = Recorder(entry(30_000.0, spread=0.25))
    found = rec.resolve([("cuda0", H200)], cache={H200: cached}, mode="always", previous={H200: cached})
    assert found["cuda0"]["prefill_tok_s"] == 30_000.0 and rec.stored == {}


def test_a_noisy_cached_entry_is_measured_again_unless_profiling_is_off():
    noisy = entry(38_000.0, spread=0.30)
    rec = Recorder(entry(39_000.0))
    found = rec.resolve([("cuda0", H200)], cache={H200: noisy})
    assert rec.measured == ["cuda0"] and found["cuda0"]["prefill_tok_s"] == 39_000.0 and list(rec.stored) == [H200]
    assert any("measuring again" in line for line in rec.lines)
    rec = Recorder()
    found = rec.resolve([("cuda0", H200)], cache={H200: noisy}, mode="never")
    assert rec.measured == [] and found["cuda0"] is noisy
    assert any("warning" in line and "--profile always" in line for line in rec.lines)


def test_tandem_profile_says_what_it_does_with_a_noisy_measurement():
    from tandem.cluster.profile import NOT_STORED_PROFILE

    rec = Recorder(entry(38_000.0, spread=0.30))
    resolve_profiles([("cuda0", H200)], {}, "always", rec.measure, rec.store, rec.lines.append,
                     not_stored=NOT_STORED_PROFILE)
    assert rec.stored == {} and any("rates file" in line and "tandem profile" in line for line in rec.lines)


def test_a_reprofile_is_compared_with_the_cached_entry():
    cached = json.loads(json.dumps(entry(38_000.0)))  # as read back: batch sizes are text
    rec = Recorder(entry(39_000.0), entry(28_800.0))
    rec.resolve([("cuda0", H200)], cache={H200: cached}, mode="always", previous={H200: cached})
    assert any("re-profile agrees with the cached profile of this device within 2.6%" in line for line in rec.lines)
    rec.resolve([("cuda0", H200)], cache={H200: cached}, mode="always", previous={H200: cached})
    assert any("warning: re-profile differs" in line and "24.2%" in line for line in rec.lines)
    assert rate_difference(cached, {**cached, "decode_tok_s_by_batch": {1: 100.0, 2: 95.0}}) == pytest.approx(0.5)


@pytest.mark.parametrize("torch_name, ray_name", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"), ("Tesla V100-SXM2-16GB", "V100"),
    ("NVIDIA GeForce RTX 5090", "GeForce-RTX-5090"), ("NVIDIA A100-SXM4-80GB", "A100"),
])
def test_gpu_models_are_spelled_as_ray_spells_them(torch_name, ray_name):
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    assert gpu_model(torch_name) == NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(torch_name)
    assert gpu_model(torch_name) == ray_name


def test_tandem_profile_measures_two_identical_cpu_backends_once(tmp_path, capsys):
    from tandem.cluster.cli import main

    cache, output = tmp_path / "rates-cache.json", tmp_path / "rates.json"
    config = tmp_path / "tandem.yaml"
    config.write_text(f"rates_cache: {cache}\n")
    assert main(["profile", "--config", str(config), "--model", "tiny-llama-random", "--backends", "cpu*2",
                 "--cpu-threads", "1", "--max-active", "2", "--prompt-len", "64", "--decode-tokens", "4",
                 "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("profiling backend") == 1 and "rates for cpu1: the same device" in printed
    rates = json.loads(output.read_text())
    assert rates["cpu0"] == rates["cpu1"] and "spread" not in rates["cpu0"]
    stored = load_cache(cache)
    if "not stored in the profile cache" in printed:  # busy cores: a noisy measurement is not kept
        assert stored == {}
        return
    # keyed by the kernels `auto` runs on this machine: ggml's graph once an earlier test built ggml, else torch
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.ggml_kernels import auto_kernels

    kernels = auto_kernels(EngineConfig(model="tiny-llama-random", device="cpu"))[0]
    key = profile_key("tiny-llama-random", "cpu", "float32", 1, 2, cpu_kernels=kernels)
    assert list(stored) == [key]
    assert stored[key]["spread"]["repeats"] == 3
