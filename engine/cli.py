"""`tandem generate`: one request through an in-process engine, printed as text or JSON.

It is the quickest check that a model loads and generates on a device, and the reference the
HTTP tests compare the server's greedy output against.
"""

from __future__ import annotations

import argparse
import json
import sys

from tandem.engine.config import CPU_KERNELS, DEFAULT_MODEL, EngineConfig
from tandem.engine.sampling_params import InvalidRequestError, SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"preset name, local HF directory or .gguf file (default {DEFAULT_MODEL})")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="0 is off (default 0)")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default cpu)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16, or int8 / int4 (cpu: quantized weights)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the cpu")
    parser.add_argument("--cpu-compile", action="store_true",
                        help="cpu, opt-in: decode through torch.compile'd graphs (needs a C++ compiler; the "
                             "first run compiles, later runs load the cache). Faster on some CPUs, much slower on "
                             "others: measure first")
    parser.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                        help="cpu: whose kernels. auto: float32 decode steps through ggml's graph where ggml "
                             "was built at install, the rest eager. With --dtype int8/int4, ggml: "
                             "llama.cpp's own (built once from llama-cpp-python's sources; GGUF blocks used as "
                             "they are), faster per decode row on AVX2 CPUs. "
                             "ggml-graph (int8, int4 or float32): ggml's linears, and each decode step run as "
                             "one ggml graph, llama.cpp's speed per token (no compiling; not with --cpu-compile)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true",
                        help="print text, output token ids, finish reason and usage as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                ignore_eos=args.ignore_eos, stop=args.stop)
        result = generate(args.prompt, params, EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, num_threads=args.threads,
            cpu_compile=args.cpu_compile, cpu_kernels=args.cpu_kernels),
            chat=args.chat)
    except (InvalidRequestError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def generate(prompt: str, params: SamplingParams, config: EngineConfig, chat: bool = False) -> dict:
    from tandem.engine.llm_engine import LLMEngine

    params.validate()  # an edge: the engine checks only what only it knows (engine/sampling_params.py)
    engine = LLMEngine(config)
    prompt_ids = engine.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    engine.add_request("generate-0", prompt_ids, params)
    text, token_ids, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text.append(out.new_text)
            token_ids.extend(out.new_token_ids)
            final = out
    return {
        "text": "".join(text),
        "token_ids": token_ids,
        "finish_reason": final.finish_reason,
        "usage": {"prompt_tokens": final.usage.prompt_tokens,
                  "completion_tokens": final.usage.completion_tokens,
                  "cached_tokens": final.usage.cached_tokens},
    }
