"""Host (Python) overhead of one engine decode step at large batch, split by phase.

On a GPU a decode step of a small model at batch 48 takes ~1.25 ms of device time, and every
millisecond of Python around it leaves the GPU idle. This script measures that Python on the CPU,
where it is the same code: a 2-layer, 64-wide Llama with random weights makes the forward cheap,
so what remains is scheduling, building inputs, sampling bookkeeping and detokenization.

The model has SmolLM2's vocabulary size (49152) and the engine detokenizes with SmolLM2's real
tokenizer (read offline from the converted `smollm2-135m` preset), so detokenization costs what
it costs with a real byte-level BPE; the tiny byte tokenizer of the random presets would make it
look free. Both are swapped in here, in the benchmark only: a bench-only preset is registered in
`PRESETS`, and the engine's tokenizer and sampling vocabulary are replaced after it is built.

A run adds `--batch` requests of `--prompt-len` random tokens (max_tokens 128, greedy, EOS
ignored), prefills them all, then times `--steps` decode steps. Phases are timed by wrapping the
engine's own methods, so the timed loop is `LLMEngine.step()` itself:

  schedule      Scheduler.schedule (running requests' slot allocation)
  inputs        host-side input building (eager path: ModelRunner.prepare_inputs)
  forward       the model forward and logits (CPU compute here; device time on a GPU)
  sample        Sampler.__call__ (argmax and reading the ids back)
  update        Scheduler.update_from_output (append tokens, token-level stops)
  outputs       OutputProcessor.process_outputs (detokenize, stop strings, RequestOutput objects)
  other         the rest of step()
  host          step minus forward and sample: the Python a faster GPU does not shrink (on the
                CPU `sample` is mostly the argmax over 48 x 49152 logits, a kernel on a GPU)

Times are the main thread's CPU time (`time.thread_time`, the forward runs on that thread with
`--threads 1`), so other processes on a shared machine slow the numbers down less than they
would wall time; `--clock wall` measures wall time instead. `--profile` also prints cProfile's
top functions by cumulative time per step. Results print as a table and go to
`out/host_overhead.json`.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import random
import statistics
import time
from pathlib import Path

VOCAB_SIZE = 49152
PRESET_NAME = "tiny-llama-49k-random"
PHASES = ("schedule", "inputs", "forward", "sample", "update", "outputs")


def register_preset() -> None:
    from tandem.engine.model.presets import _TINY_SHAPE, PRESETS, RandomPreset

    shape = dict(_TINY_SHAPE, vocab_size=VOCAB_SIZE, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
    PRESETS[PRESET_NAME] = RandomPreset(PRESET_NAME, "bench only: tiny Llama, SmolLM2 vocab size",
                                        "llama", shape, std=0.1)


def make_engine(max_active: int, threads: int, real_tokenizer: bool):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.model.loader import models_cache_dir
    from tandem.engine.tokenizer import load_tokenizer

    register_preset()
    engine = LLMEngine(EngineConfig(model=PRESET_NAME, device="cpu", max_active=max_active,
                                    num_threads=threads, max_model_len=1024))
    if real_tokenizer:
        engine.tokenizer = load_tokenizer(models_cache_dir() / "smollm2-135m")
        engine.model_runner.sampler.sampling_vocab_size = None
    return engine


class PhaseTimer:
    """Wraps engine methods (instance attributes shadow the class's) and sums their time."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.totals = dict.fromkeys(PHASES, 0.0)

    def wrap(self, obj, attr: str, phase: str) -> None:
        if not hasattr(obj, attr):
            return
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += self.clock() - t0

        setattr(obj, attr, timed)

    def install(self, engine) -> None:
        runner = engine.model_runner
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "update_from_output", "update")
        self.wrap(engine.output_processor, "process_outputs", "outputs")
        self.wrap(runner, "prepare_inputs", "inputs")
        self.wrap(runner.model, "forward", "forward")
        self.wrap(runner.model, "compute_logits", "forward")
        self.wrap(runner.sampler, "sample", "sample")

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)


def random_prompts(num: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, VOCAB_SIZE - 100) for _ in range(length)] for _ in range(num)]


