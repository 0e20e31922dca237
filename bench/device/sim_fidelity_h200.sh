#!/usr/bin/env bash
# One device call: the cuda backend's sim profile (rates up to max_active 256, context cost, engine
# shape), then the real engine against its sim on nano-vllm's workload, 64 tenants x 4k-token
# prefixes and 516 -> 128 at 64 clients (tandem bench fidelity), with the profile as measured and
# with its context cost left out. Prints the tables.
# Usage, on the device after `source .device-ray/activate.sh`:  bench/device/sim_fidelity_h200.sh
set -uo pipefail
out=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
model=qwen2.5-0.5b-random
python3 -m tandem.cluster.cli profile --model $model --backends cuda --output "$out/rates-h200.json" \
  --sim-profiles "$out" 2>&1 | tail -3
python3 - "$out/cuda0.json" "$out/cuda0-noctx.json" <<'PY'
import json, sys
profile = json.load(open(sys.argv[1]))
print("context cost", profile["decode_s_per_context_token"], "s per token per step")
json.dump({**profile, "decode_s_per_context_token": 0.0}, open(sys.argv[2], "w"), indent=1)
PY
for variant in cuda0 cuda0-noctx; do
  python3 -m tandem.cluster.cli bench fidelity --out "$out/fid-$variant" --model $model --device cuda \
    --dtype bfloat16 --profile "$out/$variant.json" 2>&1 | tee "$out/fidelity-$variant.log" | grep "^|"
done
