"""Measure one engine's rates, alone: what the router's cost model reads as a backend's speed.

`measure_rates` drives a bare `LLMEngine` (no Ray, no other load) the way the router's cost
model reads rates: prefill tok/s on a long prompt that cannot hit the prefix cache, and
aggregate decode tok/s at batch sizes from 1 to `max_active` (the batch-aware table; its
batch-1 entry is the design's isolated decode rate). The sizes are the powers of two up to
`max_active` and `max_active` itself: the router interpolates between them
(routing/rates.py), and a GPU engine at max_active 256 profiles 10 sizes instead of 256. Times come from the engine's own per-step
timer, and a step counts as prefill or decode only if it did nothing else. Every shape is run
once untimed first: a GPU backend compiles kernels and captures graphs on first use, and
timing that would make a GPU's prefill look many times slower than it is, sending the CPU work
the GPU would finish sooner.

The whole measurement is repeated (`repeats`, 3 by default) and each rate is the median over
the repeats, so one disturbed run does not become the profile (a single run can put two
identical GPUs a third apart). The result says how far the repeats spread (`spread`: (max -
min) / median of each rate, the decode table's worst batch size), so a caller can warn when
the measurement itself was not steady.

It lives in the engine layer because it needs nothing but an engine; the backend actor calls it
and the cluster layer caches its results and shares one profile between identical devices
(cluster/profile.py).
"""

from __future__ import annotations

import random
from typing import Any

from tandem.engine.sampling_params import SamplingParams

# Bumped when the engine gets much faster or slower, so cached rates from before are not reused
# (2: oneDNN-packed CPU linears; 3: the CPU decode's context gather by whole blocks;
# 4: asynchronous scheduling and graphed prefill/mixed steps on cuda; 5: few-op CPU decoder
# layers and the byte-table detokenizer).
ENGINE_SPEED_VERSION = 5


def measure_rates(engine: Any, max_active: int, prompt_len: int = 512, decode_tokens: int = 16,
                  seed: int = 0, prefill_repeats: int = 3, repeats: int = 3) -> dict[str, Any]:
    """Rates in routing's RateProfile fields (prefill_tok_s, decode_tok_s, decode_tok_s_by_batch,
    and reload_tok_s for an engine with a host KV tier), medians over `repeats`, plus `spread`: {"repeats", "prefill_tok_s", "decode_tok_s_by_batch"}."""
    rng = random.Random(seed)
    num_tokens = min(engine.model_config.vocab_size, len(engine.tokenizer))
    prompt_len = max(16, min(prompt_len, engine.max_model_len - decode_tokens - 2))

    def prompt(n: int) -> list[int]:  # random ids: no two prompts share a first block
        return [rng.randrange(3, num_tokens) for _ in range(n)]

    _run(engine, [prompt(prompt_len)], max_tokens=2)  # warm-up: kernels for this prefill shape
    sizes = profiled_batch_sizes(max_active)
    for batch in sizes:
        _run(engine, [prompt(16) for _ in range(batch)], max_tokens=3)  # warm-up: this batch size
    prefill_runs: list[float] = []
    decode_runs: dict[int, list[float]] = {batch: [] for batch in sizes}
    for _ in range(max(1, repeats)):
        prefill_runs.append(_median([tokens / seconds for tokens, seconds in
                                     (_run(engine, [prompt(prompt_len)], max_tokens=1)[0]
                                      for _ in range(prefill_repeats))]))
        for batch, runs in decode_runs.items():
            _, (decode_tok, decode_s) = _run(engine, [prompt(16) for _ in range(batch)], max_tokens=decode_tokens)
            runs.append(decode_tok / decode_s)
    engine.drain_progress()  # profile requests are nobody's business
    by_batch = {batch: round(_median(runs), 3) for batch, runs in decode_runs.items()}
    reload = _reload_rate(engine)
    return {"prefill_tok_s": round(_median(prefill_runs), 3), "decode_tok_s": by_batch[1],
            "decode_tok_s_by_batch": by_batch, **({"reload_tok_s": reload} if reload else {}),
            "spread": {"repeats": len(prefill_runs), "prefill_tok_s": round(_spread(prefill_runs), 4),
                       "decode_tok_s_by_batch": round(max(_spread(runs) for runs in decode_runs.values()), 4)}}


