"""The compiled CPU decode step (torch.compile, inductor CPU) generates what the eager few-op layers do.

Compiling takes tens of seconds on two cores, so one engine per quantized mode compiles its
graphs once (kept in a per-session inductor cache) and the tests share it.
"""

import pytest
import torch

from tandem.engine.model.cpu_compile import compiler_available
from tandem.engine.model.quant import available
from tests.conftest import build_ggml_or_skip, greedy_tokens

pytestmark = pytest.mark.skipif(not compiler_available(), reason="torch.compile's CPU backend needs a C++ compiler")

PROMPTS = [list(range(10 + i, 40 + 3 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def _config(dtype, compile_decode, max_active=4, kernels="torch"):
    from tandem.engine.config import EngineConfig

    return EngineConfig(model="tiny-qwen2-random", dtype=dtype, max_active=max_active, cpu_compile=compile_decode,
                        cpu_kernels=kernels)


@pytest.mark.parametrize("dtype", ["int4", "int8", "bfloat16", "int4-ggml"])
def test_compiled_decode_matches_eager_greedy_tokens(dtype, inductor_cache):
    dtype, _, kernels = dtype.partition("-")
    if kernels == "ggml":
        build_ggml_or_skip()
    elif dtype in ("int4", "int8") and not available(dtype):
        pytest.skip(f"this torch build has no {dtype} CPU kernel")
    engine, compiled = greedy_tokens(_config(dtype, True, kernels=kernels or "torch"), PROMPTS, max_tokens=16)
    runner = engine.model_runner
    assert runner.cpu_decode is not None and runner.cpu_decode.compile_s > 0
    _, eager = greedy_tokens(_config(dtype, False, kernels=kernels or "torch"), PROMPTS, max_tokens=16)
    assert compiled == eager


def test_compiled_decode_logits_match_the_eager_forward(inductor_cache):
    """One decode row over a context that spans blocks, against the eager layers' logits."""
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(_config("int4", True, max_active=1))
    engine.add_request("r", list(range(5, 40)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill, eager
    runner = engine.model_runner
    request = engine.scheduler.running[0]
    position = request.num_computed_tokens
    tables = [engine.kv_cache_manager.get_block_ids("r")]
    inputs = runner.cpu_decode.inputs([request.all_token_ids[position]], [position], tables)
    with torch.inference_mode():
        compiled = runner.cpu_decode(*inputs)
        saved = [c.clone() for c in runner.kv_caches]
        decode = runner.cpu_decode
        runner.cpu_decode = None  # the eager path for the same step
        scheduled = engine.scheduler.schedule()
        ids, pos, meta = runner.prepare_inputs(scheduled, engine.kv_cache_manager)
        eager = runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta))
        runner.cpu_decode = decode
    for ours, theirs in zip(saved, runner.kv_caches):  # the same K/V were written, to bf16 rounding
        torch.testing.assert_close(ours, theirs, atol=0.02, rtol=0.02)
    torch.testing.assert_close(compiled, eager, atol=0.05, rtol=0.02)


def test_cpu_compile_is_for_cpu_engines_with_the_few_op_layers():
    from tandem.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(model="tiny-qwen2-random", device="cuda", cpu_compile=True)
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(model="tiny-qwen2-random", pack_cpu_weights=False, cpu_compile=True)
