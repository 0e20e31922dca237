"""`tandem bench engine`: N concurrent requests through Tandem's engine and through HF transformers,
in one process: same machine, model, device, dtype, torch threads and concurrency.

The design's workload: N requests (default 8) at once, each a 516-token prompt of a shared
496-token prefix of real text plus 20 tokens of its own, 128 greedy tokens each (EOS ignored),
through the engine cold (nothing cached but what the run's own requests share), the engine warm
(a throwaway request cached the prefix first, as when a router sends a repeat prefix to the
backend holding it), and HF `generate` on one batch (TTFT from a StoppingCriteria that
timestamps each step). Both warm up first; each cold run's prefix starts elsewhere in the text.
Output tok/s over the wall time from first submit to last finish, TTFT and E2E p50/p95; with
--repeats the median run (runs interleave the systems). Ratios above 1 favour the engine. Every
run records the CPU other processes took (`other_cpu_cores`); --wait-idle waits for a quiet box.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench._machine import CpuInterference, source_digest, stamp, wait_until_idle
from bench.harness import burst, make_engine, write_json
from bench.hf import hf_generate, hf_model
from bench.metrics import percentile

# Real text for the shared prefix (cycled when a run needs more tokens than it holds).
PASSAGE = (
    "The first lighthouses were not towers at all but fires lit on hilltops, tended through the night "
    "by whoever lived closest to the harbour. Sailors coming home after dark learned to read them the "
    "way a traveller reads a signpost: a fire to the left of the headland meant the channel was clear, "
    "two fires meant the tide was too low to cross the bar. Over centuries the fires moved onto stone "
    "towers, and the towers grew taller so that their light could clear the curve of the sea. Keeping "
    "a light was slow, careful work. The keeper trimmed the wicks every few hours, polished the glass "
    "until no film of soot dimmed it, wound the clockwork that turned the lens, and wrote in the log "
    "the weather, the ships that passed and the hours the lamp was lit. A light that went out for even "
    "an hour could cost a ship, so keepers lived by routine: the same stairs climbed at the same times, "
    "the same checks made in the same order, whatever the season. Engineers, meanwhile, worked on the "
    "light itself. Mirrors behind the flame gathered more of it toward the horizon; then the Fresnel "
    "lens, built from rings of glass prisms, bent nearly all of it into a single flat beam that could "
    "be seen more than twenty miles away. Each station was given its own pattern of flashes, so that "
    "a navigator counting the seconds between them could tell one coast from another. Electric lamps "
    "replaced oil, automatic switches replaced the keeper's rounds, and satellite positioning now tells "
    "most ships where they are long before any light comes into view. Yet many towers still turn their "
    "beams every night, because a signal that needs no receiver, no power on board and no software is "
    "the one that still works when everything else has failed."
)

FULL = dict(num_requests=8, prompt_tokens=516, prefix_tokens=496, max_tokens=128, warmup_tokens=2, repeats=1)
QUICK = dict(num_requests=4, prompt_tokens=48, prefix_tokens=32, max_tokens=8, warmup_tokens=1, repeats=1)
COLD, WARM, HF = "engine (cold)", "engine (warm-prefix)", "HF transformers"


@dataclass
class RunResult:
    """One timed run of one system over the N prompts; times in seconds from first submit."""

    system: str
    wall_s: float
    num_output_tokens: int
    ttft_s: list[float]
    e2e_s: list[float]
    extra: dict = field(default_factory=dict)
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)


def passage_tokens(encode, min_tokens: int) -> list[int]:
    """The passage's token ids, cycled until there are at least `min_tokens`."""
    one = encode(PASSAGE)
    if not one:
        raise RuntimeError("the tokenizer turned the benchmark passage into no tokens")
    return one * (min_tokens // len(one) + 1)


def build_prompts(encode, num_requests: int, prompt_tokens: int, prefix_tokens: int,
                  run_index: int) -> list[list[int]]:
    """N prompts of `prompt_tokens`: one shared prefix of real text, then a distinct tail each.

    The prefix starts `run_index * 37` tokens into the passage, so each run has its own prefix
    (no cross-run prefix-cache hits); each tail opens with its number so tails differ at once.
    """
    suffix_tokens = prompt_tokens - prefix_tokens
    text = passage_tokens(encode, run_index * 37 + prefix_tokens + 2 * suffix_tokens * num_requests)
    start = run_index * 37
    prefix = text[start : start + prefix_tokens]
    prompts = []
    for i in range(num_requests):
        filler = text[start + prefix_tokens + i * suffix_tokens :]
        tail = (encode(f"\n{i + 1}. ") + filler)[:suffix_tokens]
        prompts.append(prefix + tail)
    return prompts


def run_engine(engine, prompts: list[list[int]], max_tokens: int, system: str, tag: str,
               preseed_prefix: list[int] | None = None) -> RunResult:
    """Submit every prompt at once, step until all finish; optionally compute the prefix first
    (with one extra token: a hit is capped at prompt length - 1, and this keeps every block full)."""
    if preseed_prefix is not None:
        burst(engine, [preseed_prefix + preseed_prefix[:1]], 1, f"{tag}-preseed")
    before = _engine_counters(engine)
    probe = CpuInterference()
    run = burst(engine, prompts, max_tokens, tag)
    extra = {k: v - before[k] for k, v in _engine_counters(engine).items()} | probe.stop()
    return RunResult(system, run["wall_s"], run["generated"], run["ttft_s"], run["e2e_s"], extra, run["tokens"])


def _engine_counters(engine) -> dict:
    st = engine.get_stats()
    return {"prefix_cache_hit_tokens": st.prefix_cache_hits, "prefill_time_s": st.prefill_time_s,
            "decode_time_s": st.decode_time_s, "prompt_tokens_computed": st.num_prompt_tokens_total,
            "preemptions": st.num_preemptions}


def run_hf(model, prompts: list[list[int]], max_tokens: int) -> RunResult:
    probe = CpuInterference()
    run = hf_generate(model, prompts, max_tokens)
    n = len(prompts)
    return RunResult(HF, run["wall_s"], run["generated"], [run["ttft_s"]] * n, [run["e2e_s"]] * n, probe.stop(),
                     run["tokens"])


# -- aggregation and report ---------------------------------------------------------------------
def run_metrics(run: RunResult) -> dict:
    return {
        "output_tok_s": run.num_output_tokens / run.wall_s,
        "ttft_p50_s": statistics.median(run.ttft_s),
        "ttft_p95_s": percentile(run.ttft_s, 95),
        "e2e_p50_s": statistics.median(run.e2e_s),
        "e2e_p95_s": percentile(run.e2e_s, 95),
    }


def summarize(runs: list[RunResult]) -> dict:
    """One row from `repeats` runs: each metric is the median over runs of that run's value, so
    one run slowed by another process's burst does not move the row."""
    per_run = [run_metrics(r) for r in runs]
    row = {"system": runs[0].system}
    row |= {key: statistics.median(m[key] for m in per_run) for key in per_run[0]}
    row["runs"] = [{k: v for k, v in asdict(r).items() if k != "output_token_ids"} | m
                   for r, m in zip(runs, per_run)]
    return row


def max_interference(rows: list[dict]) -> float:
    """The most CPU (in cores) other processes took during any timed run."""
    values = [run["extra"].get("other_cpu_cores") for row in rows for run in row["runs"]]
    return max((v for v in values if v is not None), default=0.0)


def add_ratios(rows: list[dict]) -> None:
    hf = next((r for r in rows if r["system"] == HF), None)
    for row in rows:
        if hf is None:
            continue
        row["tok_s_vs_hf"] = row["output_tok_s"] / hf["output_tok_s"]
        row["ttft_p50_vs_hf"] = hf["ttft_p50_s"] / row["ttft_p50_s"]


def format_table(rows: list[dict]) -> str:
    """A Markdown table (also readable in a terminal)."""
    header = ["system", "output tok/s", "TTFT p50 (s)", "TTFT p95 (s)", "E2E p50 (s)", "E2E p95 (s)",
              "tok/s vs HF", "TTFT p50 vs HF"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for r in rows:
        ratios = [f"{r['tok_s_vs_hf']:.2f}x", f"{r['ttft_p50_vs_hf']:.2f}x"] if "tok_s_vs_hf" in r else ["-", "-"]
        times = [f"{r[key]:.3g}" for key in ("ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s")]
        cells = [r["system"], f"{r['output_tok_s']:.1f}", *times, *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def token_agreement(engine_runs: list[RunResult], hf_runs: list[RunResult]) -> dict:
    """How many requests got exactly HF's greedy tokens (same prompts: cold run r vs HF run r)."""
    same = total = 0
    for e, h in zip(engine_runs, hf_runs):
        for a, b in zip(e.output_token_ids, h.output_token_ids):
            same += a == b
            total += 1
    return {"requests_identical": same, "requests_compared": total}


# -- driver -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="preset or a local HF dir (default: smollm2-135m)")
    add("--device", default="cpu", help="cpu | cuda | cuda:N | mps (default: cpu)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on cpu/mps, bfloat16 on cuda (default: auto)")
    add("--threads", type=int, default=None, help="torch threads for both systems (default: torch's)")
    add("--num-requests", "-n", type=int, help=f"concurrent requests N (default: {FULL['num_requests']})")
    add("--prompt-tokens", type=int, help=f"tokens per prompt (default: {FULL['prompt_tokens']})")
    add("--prefix-tokens", type=int, help=f"of which shared by all requests (default: {FULL['prefix_tokens']}); a "
        "multiple of the engine's 16-token block, so exactly the prefix is shareable")
    add("--max-tokens", type=int, help=f"new tokens per request (default: {FULL['max_tokens']})")
    add("--max-active", type=int, default=None, help="engine max_active (default: N)")
    add("--repeats", type=int, help=f"timed runs per system, interleaved; rows show medians ({FULL['repeats']})")
    add("--warmup-tokens", type=int, help=f"new tokens per request in the warm-up run ({FULL['warmup_tokens']})")
    add("--wait-idle", type=float, default=0.0, metavar="S",
        help="before each timed run, wait up to S seconds until other processes use under --idle-cores")
    add("--idle-cores", type=float, default=0.2, help="what --wait-idle counts as idle (default: 0.2 cores)")
    add("--no-warm-prefix", action="store_true", help="skip the warm-prefix engine row")
    add("--no-hf", action="store_true", help="skip HF transformers (engine rows only, no ratios)")
    add("--quick", action="store_true", help="seconds-long smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    add("--out", type=Path, default=Path("out/bench_engine.json"), help="where to write the JSON (%(default)s)")
    add("--no-progress", action="store_true", help="hide the log lines (stderr)")


def _check_args(args: argparse.Namespace) -> None:
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.num_requests, args.max_tokens, args.repeats, args.warmup_tokens) < 1:
        raise SystemExit("error: --num-requests, --max-tokens, --repeats and --warmup-tokens must be >= 1")
    if not 0 < args.prefix_tokens < args.prompt_tokens:
        raise SystemExit(f"error: --prefix-tokens must be in [1, --prompt-tokens); got {args.prefix_tokens} "
                         f"and {args.prompt_tokens}")


def run_all(engine, hf, args: argparse.Namespace) -> dict[str, list[RunResult]]:
    """Warm both systems up, then the timed runs, interleaved so drifting load hits all of them."""
    def prompts_for(run_index: int) -> list[list[int]]:
        return build_prompts(engine.encode, args.num_requests, args.prompt_tokens, args.prefix_tokens, run_index)

    def log(message: str) -> None:
        if not args.no_progress:
            print(message, file=sys.stderr, flush=True)

    def timed(run) -> RunResult:
        waited = wait_until_idle(args.idle_cores, args.wait_idle) if args.wait_idle > 0 else 0.0
        result = run()
        result.extra["waited_for_idle_s"] = round(waited, 1)
        return result

    log(f"warm-up: {args.num_requests} requests x {args.warmup_tokens} tokens through each system")
    warm = prompts_for(0)
    run_engine(engine, warm, args.warmup_tokens, "warm-up engine", "warmup")
    if hf is not None:
        run_hf(hf, warm, args.warmup_tokens)
    runs: dict[str, list[RunResult]] = {COLD: [], WARM: [], HF: []}
    for rep in range(args.repeats):
        log(f"repeat {rep + 1}/{args.repeats}")
        prompts = prompts_for(1 + 2 * rep)
        runs[COLD].append(timed(lambda: run_engine(engine, prompts, args.max_tokens, COLD, f"cold{rep}")))
        if not args.no_warm_prefix:
            seeded = prompts_for(2 + 2 * rep)
            runs[WARM].append(timed(lambda: run_engine(engine, seeded, args.max_tokens, WARM, f"warm{rep}",
                                                       preseed_prefix=seeded[0][: args.prefix_tokens])))
        if hf is not None:
            runs[HF].append(timed(lambda: run_hf(hf, prompts, args.max_tokens)))
    return runs


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    _check_args(args)
    hf_logging.set_verbosity_error()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = make_engine(args.model, args.device, args.max_active or args.num_requests, args.dtype, threads)
    config = engine.config
    hf = None if args.no_hf else hf_model(args.model, args.device, config.torch_dtype)
    runs = run_all(engine, hf, args)
    rows = [summarize(r) for r in runs.values() if r]
    add_ratios(rows)
    result = {
        "benchmark": "engine", **stamp(threads, args.device),
        "engine_source_sha256": source_digest(Path(__file__).resolve().parent.parent / "engine"),
        "config": {
            "model": args.model, "device": args.device, "dtype": str(config.torch_dtype).removeprefix("torch."),
            "threads": threads, "num_requests": args.num_requests, "prompt_tokens": args.prompt_tokens,
            "prefix_tokens": args.prefix_tokens, "max_tokens": args.max_tokens, "max_active": config.max_active,
            "max_num_batched_tokens": config.resolved_max_num_batched_tokens, "block_size": config.block_size,
            "repeats": args.repeats, "warmup_tokens": args.warmup_tokens, "wait_idle_s": args.wait_idle,
            "idle_cores": args.idle_cores},
        "results": rows,
        "engine_vs_hf_tokens": token_agreement(runs[COLD], runs[HF]) if runs[HF] else None,
    }
    print(format_table(rows))
    print(f"\n{result['machine']['cpu_model']}, {threads} torch threads, {args.model} "
          f"{result['config']['dtype']} on {args.device}; {result['command']}; {result['date']}")
    write_json(args.out, result)
    busiest = max_interference(rows)
    if busiest > args.idle_cores:
        print(f"note: other processes used up to {busiest:.2f} CPU cores during a timed run (per-run "
              f"'other_cpu_cores' in the JSON); the numbers above are contended")
    print(f"wrote {args.out}")
    return 0
