"""`cpu_compile` reaches a cluster's cpu backends: the YAML backend key, `tandem serve
--cpu-compile`, `tandem bench --cpu-compile` and `cluster.start(...)`, rejected on a backend that
is not a cpu; compiled rates are cached under a key of their own; and a compiled backend started
through the cluster API generates the greedy tokens an eager engine does.

The last test starts Ray and compiles (tens of seconds on two cores), in a subprocess because the
rest of the cluster suite holds a Ray instance in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.cluster.config import ConfigError, TandemConfig
from tandem.cluster.plan import plan_backends
from tandem.cluster.profile import profile_key
from tests.cluster.conftest import serve_config


def test_the_yaml_backend_key_reaches_the_plan(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text("backends:\n  - device: cpu\n    cpu_compile: true\n  - device: cpu\n")
    plans = plan_backends(TandemConfig.from_yaml(path), num_gpus=0, mps_available=False, num_cores=4)
    assert [p.cpu_compile for p in plans] == [True, False]


@pytest.mark.parametrize("device", ["cuda", "mps", "auto"])
def test_cpu_compile_on_a_backend_that_is_not_a_cpu_is_a_clear_error(device, tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text(f"backends:\n  - device: {device}\n    cpu_compile: true\n")
    with pytest.raises(ConfigError, match=f"cpu_compile .* is for cpu backends, not {device}"):
        TandemConfig.from_yaml(path)


def test_the_serve_flag_compiles_every_cpu_backend_and_keeps_the_dtype():
    from tandem.cluster.plan import plan_backends

    def planned(config):
        return [(p.device, p.dtype, p.cpu_compile) for p in plan_backends(config, 1, False, num_cores=8)]

    config = serve_config("--backends", "cpu,cuda,cpu", "--cpu-compile", "--cpu-dtype", "int4")
    assert planned(config) == [("cpu", "int4", True), ("cuda", "auto", False), ("cpu", "int4", True)]
    assert planned(serve_config("--backends", "cpu")) == [("cpu", "auto", False)]


def test_the_serve_flag_without_a_cpu_backend_is_a_clear_error():
    with pytest.raises(ConfigError, match="--cpu-compile applies to backends with device cpu"):
        serve_config("--backends", "cuda", "--cpu-compile")


def test_cluster_start_takes_the_backend_key():
    from tandem.cluster.launcher import _normalise

    overrides = _normalise({"backends": [{"device": "cpu", "cpu_compile": True}]})
    config = TandemConfig().with_overrides(**overrides)
    assert config.backends[0].cpu_compile


def test_compiled_rates_have_a_profile_key_of_their_own():
    eager = profile_key("smollm2-135m", "cpu", "int4", 1, 4)
    compiled = profile_key("smollm2-135m", "cpu", "int4", 1, 4, cpu_compile=True)
    assert compiled != eager and "|int4-compiled|" in compiled and "|int4|" in eager


def test_tandem_profile_keys_a_compiled_backend_apart():
    from tandem.cluster.profile_cli import _plan_key

    config = serve_config("--model", "tiny-llama-random", "--backends", "cpu", "--cpu-threads", "1",
                           "--cpu-compile")
    plan = plan_backends(config, num_gpus=0, mps_available=False)[0]
    assert _plan_key(config, plan, None) == profile_key("tiny-llama-random", "cpu", "float32", 1, 4,
                                                        cpu_compile=True)


def test_bench_takes_the_quantized_dtypes_and_the_compile_flag():
    from bench.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["seed", "--out", "x", "--cpu-dtype", "int4", "--cpu-compile"])
    assert (args.cpu_dtype, args.cpu_compile) == ("int4", True)


SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    from tandem import cluster
    from tandem.engine.sampling_params import SamplingParams

    tmp = pathlib.Path(sys.argv[1])
    logged = []
    tandem = cluster.start(model="tiny-llama-random", backends=[{"device": "cpu", "cpu_compile": True}],
                           cpu_threads=1, max_active=1, serve_http=False, rates_cache=str(tmp / "rates-cache.json"),
                           calibration_alpha=0, metrics_port=0, log=logged.append)
    try:
        outs = list(tandem.generate(list(range(10, 40)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        cache = tmp / "rates-cache.json"
        print("RESULT " + json.dumps({"tokens": [t for o in outs for t in o.new_token_ids],
                                      "keys": list(json.loads(cache.read_text())) if cache.exists() else [],
                                      "noisy": any("not stored in the profile cache" in line for line in logged)}))
    finally:
        tandem.shutdown()
""")


@pytest.mark.slow
def test_a_compiled_backend_started_through_the_cluster_api_generates_what_eager_does(tmp_path):
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.cpu_compile import compiler_available
    from tests.conftest import greedy_tokens

    if not compiler_available():
        pytest.skip("torch.compile's CPU backend needs a C++ compiler")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    _, eager = greedy_tokens(EngineConfig(model="tiny-llama-random", max_active=1), [list(range(10, 40))],
                             max_tokens=8)
    assert result["tokens"] == eager[0]
    assert any((tmp_path / "inductor").rglob("*.py")), "the backend compiled nothing"
    key = profile_key("tiny-llama-random", "cpu", "float32", 1, 1, cpu_compile=True)
    assert result["keys"] == ([] if result["noisy"] else [key])  # a noisy profile (busy cores) is not cached
