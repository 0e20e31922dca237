"""The cpu engine's default kernels (`cpu_kernels="auto"`, engine/config.py): float32 decode steps
through ggml's graph where ggml is built, prefill and mixed steps eager on packed weights; eager
everywhere, with the reason in one start-up line, where ggml is not built. The graph computes what
the eager path does up to float32 rounding, so greedy tokens agree. Building ggml at install time
is best effort (engine/model/ggml_build.py): without the tools it records why and carries on."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import build_ggml_or_skip

PROMPTS = [list(range(10 + i, 40 + 3 * i)) for i in range(4)]


def _greedy_with_mixed_steps(config) -> tuple[object, list[list[int]]]:
    """Greedy tokens of PROMPTS (EOS ignored), two of them arriving while the first two decode, so
    the run has prefill-only, decode-only and mixed steps."""
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and (steps == 0 or steps % 3 == 2):
            for i, prompt in pending[:2]:
                engine.add_request(f"r{i}", prompt, params)
            pending = pending[2:]
        for o in engine.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        steps += 1
    return engine, [out[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("model", ["tiny-llama-random", "tiny-qwen2-random"])
def test_auto_kernels_answer_as_eager(model):
    """Where ggml is built, the default runs decode steps on ggml's graph and the rest eager on
    packed weights, with the eager path's greedy tokens."""
    build_ggml_or_skip()
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.ggml_decode import GGMLGraphDecode

    engine, auto_out = _greedy_with_mixed_steps(EngineConfig(model=model, max_active=4))
    assert engine.config.cpu_kernels == "ggml-graph"
    assert isinstance(engine.model_runner.cpu_decode, GGMLGraphDecode)
    assert engine.model_runner.num_packed_linears > 0 or not _packs_float32()
    _, eager_out = _greedy_with_mixed_steps(EngineConfig(model=model, cpu_kernels="torch", max_active=4))
    assert auto_out == eager_out
    assert [len(tokens) for tokens in auto_out] == [10] * len(PROMPTS)


def _packs_float32() -> bool:
    import torch

    from tandem.engine.model.cpu_linear import available

    return available(torch.float32)


def test_auto_kernels_run_eager_where_ggml_is_not_built(tmp_path, monkeypatch, caplog):
    """An empty cache directory: no libggml, so no ggml graph and no build at start; one warning
    line says what runs and how to get ggml."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        engine = LLMEngine(EngineConfig(model="tiny-llama-random", max_active=2))
    assert engine.config.cpu_kernels == "torch" and engine.model_runner.cpu_decode is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu engine:")]
    assert lines == ["cpu engine: float32, kernels auto (eager: ggml is not built on this machine: it was not "
                     "built at install; run `python -m tandem.engine.model.ggml_kernels build`)"]
    assert not (tmp_path / "ggml").exists()  # nothing fetched or built while starting


@pytest.mark.parametrize(("overrides", "why"), [
    ({"dtype": "bfloat16"}, "eager: ggml's graph runs bfloat16 only when asked (cpu_kernels ggml-graph)"),
    ({"dtype": "int4"}, "eager: ggml's graph runs int4 only when asked (cpu_kernels ggml-graph)"),
    ({"cpu_compile": True}, "eager: cpu_compile decodes through compiled graphs"),
    ({"pack_cpu_weights": False}, "eager: pack_cpu_weights is off"),
    ({"cpu_kernels": "ggml-graph"}, "as configured"),
])
def test_auto_kernels_elsewhere(overrides, why):
    """auto means ggml's graph for float32 weights only: other dtypes keep their kernels (one flag
    away), and a compiled decode is not replaced."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.model.ggml_kernels import auto_kernels

    config = EngineConfig(model="tiny-llama-random", **overrides)
    expected = overrides.get("cpu_kernels", "torch")
    assert auto_kernels(config) == (expected, why)


def test_auto_kernels_run_eager_where_the_op_library_cannot_be_built(monkeypatch):
    """libggml is built but the op library that links it to this torch fails to build (no
    compiler, no ninja, a compile error): the engine runs eager and says why, it does not fail."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.model import ggml_kernels

    def failing_load():
        raise RuntimeError("building the ggml op library needs ninja on PATH")

    monkeypatch.setattr(ggml_kernels, "unavailable", lambda: None)
    monkeypatch.setattr(ggml_kernels, "load", failing_load)
    assert ggml_kernels.auto_kernels(EngineConfig(model="tiny-llama-random")) == (
        "torch", "eager: the ggml op library could not be built (RuntimeError: building the ggml op library "
                 "needs ninja on PATH)")


def test_the_op_library_needs_a_compiler_and_ninja_not_cmake(monkeypatch):
    """cmake builds libggml only (at install); the op library needs the C++ compiler and ninja."""
    from tandem.engine.model import ggml_kernels

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(ggml_kernels.shutil, "which", lambda tool, path=None: None)
    assert ggml_kernels._missing_op_tools() == ["c++", "ninja"]
    monkeypatch.setattr(ggml_kernels.shutil, "which", lambda tool, path=None: None if tool == "cmake" else tool)
    assert ggml_kernels._missing_op_tools() == []


def test_building_ggml_at_install_is_best_effort(tmp_path, monkeypatch):
    """Without cmake or a compiler on PATH the install-time build records why and returns; the
    engine's reason then names it."""
    from tandem.engine.model import ggml_build, ggml_kernels

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    line = ggml_build.build_at_install()
    assert line.startswith("ggml: not built at install (RuntimeError: building ggml needs cmake and ")
    assert ggml_build.install_note().startswith("RuntimeError: building ggml needs cmake and ")
    assert not ggml_build.is_built()
    assert ggml_kernels.unavailable().startswith("ggml is not built on this machine: building it at install failed "
                                                 "(RuntimeError: building ggml needs cmake and ")


def test_build_backend_is_setuptools_plus_ggml(monkeypatch):
    """The in-tree build backend (pyproject's backend-path) answers every PEP 517 hook, setuptools' own
    except that building a wheel (editable or not) builds ggml first and asks for the build tools
    the machine lacks."""
    import importlib.util
    from pathlib import Path

    from setuptools import build_meta

    path = Path(__file__).resolve().parents[2] / "_build" / "tandem_build.py"
    spec = importlib.util.spec_from_file_location("tandem_build_under_test", path)
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    for hook in ("prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable", "build_sdist",
                 "get_requires_for_build_sdist"):
        assert getattr(backend, hook) is getattr(build_meta, hook)
    assert backend.build_wheel is not build_meta.build_wheel
    assert backend.build_editable is not build_meta.build_editable
    # Building a wheel also asks for the cmake (and ninja) wheels this machine lacks, and only those.
    for hook in ("get_requires_for_build_wheel", "get_requires_for_build_editable"):
        assert getattr(backend, hook)() == getattr(build_meta, hook)() + backend._build_tools()
    monkeypatch.setattr(backend.shutil, "which", lambda tool: None)
    assert backend._build_tools() == ["cmake>=3.21", "ninja"]
    monkeypatch.setattr(backend.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    assert backend._build_tools() == []


def test_only_relative_paths_inside_the_folder_are_unpacked_from_ggml_sources():
    """Pythons before 3.11.4 have no tar extraction filter, so the unpacking checks paths itself."""
    from tandem.engine.model.ggml_build import _inside

    assert _inside("src/ggml.c") and _inside("include")
    assert not any(_inside(name) for name in ("", "/etc/passwd", "../x", "src/../../x"))
