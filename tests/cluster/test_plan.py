"""Several accelerators as a shape of their own: `cpu,cuda,cuda`, `cuda*2`, `cuda*all`, `auto*all`.

Pure planning with made-up GPU counts (no Ray, no torch): which backends run, on what, named
how, with how many threads, how GPUs are shared when there are more cuda backends than GPUs, and
the errors when a GPU is asked for and there is none.
"""

from __future__ import annotations

import pytest

from tandem.cluster.config import ConfigError, TandemConfig, parse_backends
from tandem.cluster.plan import plan_backends


def plan(spec: str, num_gpus: int, mps: bool = False, cores: int = 32):
    config = TandemConfig.validated({"backends": parse_backends(spec)})
    return plan_backends(config, num_gpus=num_gpus, mps_available=mps, num_cores=cores)


def shape(plans) -> list[tuple[str, str]]:
    return [(p.backend_id, p.device) for p in plans]


@pytest.mark.parametrize("spec", ["cpu,cuda,cuda", "cpu,cuda*2", "cpu,cuda*all", "cpu,auto*all", "cpu,auto,auto"])
def test_every_spelling_puts_one_backend_on_each_of_two_gpus(spec):
    plans = plan(spec, num_gpus=2)
    assert shape(plans) == [("cpu0", "cpu"), ("cuda0", "cuda"), ("cuda1", "cuda")]
    assert [p.num_gpus for p in plans] == [0.0, 1.0, 1.0]
    assert [p.threads for p in plans] == [32 - 1 - 2, 1, 1]  # a core for serving, one per GPU loop


def test_all_takes_every_gpu_the_cluster_has():
    assert shape(plan("cuda*all", num_gpus=8)) == [(f"cuda{i}", "cuda") for i in range(8)]
    assert shape(plan("cpu,auto*all", num_gpus=4))[1:] == [(f"cuda{i}", "cuda") for i in range(4)]


def test_all_takes_what_explicit_cuda_backends_left():
    plans = plan("cuda*all,big=cuda", num_gpus=3)
    assert shape(plans) == [("cuda0", "cuda"), ("cuda1", "cuda"), ("big", "cuda")]
    assert "2 free" in plans[0].reason


def test_auto_all_without_a_gpu_is_one_auto_backend():
    assert shape(plan("cpu,auto*all", num_gpus=0)) == [("cpu0", "cpu"), ("cpu1", "cpu")]
    assert shape(plan("cpu,auto*all", num_gpus=0, mps=True)) == [("cpu0", "cpu"), ("mps0", "mps")]


def test_auto_takes_a_gpu_each_until_none_is_left():
    plans = plan("auto*3", num_gpus=2)
    assert shape(plans) == [("cuda0", "cuda"), ("cuda1", "cuda"), ("cpu0", "cpu")]
    assert "second cpu" in plans[2].reason


def test_counts_of_cpu_backends_share_the_cores():
    plans = plan("cpu*2,cuda", num_gpus=1, cores=16)
    assert shape(plans) == [("cpu0", "cpu"), ("cpu1", "cpu"), ("cuda0", "cuda")]
    assert [p.threads for p in plans] == [7, 7, 1]  # (16 - 1 - 1) // 2


@pytest.mark.parametrize("spec, num_gpus, message", [
    ("cuda", 0, "1 cuda backend asked for, but the Ray cluster has no GPU"),
    ("cpu,cuda*2", 0, "2 cuda backends asked for, but the Ray cluster has no GPU"),
    ("cuda*all", 0, "cuda\\*all found no free GPU"),
    ("cuda*2,cuda*all", 2, "cuda\\*all found no free GPU .* 2 taken by explicit cuda backends"),
])
def test_cuda_backends_without_a_gpu_are_a_clear_error(spec, num_gpus, message):
    with pytest.raises(ConfigError, match=message):
        plan(spec, num_gpus=num_gpus)