def _reload_rate(engine: Any) -> float | None:
    """A host KV tier's reload rate in prompt tokens/s (routing's `reload_tok_s`); None without a tier."""
    host = getattr(engine.model_runner, "host_kv_cache", None)
    if host is None:
        return None
    return round(host.measure_reload_tok_s(engine.config.block_size), 3)


def measure_context_cost(engine: Any, context_len: int = 1024, decode_tokens: int = 16, seed: int = 1,
                         repeats: int = 3, batch: int | None = None) -> float:
    """Seconds a decode step gains per context token of its batch: decode steps of `batch`
    sequences (default: the largest batch the cache holds twice over) at `context_len` tokens
    against the same at 16, the difference spread over the batch's extra context (median of
    `repeats`; 0 when longer contexts measured no slower). The rates leave this out (their
    prompts are short); an emulated device adds it back (routing/step_time.py).

    Each batch's prompts are prefilled once first, so the measured run finds them cached and
    prefills only their last blocks, in one step: its decode steps are then all at the full
    batch. (Prefilled in the measured run, the first prompts decode beside the others' prefill
    in mixed steps, which do not count, and finish before the pure decode steps that do, so
    those run at a smaller batch than the one the time is divided by.)"""
    rng = random.Random(seed)
    num_tokens = min(engine.model_config.vocab_size, len(engine.tokenizer))
    context_len = _context_len(engine, context_len, decode_tokens)
    largest = _largest_context_batch(engine, context_len, decode_tokens)
    batch = largest if batch is None else max(1, min(batch, largest))

    def step_s(prompt_len: int) -> float:
        prompts = [[rng.randrange(3, num_tokens) for _ in range(prompt_len)] for _ in range(batch)]
        _run(engine, prompts, max_tokens=1)  # into the prefix cache
        _, (decode_tok, decode_s) = _run(engine, prompts, max_tokens=decode_tokens)
        return decode_s / decode_tok * batch  # every decode step at the full batch

    step_s(context_len)  # warm-up: this batch's shapes at a long context
    costs = [(step_s(context_len) - step_s(16)) / (batch * (context_len - 16)) for _ in range(max(1, repeats))]
    engine.drain_progress()
    return max(0.0, _median(costs))


def measure_context_cost_by_batch(engine: Any, context_len: int = 1024, decode_tokens: int = 16,
                                  repeats: int = 3) -> dict[int, float]:
    """`measure_context_cost` at batches 1, 4, 16, 64, ... up to the largest the cache holds
    twice over (and that one): a decode step's attention spreads its work over the batch's
    sequences, so a small batch of long contexts pays more per context token than a large one."""
    context_len = _context_len(engine, context_len, decode_tokens)
    largest = _largest_context_batch(engine, context_len, decode_tokens)
    batches = sorted({*(4 ** i for i in range(largest.bit_length()) if 4 ** i <= largest), largest})
    return {b: measure_context_cost(engine, context_len, decode_tokens, seed=b, repeats=repeats, batch=b)
            for b in batches}


def _context_len(engine: Any, context_len: int, decode_tokens: int) -> int:
    return max(32, min(context_len, engine.max_model_len - decode_tokens - 2))


