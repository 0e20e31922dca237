"""`cpu_kernels` reaches a cluster's cpu backends: the YAML backend key, `tandem serve
--cpu-kernels`, `tandem bench --cpu-kernels` and `cluster.start(...)`, rejected on a backend that
is not a cpu or whose weights are not int8/int4; ggml's rates are cached under a key of their own.
`auto`, the default, suits every backend (engine/config.py resolves it where the engine runs).

Nothing here starts Ray, loads a model or builds ggml (the engine's tests run the kernels).
"""

from __future__ import annotations

import argparse

import pytest

from tandem.cluster.config import ConfigError, TandemConfig
from tandem.cluster.plan import plan_backends
from tandem.cluster.profile import profile_key
from tests.cluster.conftest import serve_config


def test_the_yaml_backend_key_reaches_the_plan(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("backends:\n  - device: cpu\n    dtype: int4\n    cpu_kernels: ggml\n  - device: cpu\n")
    plans = plan_backends(TandemConfig.from_yaml(path), num_gpus=0, mps_available=False, num_cores=4)
    assert [p.cpu_kernels for p in plans] == ["ggml", "auto"]


@pytest.mark.parametrize("device", ["cuda", "mps", "auto"])
def test_ggml_kernels_on_a_backend_that_is_not_a_cpu_is_a_clear_error(device, tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text(f"backends:\n  - device: {device}\n    cpu_kernels: ggml\n")
    with pytest.raises(ConfigError, match=f"cpu_kernels ggml .* is for cpu backends, not {device}"):
        TandemConfig.from_yaml(path)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_ggml_kernels_without_quantized_weights_is_a_clear_error(dtype):
    with pytest.raises(ConfigError, match=f"use dtype int8 or int4, not {dtype}"):
        TandemConfig.validated({"backends": [{"device": "cpu", "dtype": dtype, "cpu_kernels": "ggml"}]})


def test_the_ggml_graph_takes_float32_too_but_not_bfloat16_nor_the_compiled_decode():
    for dtype in ("int4", "int8", "float32", "auto"):
        config = TandemConfig.validated({"backends": [{"device": "cpu", "dtype": dtype, "cpu_kernels": "ggml-graph"}]})
        assert config.backends[0].cpu_kernels == "ggml-graph"
    with pytest.raises(ConfigError, match="ggml-graph runs int8, int4 or float32 weights"):
        TandemConfig.validated({"backends": [{"device": "cpu", "dtype": "bfloat16", "cpu_kernels": "ggml-graph"}]})
    with pytest.raises(ConfigError, match="use one or the other"):
        TandemConfig.validated({"backends": [{"device": "cpu", "dtype": "int4", "cpu_kernels": "ggml-graph",
                                              "cpu_compile": True}]})


def test_torch_and_auto_kernels_suit_every_backend_and_other_names_are_refused():
    config = TandemConfig.validated({"backends": [{"device": "cuda", "cpu_kernels": "torch"}, {"device": "cpu"},
                                                  {"device": "auto"}]})
    assert [b.cpu_kernels for b in config.backends] == ["torch", "auto", "auto"]
    with pytest.raises(ConfigError, match="cpu_kernels"):
        TandemConfig.validated({"backends": [{"device": "cpu", "dtype": "int4", "cpu_kernels": "llamafile"}]})


def planned(config, num_gpus: int = 1) -> list[tuple[str, str, str]]:
    from tandem.cluster.plan import plan_backends

    return [(p.device, p.dtype, p.cpu_kernels) for p in plan_backends(config, num_gpus, False, num_cores=8)]


def test_the_serve_flag_sets_every_cpu_backend_and_keeps_the_dtype():
    config = serve_config("--backends", "cpu,cuda,cpu", "--cpu-kernels", "ggml", "--cpu-dtype", "int4")
    assert planned(config) == [("cpu", "int4", "ggml"), ("cuda", "auto", "auto"), ("cpu", "int4", "ggml")]
    assert planned(serve_config("--backends", "cpu")) == [("cpu", "auto", "auto")]


def test_the_serve_flag_sets_auto_when_it_resolves_to_the_cpu():
    """`--cpu-dtype int4 --cpu-kernels ggml-graph` with the default backends on a machine without
    a GPU: the second cpu backend that `auto` became runs as the first does."""
    config = serve_config("--cpu-dtype", "int4", "--cpu-kernels", "ggml-graph")
    assert planned(config, num_gpus=0) == [("cpu", "int4", "ggml-graph")] * 2
    assert planned(config, num_gpus=1) == [("cpu", "int4", "ggml-graph"), ("cuda", "auto", "auto")]


def test_the_serve_flag_overrides_the_config_file_and_leaves_it_when_unset(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("backends:\n  - device: cpu\n    dtype: int8\n    cpu_kernels: ggml\n")
    assert planned(serve_config("--config", str(path))) == [("cpu", "int8", "ggml")]
    assert planned(serve_config("--config", str(path), "--cpu-kernels", "torch")) == [("cpu", "int8", "torch")]


def test_the_serve_flag_without_a_cpu_backend_is_a_clear_error():
    with pytest.raises(ConfigError, match="--cpu-kernels applies to backends with device cpu"):
        serve_config("--backends", "cuda", "--cpu-kernels", "ggml")


def test_the_serve_flag_without_a_quantized_dtype_is_a_clear_error_naming_the_flags():
    """`tandem serve --cpu-kernels ggml` alone: the error names the flags the user types."""
    with pytest.raises(ConfigError, match="--cpu-kernels ggml runs quantized weights: use --cpu-dtype int8 or int4"):
        serve_config("--backends", "cpu", "--cpu-kernels", "ggml")
    with pytest.raises(ConfigError, match="use --cpu-dtype int8 or int4, not auto"):
        serve_config("--cpu-kernels", "ggml")  # the default backends
    with pytest.raises(ConfigError, match="which --cpu-compile would replace") as info:
        serve_config("--backends", "cpu", "--cpu-dtype", "int4", "--cpu-kernels", "ggml-graph", "--cpu-compile")
    assert "cpu_compile" not in str(info.value) and "cpu_kernels" not in str(info.value)
    with pytest.raises(ConfigError, match="use one of those --cpu-dtype values, not bfloat16"):
        serve_config("--backends", "cpu", "--cpu-dtype", "bfloat16", "--cpu-kernels", "ggml-graph")


def test_a_setting_from_the_config_file_keeps_its_yaml_name_beside_the_flag(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("backends:\n  - device: cpu\n    dtype: int8\n    cpu_kernels: ggml\n")
    with pytest.raises(ConfigError, match="cpu_kernels ggml runs quantized weights: use --cpu-dtype int8 or int4, "
                                          "not bfloat16"):
        serve_config("--config", str(path), "--cpu-dtype", "bfloat16")


def test_cluster_start_takes_the_backend_key():
    from tandem.cluster.launcher import _normalise

    overrides = _normalise({"backends": [{"device": "cpu", "dtype": "int4", "cpu_kernels": "ggml"}]})
    config = TandemConfig().with_overrides(**overrides)
    assert config.backends[0].cpu_kernels == "ggml"


def test_ggml_rates_have_a_profile_key_of_their_own():
    torch_key = profile_key("smollm2-135m", "cpu", "int4", 1, 4)
    ggml = profile_key("smollm2-135m", "cpu", "int4", 1, 4, cpu_kernels="ggml")
    ggml_compiled = profile_key("smollm2-135m", "cpu", "int4", 1, 4, cpu_compile=True, cpu_kernels="ggml")
    assert len({torch_key, ggml, ggml_compiled, profile_key("smollm2-135m", "cpu", "int4", 1, 4, cpu_compile=True)}) == 4
    assert "|int4|" in torch_key and "|int4-ggml|" in ggml and "|int4-ggml-compiled|" in ggml_compiled


def test_tandem_profile_keys_a_ggml_backend_apart():
    from tandem.cluster.profile_cli import _plan_key

    config = serve_config("--model", "tiny-llama-random", "--backends", "cpu", "--cpu-threads", "1",
                           "--cpu-dtype", "int4", "--cpu-kernels", "ggml")
    plan = plan_backends(config, num_gpus=0, mps_available=False)[0]
    assert _plan_key(config, plan, None) == profile_key("tiny-llama-random", "cpu", "int4", 1, 4, cpu_kernels="ggml")


def test_the_default_kernels_are_keyed_by_what_they_resolve_to_alike_by_profile_and_serve():
    """`auto` is keyed by the kernels it runs on this machine (ggml-graph where ggml is built,
    torch where not), by `tandem profile` (from the plan) and `tandem serve` (from the engine's
    BackendInfo) alike, so one's measurement is the other's cache hit."""
    import dataclasses

    from tandem.actors.messages import BackendInfo
    from tandem.cluster.launcher import _profile_key
    from tandem.cluster.profile_cli import _plan_key
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.ggml_kernels import auto_kernels

    config = serve_config("--model", "tiny-llama-random", "--backends", "cpu", "--cpu-threads", "1")
    plan = plan_backends(config, num_gpus=0, mps_available=False)[0]
    resolved, _ = auto_kernels(EngineConfig(model="tiny-llama-random", device="cpu"))
    key = profile_key("tiny-llama-random", "cpu", "float32", 1, 4, cpu_kernels=resolved)
    assert plan.cpu_kernels == "auto" and _plan_key(config, plan, None) == key
    info = BackendInfo("cpu0", "i1", "cpu", "cpu", "cpu", "float32", 1, 4, 16, "tiny-llama-random", 2048,
                       cpu_kernels=resolved)
    assert _profile_key(info, plan, {}) == key
    ggml_graph = _profile_key(dataclasses.replace(info, cpu_kernels="ggml-graph"), plan, {})
    assert "|float32-ggml-graph|" in ggml_graph  # what an explicit --cpu-kernels ggml-graph is keyed by too


def test_the_start_log_says_why_a_first_start_is_slow():
    from tandem.cluster.launcher import _cpu_notes

    def pending():
        return True

    config = serve_config("--backends", "cpu,cpu", "--cpu-dtype", "int4", "--cpu-kernels", "ggml")
    ggml, _ = plan_backends(config, num_gpus=0, mps_available=False, num_cores=4)
    assert "builds their op library" in _cpu_notes(ggml, pending)
    assert _cpu_notes(ggml, lambda: False) == ""  # built already: nothing slow to announce
    default = plan_backends(serve_config("--backends", "cpu"), num_gpus=0, mps_available=False)[0]
    assert default.cpu_kernels == "auto" and "builds their op library" in _cpu_notes(default, pending)
    torch_plan = plan_backends(serve_config("--backends", "cpu", "--cpu-kernels", "torch"), num_gpus=0,
                               mps_available=False)[0]
    int8 = plan_backends(serve_config("--backends", "cpu", "--cpu-dtype", "int8"), num_gpus=0, mps_available=False)[0]
    assert _cpu_notes(torch_plan, pending) == _cpu_notes(int8, pending) == ""  # eager: no op library


def test_the_start_log_and_the_engine_read_auto_alike():
    """The log announces an op-library build exactly where the engine's auto choice would try
    ggml's graph: both ask `auto_excluded`."""
    from tandem.cluster.launcher import _cpu_notes
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.ggml_kernels import auto_excluded, auto_kernels

    for dtype in ("auto", "float32", "int8", "int4"):
        for compile_ in (False, True):
            flags = ("--backends", "cpu", "--cpu-dtype", dtype) + (("--cpu-compile",) if compile_ else ())
            plan = plan_backends(serve_config(*flags), num_gpus=0, mps_available=False)[0]
            excluded = auto_excluded(plan.device, plan.dtype, plan.cpu_compile)
            assert ("builds their op library" in _cpu_notes(plan, lambda: True)) == (excluded is None), flags
            if excluded is not None:  # the engine runs eager, for the same reason
                config = EngineConfig(model="tiny-llama-random", device="cpu", dtype=dtype, cpu_compile=compile_)
                assert auto_kernels(config) == ("torch", excluded), flags
    assert auto_excluded("cuda", "auto", False) == "device cuda"


def test_bench_takes_the_kernels_flag():
    from bench.cli import add_arguments
    from bench.harness import _dtype_suffix

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["seed", "--out", "x", "--cpu-dtype", "int4", "--cpu-kernels", "ggml", "--cpu-compile"])
    assert (args.cpu_dtype, args.cpu_kernels, args.cpu_compile) == ("int4", "ggml", True)
    assert parser.parse_args(["seed", "--out", "x"]).cpu_kernels == "auto"
    assert _dtype_suffix({"cpu_kernels": "ggml", "cpu_compile": True}) == "-ggml-compiled"
    assert _dtype_suffix({"device": "cuda"}) == ""
