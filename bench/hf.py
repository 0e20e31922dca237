"""HF transformers, the baseline the engine-level benches measure Tandem against, driven the way a
user drives it: eager decode steps on a DynamicCache, one prompt's prefill, and `generate` on one
static batch (greedy, EOS switched off, every step timestamped)."""

from __future__ import annotations

import time
from typing import Any

from bench.harness import median_ms, sync_device


def hf_model(name: str, device: str, dtype: Any, attn: str = "sdpa", shape_only: bool = False) -> Any:
    """HF's model of preset `name` with the engine's exact weights; with `shape_only`, a random
    preset is initialised on the device in its shape instead (seconds on a GPU instead of a minute
    on the CPU; speed does not depend on the values)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.model.loader import load_model
    from tandem.engine.model.presets import PRESETS, RandomPreset, build_hf_model, get_preset

    if not isinstance(PRESETS.get(name), RandomPreset):  # converted on first use to the directory our loader reads
        return AutoModelForCausalLM.from_pretrained(load_model(name, "cpu", dtype).hf_path, dtype=dtype,
                                                    attn_implementation=attn).to(device).eval()
    if not shape_only:
        return build_hf_model(name).to(device=device, dtype=dtype).eval()
    with torch.device(device):
        return AutoModelForCausalLM.from_config(get_preset(name).hf_config(), dtype=dtype,
                                                attn_implementation=attn).eval()


def hf_decoder(model: Any, prompts: list[list[int]]) -> Any:
    """After a prefill of `prompts` (one batch of equal lengths), a function that runs one eager
    decode step and reads the argmax ids back, as `generate`'s stopping check does."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor(prompts, device=model.device), use_cache=True, logits_to_keep=1)
    state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step() -> None:
        with torch.inference_mode():
            out = model(input_ids=state["next"], past_key_values=state["past"], use_cache=True)
            state["past"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            state["next"].tolist()

    return step


def hf_decode_ms(model: Any, prompts: list[list[int]], steps: int) -> float:
    """Median ms of one decode step of the batch, after two untimed ones."""
    return median_ms(hf_decoder(model, prompts), steps, warmup=2)


def hf_prefill_ms(model: Any, prompts: list[list[int]]) -> float:
    """Median ms from one prompt to its first token, over `prompts` after the first (a warm-up)."""
    import torch

    times = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            sync_device()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]


def hf_generate(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One batch of equal-length prompts through `generate`, greedy, exactly `max_tokens` each:
    the wall time, each step's time from the start (one TTFT and one end for every request of
    the batch) and the tokens."""
    import torch
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the HF baseline needs prompts of equal length (no padding)")
    input_ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    # generate() fills unset (None) fields from model.generation_config, so EOS is switched off
    # there; a config with eos_token_id=None passed in would get the model's EOS back.
    model.generation_config.eos_token_id = None
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    times: list[float] = []

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.inference_mode():
        sync_device()
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                             stopping_criteria=StoppingCriteriaList([StepClock()]))
        wall = time.perf_counter() - start
    if len(times) != max_tokens:
        raise RuntimeError(f"HF generate ran {len(times)} steps, expected {max_tokens}")
    return {"wall_s": wall, "generated": len(prompts) * max_tokens, "tok_s": len(prompts) * max_tokens / wall,
            "ttft_s": times[0] - start, "e2e_s": times[-1] - start, "tokens": out[:, input_ids.shape[1]:].tolist()}