def _largest_context_batch(engine: Any, context_len: int, decode_tokens: int) -> int:
    """The most sequences of `context_len` tokens the cache holds twice over, up to max_active."""
    room = engine.kv_cache_manager.num_usable_blocks * engine.config.block_size
    return max(1, min(engine.config.max_active, room // (context_len + decode_tokens) // 2))


def measure_sim_extras(engine: Any, context_len: int = 1024, decode_tokens: int = 16, repeats: int = 3) -> dict:
    """What a sim profile holds beyond the rates (routing/step_time.py's `SimProfile`): the
    context cost by batch (and at the largest batch, for one figure), the prefill rate by step
    size, and the engine's shape."""
    by_batch = measure_context_cost_by_batch(engine, context_len, decode_tokens, repeats)
    return {"decode_s_per_context_token": by_batch[max(by_batch)], "decode_s_per_context_token_by_batch": by_batch,
            "prefill_tok_s_by_tokens": measure_prefill_table(engine, repeats=repeats), **engine_shape(engine)}


def measure_prefill_table(engine: Any, repeats: int = 3, seed: int = 2) -> dict[int, float]:
    """Aggregate prefill tok/s of one step by its size: 64 tokens (a prefix hit's suffix, where a
    step's fixed cost dominates), 512, a quarter and all of the engine's step budget
    (`max_num_batched_tokens`); a step over 512 tokens is several 512-token prompts, as under
    load. Median of `repeats`; the rates' one prefill rate is the 512-token step's."""
    rng = random.Random(seed)
    num_tokens = min(engine.model_config.vocab_size, len(engine.tokenizer))
    budget = engine.config.resolved_max_num_batched_tokens
    prompt_len = min(512, engine.max_model_len - 2, budget)
    sizes = sorted({min(64, prompt_len), prompt_len, max(prompt_len, budget // 4 // prompt_len * prompt_len),
                    max(prompt_len, budget // prompt_len * prompt_len)})
    table = {}
    for size in sizes:
        length = min(size, prompt_len)
        num_prompts = max(1, min(size // length, engine.config.max_active))
        runs = []
        for i in range(max(1, repeats) + 1):  # the first is untimed: kernels and graphs for this shape
            prompts = [[rng.randrange(3, num_tokens) for _ in range(length)] for _ in range(num_prompts)]
            (tokens, seconds), _ = _run(engine, prompts, max_tokens=1)
            if i:
                runs.append(tokens / seconds)
        table[num_prompts * length] = round(_median(runs), 3)
    engine.drain_progress()
    return table


def engine_shape(engine: Any) -> dict[str, int]:
    """The engine a profile was measured on, which an emulated device takes as its defaults."""
    cfg = engine.config
    return {"max_active": cfg.max_active, "num_kv_tokens": engine.num_kv_tokens,
            "max_num_batched_tokens": cfg.resolved_max_num_batched_tokens}


def profiled_batch_sizes(max_active: int) -> list[int]:
    """1, 2, 4, ... up to `max_active`, and `max_active` itself."""
    sizes = [1 << i for i in range(max(1, max_active).bit_length()) if 1 << i <= max_active]
    return sorted({*sizes, max(1, max_active)})


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _spread(values: list[float]) -> float:
    """(max - min) / median: 0 for one value, 0.1 when the repeats span 10% of their median."""
    return (max(values) - min(values)) / _median(values)


def _run(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[tuple[int, float], tuple[int, float]]:
    """Run prompts to completion; returns (prefill tokens, s) and (decode tokens, s) of pure steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"profile-{id(prompts)}-{i}", ids, params)
    prefill = [0, 0.0]
    decode = [0, 0.0]
    while engine.has_unfinished_requests():
        before = _token_totals(engine)
        engine.step()
        st = engine.get_stats()
        if _token_totals(engine) == before:  # no model run this step
            continue
        if st.step_prefill_tokens and not st.step_decode_tokens:
            prefill[0] += st.step_prefill_tokens
            prefill[1] += st.step_time_s
        elif st.step_decode_tokens and not st.step_prefill_tokens:
            decode[0] += st.step_decode_tokens
            decode[1] += st.step_time_s
    return (prefill[0], prefill[1] or 1e-9), (decode[0], decode[1] or 1e-9)


def _token_totals(engine: Any) -> tuple[int, int]:
    st = engine.get_stats()
    return st.num_prompt_tokens_total, st.num_generation_tokens_total