def add_and_prefill(engine, batch: int, prompt_len: int, rng: random.Random, tag: str) -> None:
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, rng)):
        engine.add_request(f"{tag}-{i}", prompt, params)
    num_first = 0
    while num_first < batch:
        num_first += sum(1 for o in engine.step() if o.usage.completion_tokens == 1 and o.new_token_ids)


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure(engine, timer: PhaseTimer, args, rng: random.Random, tag: str) -> dict:
    add_and_prefill(engine, args.batch, args.prompt_len, rng, tag)
    for _ in range(2):
        engine.step()
    timer.reset()
    times = []
    for _ in range(args.steps):
        t0 = timer.clock()
        engine.step()
        times.append(timer.clock() - t0)
    total = sum(times)
    phases = {k: 1e3 * v / args.steps for k, v in timer.totals.items()}
    phases["other"] = 1e3 * total / args.steps - sum(phases.values())
    drain(engine)
    return {"step_ms_mean": 1e3 * total / args.steps, "step_ms_median": 1e3 * statistics.median(times),
            "host_ms": 1e3 * total / args.steps - phases["forward"] - phases["sample"], "phases_ms": phases}


def profile(engine, args, rng: random.Random, top: int) -> list[dict]:
    add_and_prefill(engine, args.batch, args.prompt_len, rng, "prof")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    drain(engine)
    stats = pstats.Stats(profiler).stats
    rows = [{"fn": f"{Path(f).name}:{line}({name})", "cum_ms": 1e3 * ct / args.steps,
             "self_ms": 1e3 * tt / args.steps, "calls_per_step": nc / args.steps}
            for (f, line, name), (_, nc, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["cum_ms"])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--max-active", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=516)
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per run (< 126)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--byte-tokenizer", action="store_true", help="keep the preset's byte tokenizer")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N")
    parser.add_argument("--label", default="", help="stored in the JSON (e.g. before / after)")
    parser.add_argument("--out", type=Path, default=Path("out/host_overhead.json"))
    args = parser.parse_args()
    if args.steps > 125:
        parser.error("--steps must be < 126 (max_tokens is 128)")

    engine = make_engine(args.max_active, args.threads, not args.byte_tokenizer)
    rng = random.Random(0)
    add_and_prefill(engine, 2, 32, rng, "warm")
    drain(engine)
    timer = PhaseTimer(time.thread_time if args.clock == "cpu" else time.perf_counter)
    timer.install(engine)
    runs = [measure(engine, timer, args, rng, f"run{i}") for i in range(args.runs)]
    result = {"label": args.label, "batch": args.batch, "max_active": args.max_active,
              "prompt_len": args.prompt_len, "steps": args.steps, "threads": args.threads, "clock": args.clock,
              "tokenizer": "byte" if args.byte_tokenizer else "smollm2-135m", "runs": runs,
              "median": {k: statistics.median(r["phases_ms"][k] for r in runs) for k in (*PHASES, "other")}}
    result["median"]["step"] = statistics.median(r["step_ms_mean"] for r in runs)
    result["median"]["host"] = statistics.median(r["host_ms"] for r in runs)
    if args.profile:
        result["profile"] = profile(engine, args, rng, args.profile)

    print(f"host overhead, B={args.batch}, max_active={args.max_active}, {result['tokenizer']} tokenizer, "
          f"{args.runs} runs x {args.steps} decode steps, {args.clock} ms/step")
    cols = (*PHASES, "other", "host", "step")
    print(" ".join(f"{c:>9}" for c in ("run", *cols)))
    for i, r in enumerate(runs):
        vals = [*(r["phases_ms"][k] for k in (*PHASES, "other")), r["host_ms"], r["step_ms_mean"]]
        print(" ".join([f"{i:>9}", *(f"{v:9.3f}" for v in vals)]))
    print(" ".join([f"{'median':>9}", *(f"{result['median'][c]:9.3f}" for c in cols)]))
    for row in result.get("profile", []):
        print(f"{row['cum_ms']:8.3f} {row['self_ms']:8.3f} {row['calls_per_step']:8.1f}  {row['fn']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
