#!/usr/bin/env bash
# One device call: what a step with long contexts costs, on this tree and on a "before" tree,
# back to back. A step whose programs are too few to fill the GPU splits every context over
# several of them (engine/attention/triton_paged.py); the before tree split only the contexts of
# steps of decodes alone, and walked every other row's whole context in one program per KV head
# and query tile. Per tree: the engine's wall ms per step (public LLMEngine API,
# qwen2.5-0.5b-random in bf16) with N requests decoding at a C-token context, in steps with no
# arrival (decode) and in steps that each prefill one new 64-token prompt (mixed), fresh or on top
# of a cached 4,096-token prefix (a tenant's prompt on a prefix hit); then workload W's
# throughput (tandem bench throughput --rows W), whose steps hold many programs.
# The CUDA attention and engine tests run first, on this tree.
# Usage, on the device after `source .device-ray/activate.sh`:
#   bench/device/mixed_decode_h200.sh [BEFORE_DIR]
# BEFORE_DIR holds `git archive <commit> actors bench cluster engine routing tandem pyproject.toml`
# unpacked (made here, carried along); without it only this tree runs. TESTS=0 skips the tests and
# W=0 workload W (the step timings alone, for a short call).
set -uo pipefail
out=${OUT:-/tmp/out}
before=${1:-}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/engine/test_async_cuda.py \
  tests/engine/test_fast_path.py tests/engine/test_model_cuda.py tests/engine/test_host_tier_cuda.py 2>&1 \
  | tee "$out/cuda-tests.log" | tail -3
measure() {  # LABEL DIR: the step timings, then W, with DIR's code
  local label=$1 dir=$2
  (cd "$dir" && PYTHONPATH="$PWD:${PYTHONPATH#*:}" python3 - "$label" "$out/steps-$label.json" <<'PY'
import json, random, statistics, sys, time
import torch
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

label, path = sys.argv[1], sys.argv[2]
engine = LLMEngine(EngineConfig(model="qwen2.5-0.5b-random", device="cuda", dtype="bfloat16", max_active=72))
rng = random.Random(0)
rows = []
shared = [rng.randrange(3, 30000) for _ in range(4096)]  # the hit arrivals' cached prefix
engine.add_request(f"{label}-prefix", shared, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()
for num_decodes, context, arrival in ((16, 4096, "fresh"), (16, 4096, "hit"), (16, 512, "fresh"), (64, 2048, "fresh")):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ids = [f"{label}-{context}-{arrival}-{i}" for i in range(num_decodes)]
    for req_id in ids:
        engine.add_request(req_id, [rng.randrange(3, 30000) for _ in range(context)], long)
    started = set()
    while len(started) < num_decodes:  # every long request past its prefill
        started.update(o.req_id for o in engine.step() if o.new_token_ids)

    def period_ms(steps, arrive):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            if arrive:
                prompt = [rng.randrange(3, 30000) for _ in range(64)]
                engine.add_request(f"{ids[0]}-p{i}-{rng.random()}", shared + prompt if arrival == "hit" else prompt,
                                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps * 1e3

    runs = {"decode": [], "mixed": []}
    for _ in range(3):
        runs["decode"].append(period_ms(20, False))
        runs["mixed"].append(period_ms(20, True))
    for req_id in ids:
        engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()
    row = {"decodes": num_decodes, "context": context, "arrival": arrival,
           **{k: statistics.median(v) for k, v in runs.items()}, "runs": runs}
    rows.append(row)
    print(f"{label}: {num_decodes} decodes at {context} tokens, {arrival} 64-token arrivals: decode step "
          f"{row['decode']:.2f} ms, mixed step {row['mixed']:.2f} ms", flush=True)
json.dump({"label": label, "rows": rows}, open(path, "w"), indent=1)
PY
  ) 2>&1 | tee "$out/steps-$label.log" | grep -v Warning | tail -4
  [ "${W:-1}" = 0 ] || (cd "$dir" && PYTHONPATH="$PWD:${PYTHONPATH#*:}" python3 -m tandem.cluster.cli bench \
    throughput --rows W --no-profile --out "$out/w-$label") 2>&1 | tail -4
}
[ -n "$before" ] && [ -d "$before" ] && measure before "$before"
measure after "$PWD"
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem[6:]: json.loads(p.read_text()) for p in sorted(out.glob("steps-*.json"))}
print(f"{'tree':<7} {'decodes':>7} {'context':>7} {'arrival':>7} {'decode ms':>9} {'mixed ms':>9}  (median of 3 x 20 steps)")
for label, run in runs.items():
    for r in run["rows"]:
        print(f"{label:<7} {r['decodes']:>7} {r['context']:>7} {r['arrival']:>7} {r['decode']:>9.2f} {r['mixed']:>9.2f}")
PY
