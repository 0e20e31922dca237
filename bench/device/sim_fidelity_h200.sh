#!/usr/bin/env bash
# One device call: the cuda backend's sim profile (rates up to max_active 256, context cost, engine
# shape), then the real engine against its sim on nano-vllm's workload, 64 tenants x 4k-token
# prefixes and 516 -> 128 at 64 clients (tandem bench fidelity). Prints both tables.
# Usage, on the device after `source .device-ray/activate.sh`:  bench/device/sim_fidelity_h200.sh
set -uo pipefail
out=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
model=qwen2.5-0.5b-random
python3 -m tandem.cluster.cli profile --model $model --backends cuda --output "$out/rates-h200.json" \
  --sim-profiles "$out" 2>&1 | tail -4
python3 -m tandem.cluster.cli bench fidelity --out "$out/fid" --model $model --device cuda --dtype bfloat16 \
  --profile "$out/cuda0.json" 2>&1 | tee "$out/fidelity.log" | grep -v "^cpu engine" | tail -12
cp "$out/fid/fidelity.json" "$out/fidelity-h200.json" 2>/dev/null
