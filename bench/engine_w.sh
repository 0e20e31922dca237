#!/usr/bin/env bash
# Issue 12's measurements in one call on the H200 machine (repo root, OUT=<folder>):
#   bench/engine_w.sh baseline   W alone: throughput, kernel time (profiled run), host phases
#   bench/engine_w.sh full       GPU correctness tests, then every row of bench.throughput with
#                                its busy share, the host phases on W, and the no-regression rows
# Tables go to stdout, JSON and logs under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT="${OUT:-out/engine_w}"
mkdir -p "$OUT"
mode="${1:-full}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ "$mode" = baseline ]; then
  timeout 200 python3 -m bench.throughput --rows W --phases --out "$OUT/tp" "${@:2}" 2>&1 | tee "$OUT/tp.log" \
    | grep -v "UserWarning\|_warn_once"
  exit
fi
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_fast_path.py tests/engine/test_model_cuda.py \
  tests/engine/test_async_cuda.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.txt")"
grep -E "FAILED|Error" "$OUT/pytest.txt" | head -20
timeout "${TP_TIMEOUT:-170}" python3 -m bench.throughput --phases --regression --out "$OUT/tp" "${@:2}" 2>&1 \
  | tee "$OUT/tp.log" | grep -v "UserWarning\|_warn_once"
