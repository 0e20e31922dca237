#!/usr/bin/env bash
# One device call: the soak on cuda + cpu, every request kind (structured output and tool calls
# need xgrammar: carry the add-on bundle, see below), one backend killed half-way; checks 0 lost,
# 0 hung, memory flat and p99 stable, and prints the report's verdict table.
# Usage, on the device:
#   source .device-ray-small/activate.sh && source .device-xgr/activate.sh && bench/device/soak_h200.sh
# (.device-ray-small plus .device-xgr, made by bench/device/xgrammar_addon.sh, fit the 64 MiB the tree
# travels in; the full bundle barely does.) 480 s of traffic: the whole call stays under 600 s.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import xgrammar" || { echo "xgrammar is missing: structured-output requests would count as lost"; exit 2; }
python3 -m tandem.cluster.cli bench soak --model qwen2.5-0.5b-random "--flags=${FLAGS:---backends cuda,cpu}" \
  --duration-s "${DURATION_S:-480}" --interval-s 60 --clients 16 --kill-backend-at-s 240 --idle-wait-s 20 \
  --start-timeout-s 300 --out "$out" --stem soak-h200 2>&1 | tee "$out/soak.log" | tail -30
