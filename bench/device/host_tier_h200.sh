#!/usr/bin/env bash
# One device call per part: the host KV tier on the tenants workload (tandem bench tenants through
# HTTP), with the GPU's KV cache holding a quarter of the tenants' prefixes and the host tier all
# of them, at light load and past saturation; then prints one table from the summaries.
#   single: one engine, `cost`, tier off against on (the tier's own effect)
#   fit:    one engine, `cost`, the default KV cache (every prefix fits), tier off against on (no loss)
#   shared: two engines on the GPU with the tier, cost against prefix-affinity and round-robin
# Usage, on the device after `source .device-ray/activate.sh`:  bench/device/host_tier_h200.sh PART
# BACKEND=sim SIM_PROFILE=FILE runs the same commands on emulated devices (a dry run without a GPU).
set -uo pipefail
part=${1:-single}
out=${OUT:-/tmp/out}
backend=${BACKEND:-cuda}
model=${MODEL:-qwen2.5-0.5b-random}
tenants=${TENANTS:-64}
prefix=${PREFIX_TOKENS:-4096}
rates=${RATES:-4,24}
duration=${DURATION_S:-15}
runs=${RUNS:-2}
max_active=${MAX_ACTIVE:-16}
host_gb=${HOST_GB:-6}  # every prefix: 64 x 4096 tokens x 12 KiB (qwen2.5-0.5b, bf16) = 3 GiB, pinned twice at most
# A quarter of the prefixes on the GPU, plus room for the running requests' own blocks.
quarter=$(( tenants * prefix / 16 / 4 + max_active * 16 ))
export PYTHONUNBUFFERED=1
mkdir -p "$out"
common=(--model "$model" --tenants "$tenants" --prefix-tokens "$prefix" --suffix-tokens 64 --max-tokens 64
        --arrival-rates "$rates" --duration-s "$duration" --runs "$runs" --max-active "$max_active" --drain-timeout-s 120
        --time-budget-s 560 ${SIM_PROFILE:+--sim-profile "$SIM_PROFILE"})
run() {  # NAME ARGS...: one bench tenants run, its log kept, its summary read by the table below
  local name=$1; shift
  python3 -m tandem.cluster.cli bench tenants --out "$out/$name" "${common[@]}" "$@" > "$out/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -20 "$out/$name.log"; }
}
case $part in
  single)
    run single-off --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb 0
    run single-on --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb "$host_gb" ;;
  fit)
    run fit-off --backends "$backend" --arms cost --kv-host-memory-gb 0
    run fit-on --backends "$backend" --arms cost --kv-host-memory-gb "$host_gb" ;;
  shared)
    run shared-on --backends "$backend*2" --arms cost,prefix-affinity,round-robin \
      --num-kv-blocks "$(( quarter / 2 ))" --kv-host-memory-gb "$(( host_gb / 2 ))" ;;
  *) echo "part: single, fit or shared"; exit 2 ;;
esac
python3 - "$out" <<'PY'
import json, pathlib, sys
print(f"{'run':<11} {'cell':<18} {'arm':<16} {'hit':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>8}  (mean of runs)")
for summary in sorted(pathlib.Path(sys.argv[1]).glob("*/summary.json")):
    for cell in json.loads(summary.read_text())["cells"]:
        for arm, m in cell["arms"].items():
            print(f"{summary.parent.name:<11} {cell['cell']:<18} {arm:<16} {m['hit_rate']['mean']:>6.3f} "
                  f"{m['ttft_p50_s']['mean']:>8.3f}s {m['ttft_p90_s']['mean']:>8.3f}s {m['output_tok_s']['mean']:>8.0f}")
PY
