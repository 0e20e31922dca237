#!/usr/bin/env bash
# One device call: the served path's HTTP / in-process ratios on this tree and on a "before" tree
# (default: c4ffef4, the typed data path as first measured, whose bench ran as python -m
# bench.served_path --http), back to back, median of 3.
# Usage, on the device after `source .device-ray/activate.sh`:
#   bench/device/served_path_h200.sh [BEFORE_DIR]
# BEFORE_DIR holds `git archive <commit> actors bench cluster engine routing tandem pyproject.toml`
# unpacked (made here, carried along); without it only this tree runs.
set -uo pipefail
out=${OUT:-/tmp/out}
before=${1:-}
args=(--model qwen2.5-0.5b-random --device cuda --dtype bfloat16 --threads 4 --repeats 3
      --capacity-rates 2000 --capacity-clients 8 --ttft-requests 12)
export PYTHONUNBUFFERED=1
if [ -n "$before" ] && [ -d "$before" ]; then
  (cd "$before" && PYTHONPATH="$PWD:${PYTHONPATH#*:}" python3 -m bench.served_path --http "${args[@]}" \
    --out "$out/served-before.json") 2>&1 | tee "$out/served-before.log" | tail -12
fi
python3 -m tandem.cluster.cli bench served-path "${args[@]}" --out "$out/served-after.json" 2>&1 \
  | tee "$out/served-after.log" | tail -12