@pytest.mark.parametrize("spec, num_gpus, per_gpu", [
    ("cuda*2", 1, 2), ("cpu,cuda*2", 1, 2), ("cpu,cuda,cuda", 1, 2), ("cuda*4", 1, 4),
    ("cuda*3", 2, 2), ("cuda*2", 2, 1), ("cuda", 1, 1),
])
def test_more_cuda_backends_than_gpus_share_them(spec, num_gpus, per_gpu):
    """k engines to a GPU: each asks Ray for 1/k of it, owns 0.9/k of its memory and runs 256/k."""
    cuda = [p for p in plan(spec, num_gpus=num_gpus) if p.device == "cuda"]
    assert {p.engines_per_gpu for p in cuda} == {per_gpu}
    assert [p.num_gpus for p in cuda] == [1 / per_gpu] * len(cuda)
    assert [p.gpu_memory_share for p in cuda] == [pytest.approx(0.9 / per_gpu)] * len(cuda)
    assert [p.max_active for p in cuda] == [256 // per_gpu] * len(cuda)


def test_shared_gpu_keeps_the_cpu_backend_as_it_was():
    cpu, *cuda = plan("cpu,cuda*2", num_gpus=1, cores=16)
    assert (cpu.device, cpu.num_gpus, cpu.gpu_memory_share, cpu.max_active) == ("cpu", 0.0, None, 4)
    assert cpu.threads == 16 - 1 - 2  # a core for serving, one per accelerator's step loop
    assert [p.backend_id for p in cuda] == ["cuda0", "cuda1"]
    assert "2 engines on its GPU" in cuda[0].reason


def test_explicit_settings_win_over_the_derived_defaults():
    config = TandemConfig.validated({"max_active": 32, "gpu_memory_utilization": 0.5,
                                     "backends": [{"device": "cuda", "count": 2},
                                                  {"device": "cuda", "gpu_memory_share": 0.3, "max_active": 8}]})
    plans = plan_backends(config, num_gpus=1, mps_available=False, num_cores=8)
    assert [p.max_active for p in plans] == [32, 32, 8]
    assert [p.gpu_memory_share for p in plans] == [pytest.approx(0.5 / 3)] * 2 + [0.3]
    assert [p.num_gpus for p in plans] == [pytest.approx(1 / 3)] * 3


def test_memory_shares_that_overcommit_a_gpu_are_an_error():
    config = TandemConfig.validated({"backends": [{"device": "cuda", "gpu_memory_share": 0.6},
                                                  {"device": "cuda", "gpu_memory_share": 0.5}]})
    with pytest.raises(ConfigError, match="add up to 1.10"):
        plan_backends(config, num_gpus=1, mps_available=False, num_cores=8)


def test_gpu_memory_share_is_for_gpu_backends():
    with pytest.raises(ConfigError, match="gpu_memory_share .* not cpu"):
        TandemConfig.validated({"backends": [{"device": "cpu", "gpu_memory_share": 0.5}]})


def test_parse_counts():
    assert parse_backends("cpu,cuda*2") == [{"device": "cpu"}, {"device": "cuda", "count": 2}]
    assert parse_backends("cpu, auto*all") == [{"device": "cpu"}, {"device": "auto", "count": "all"}]


@pytest.mark.parametrize("spec, message", [
    ("cpu*all", "cuda\\*all or auto\\*all"),
    ("cuda*0", "whole number >= 1 or all"),
    ("cuda*two", "whole number >= 1 or all"),
    ("gpu=cuda*2", "one id"),
    ("tpu*2", "unknown device 'tpu'"),
])
def test_bad_counts_are_named(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_backends(spec)


def test_yaml_count_is_validated_like_the_flag(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("backends:\n  - device: cpu\n  - device: cuda\n    count: all\n")
    config = TandemConfig.from_yaml(path)
    assert shape(plan_backends(config, num_gpus=2, mps_available=False, num_cores=8))[1:] == [
        ("cuda0", "cuda"), ("cuda1", "cuda")]
    path.write_text("backends:\n  - device: mps\n    count: all\n")
    with pytest.raises(ConfigError, match="backends.0"):
        TandemConfig.from_yaml(path)
    path.write_text("backends:\n  - device: cuda\n    count: 2\n    id: gpu\n")
    with pytest.raises(ConfigError, match="an id names one backend"):
        TandemConfig.from_yaml(path)


def test_sim_backends_take_their_profile_s_engine_and_reserve_no_core():
    config = TandemConfig.validated({"backends": [{"device": "cpu"}, {"device": "sim", "count": 2,
                                                                       "profile": "m2-metal-qwen2.5-0.5b"}],
                                     "sim_time_scale": 2.0})
    cpu, sim0, sim1 = plan_backends(config, num_gpus=0, mps_available=False, num_cores=4)
    assert cpu.threads == 3  # 4 cores less one for serving: the sims reserve none
    assert (sim0.backend_id, sim1.backend_id) == ("sim0", "sim1")
    assert (sim0.max_active, sim0.num_kv_blocks, sim0.num_gpus) == (4, 65536 // 16 + 1, 0.0)
    assert sim0.sim_profile["prefill_tok_s"] == 2551.0 / 2  # dilated twice: the router's rates too
    assert sim0.sim_profile_name == "m2-metal-qwen2.5-0.5b" and "2x slower" in sim0.reason


def test_a_sim_profile_is_for_sim_backends_and_parse_backends_reads_sim_colon_profile():
    assert parse_backends("sim:m2-cpu-qwen2.5-0.5b*2,cuda") == [
        {"device": "sim", "profile": "m2-cpu-qwen2.5-0.5b", "count": 2}, {"device": "cuda"}]
    with pytest.raises(ConfigError, match="only a sim backend"):
        parse_backends("cpu:x")
    with pytest.raises(ConfigError, match="profile"):
        TandemConfig.validated({"backends": [{"device": "cpu", "profile": "m2-cpu-qwen2.5-0.5b"}]})
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        plan_backends(TandemConfig.validated({"backends": [{"device": "sim", "profile": "nope"}]}), 0, False)


def test_cuda_backends_share_a_quarter_of_the_available_ram_as_their_host_kv_tier():
    config = TandemConfig(backends=parse_backends("cuda*2,cpu"))
    plans = plan_backends(config, num_gpus=1, mps_available=False, num_cores=16, available_gb=128.0)
    assert [p.kv_host_memory_gb for p in plans] == [16.0, 16.0, 0.0]


def test_the_host_kv_tier_is_set_per_backend_or_for_the_cluster_and_0_turns_it_off():
    config = TandemConfig(kv_host_memory_gb=0, backends=[{"device": "cuda", "kv_host_memory_gb": 8},
                                                         {"device": "cuda"}, {"device": "sim"}])
    plans = plan_backends(config, num_gpus=2, mps_available=False, num_cores=16, available_gb=128.0)
    assert [p.kv_host_memory_gb for p in plans] == [8.0, 0.0, 0.0]
    sims = plan_backends(TandemConfig(backends=parse_backends("sim*2")), 0, False, 4, available_gb=128.0)
    assert [p.kv_host_memory_gb for p in sims] == [0.0, 0.0]  # an emulated device's RAM is never assumed
    asked = plan_backends(TandemConfig(kv_host_memory_gb=2, backends=parse_backends("sim")), 0, False, 4)
    assert asked[0].kv_host_memory_gb == 2.0


def test_the_engine_that_serves_and_the_one_profiled_get_the_host_tier_and_its_gate():
    from tandem.cluster.profile import profile_key
    from tandem.engine.config import EngineConfig

    config = TandemConfig(backends=[{"device": "cuda", "kv_host_memory_gb": 8, "kv_host_offload_min_hits": 2},
                                    {"device": "cuda", "kv_host_memory_gb": 0}])
    tiered, plain = plan_backends(config, num_gpus=2, mps_available=False, num_cores=16, available_gb=128.0)
    kwargs = tiered.engine_kwargs(config)
    assert kwargs["kv_host_memory_gb"] == 8.0 and kwargs["kv_host_offload_min_hits"] == 2
    assert "kv_host_offload_min_hits" not in plain.engine_kwargs(config)  # the engine's default
    assert EngineConfig(**plain.engine_kwargs(config)).kv_host_memory_gb == 0.0
    # a tiered engine's profile holds a reload rate: it is never taken from an untiered one's
    assert profile_key("m", "cuda", "bfloat16", 1, 16, "H200", host_tier=True) != \
        profile_key("m", "cuda", "bfloat16", 1, 16, "H200")


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_a_host_kv_tier_on_a_backend_whose_cache_is_in_host_memory_is_refused(device):
    with pytest.raises(ConfigError, match="kv_host_memory_gb"):
        TandemConfig.validated({"backends": [{"device": device, "kv_host_memory_gb": 4}]})
