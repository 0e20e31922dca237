#!/usr/bin/env bash
# One device call: deadlines and priorities past saturation (issue: urgent p95 TTFT meets its
# deadline where FCFS misses it, batch throughput within 10% of FCFS's, refusals in < 5 ms).
# Two engines share the GPU at max_active 8 (saturation about 55-60 req/s on an H200); 20%
# urgent (64 -> 16, 500 ms TTFT deadline) among batch (256 -> 128); loads from light to 1.5x
# saturation; four client processes; every server process's CPU sampled each second, so a
# stall names the process that ran out of CPU. Prints the bench's tables.
# Usage, on the device after `source .device-ray/activate.sh`:  bench/device/deadlines_h200.sh
# Refusals (429 with Retry-After) need more urgent work than the engines start within the deadline:
#   LOADS=150,300 URGENT_SHARE=0.8 DEADLINE_MS=100 DURATION_S=10 bench/device/deadlines_h200.sh
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m tandem.cluster.cli bench deadlines --model qwen2.5-0.5b-random --backends "${BACKENDS:-cuda*2}" --max-active 8 \
  --loads "${LOADS:-16,40,64,88}" --duration-s "${DURATION_S:-15}" --deadline-ms "${DEADLINE_MS:-500}" \
  --urgent-share "${URGENT_SHARE:-0.2}" --client-procs 4 \
  --routing-log "$out/routing.jsonl" --out "$out/deadlines.json" 2>&1 | tee "$out/deadlines.log" | grep -v "^\s*$" | tail -40
