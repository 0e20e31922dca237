# Shared set-up of the H200 served-path scripts (sourced, from the repo root, after
# `source .device-ray/activate.sh`): $OUT, the environment, py-spy if carried, the model flags
# ($M), `quiet` (drops Ray's per-process and warning lines) and `cores` (engine core processes).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONUNBUFFERED=1
[ -x .device-ray/bin/py-spy ] && export PATH="$PWD/.device-ray/bin:$PATH"
M="--model qwen2.5-0.5b-random --device cuda --dtype bfloat16"
quiet() { grep -v "pid=\|Warning\|warn(\|INFO\|^\s*$" || true; }
cores() { ps -eo pid,args | grep "[s]pawn_main" | grep -v grep || true; }
