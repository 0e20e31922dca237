"""Config file, flag overrides, and backend planning (auto resolution, ids, threads)."""

from __future__ import annotations

import pytest

from tandem.cluster.config import ConfigError, TandemConfig, parse_backends
from tandem.cluster.plan import plan_backends


def test_yaml_then_flags_override(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("model: tiny-llama-random\npolicy: round-robin\nport: 9000\n"
                    "backends:\n  - device: cpu\n    threads: 1\n  - device: auto\n")
    config = TandemConfig.from_yaml(path).with_overrides(port=9100, policy=None)
    assert (config.model, config.policy, config.port) == ("tiny-llama-random", "round-robin", 9100)
    assert [b.device for b in config.backends] == ["cpu", "auto"]


@pytest.mark.parametrize("text, field", [
    ("max_active: 0\n", "max_active"),
    ("backends: []\n", "backends"),
    ("backends:\n  - device: tpu\n", "backends.0.device"),
    ("port: 'eighty'\n", "port"),
    ("unknown_setting: 1\n", "unknown_setting"),
])
def test_bad_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field):
        TandemConfig.from_yaml(path)


def test_parse_backends():
    assert parse_backends("cpu,auto") == [{"device": "cpu"}, {"device": "auto"}]
    assert parse_backends("big=cpu, cuda") == [{"device": "cpu", "id": "big"}, {"device": "cuda"}]
    with pytest.raises(ConfigError, match="tpu"):
        parse_backends("cpu,tpu")


def test_auto_prefers_cuda_then_mps_then_cpu():
    config = TandemConfig(backends=[{"device": "cpu"}, {"device": "auto"}])
    cuda = plan_backends(config, num_gpus=1, mps_available=True, num_cores=16)
    assert [(p.backend_id, p.device, p.num_gpus) for p in cuda] == [("cpu0", "cpu", 0.0), ("cuda0", "cuda", 1.0)]
    assert cuda[0].threads == 14 and cuda[1].threads == 1  # a core for serving, one for the GPU's loop
    mps = plan_backends(config, num_gpus=0, mps_available=True, num_cores=8)
    assert [(p.device, p.threads) for p in mps] == [("cpu", 6), ("mps", 1)]
    cpu = plan_backends(config, num_gpus=0, mps_available=False, num_cores=2)
    assert [(p.backend_id, p.device, p.threads) for p in cpu] == [("cpu0", "cpu", 1), ("cpu1", "cpu", 1)]
    assert "second cpu" in cpu[1].reason


def test_explicit_cuda_claims_its_gpu_before_auto():
    config = TandemConfig(backends=[{"device": "auto"}, {"device": "cuda"}])
    plans = plan_backends(config, num_gpus=1, mps_available=False, num_cores=4)
    assert [p.device for p in plans] == ["cpu", "cuda"]


def test_explicit_ids_are_kept_and_not_reused():
    config = TandemConfig(backends=[{"device": "cpu", "id": "cpu1"}, {"device": "cpu"}])
    assert [p.backend_id for p in plan_backends(config, 0, False, 2)] == ["cpu1", "cpu0"]
    with pytest.raises(ConfigError, match="unique"):
        TandemConfig.validated({"backends": [{"id": "a"}, {"id": "a"}]})


def test_engine_defaults_are_the_cluster_defaults():
    from tandem.engine.config import EngineConfig

    config, engine = TandemConfig(), EngineConfig()
    assert (config.model, config.block_size) == (engine.model, engine.block_size)
    # max_active is left to the device in both: the engine resolves it where it knows the device
    assert config.max_active is None
    assert EngineConfig(device="cpu").max_active == 4 and EngineConfig(device="cuda").max_active == 256


def test_one_config_error_for_every_layer():
    from tandem.routing import ConfigError as RoutingConfigError

    assert ConfigError is RoutingConfigError


def test_one_cache_root_for_models_and_rates(tmp_path, monkeypatch):
    from tandem.engine.model.loader import models_cache_dir

    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models_cache_dir() == tmp_path / "xdg" / "tandem" / "models"
    assert TandemConfig().rates_cache == tmp_path / "xdg" / "tandem" / "rates-cache.json"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "mine"))
    assert models_cache_dir() == tmp_path / "mine" / "models"
    assert TandemConfig().rates_cache == tmp_path / "mine" / "rates-cache.json"


def test_quiet_defaults():
    config = TandemConfig()
    assert (config.routing_log, config.access_log, config.log_level) == (None, False, "warning")


def test_a_rates_file_says_what_it_gave_each_backend(tmp_path):
    import json
    from types import SimpleNamespace

    from tandem.cluster.launcher import _resolve_rates

    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"cpu0": {"prefill_tok_s": 120, "decode_tok_s": 9.5},
                                "cpu": {"prefill_tok_s": 100, "decode_tok_s": 8.0,
                                        "decode_tok_s_by_batch": {"1": 8.0, "2": 14.0}}}))
    config = TandemConfig(rates=path, rates_cache=tmp_path / "cache.json", profile="never")
    plans = plan_backends(config, num_gpus=0, mps_available=False)
    infos = [SimpleNamespace(model_name="smollm2-135m", device_kind="cpu", dtype="float32", threads=p.threads)
             for p in plans]
    lines = []
    rates = _resolve_rates(config, plans, infos, backends={}, log=lines.append)
    assert rates["cpu0"]["prefill_tok_s"] == 120 and rates["cpu1"]["prefill_tok_s"] == 100
    assert lines == [
        f"rates for cpu0 from {path} (entry 'cpu0'): prefill 120 tok/s, decode 9.5 tok/s (batch 1)",
        f"rates for cpu1 from {path} (entry 'cpu'): prefill 100 tok/s, decode 8.0 tok/s (batch 1), "
        "by batch {1: 8.0, 2: 14.0}"]


def test_scoring_engines_by_their_share_of_a_device_is_opt_in():
    import argparse

    from tandem.cluster.serve_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert TandemConfig().device_shares is False
    assert parser.parse_args([]).device_shares is None  # the config's (or its YAML's) setting stays
    assert parser.parse_args(["--device-shares"]).device_shares is True
    assert TandemConfig().with_overrides(device_shares=True).device_shares is True
