#!/usr/bin/env bash
# Issue 12's measurements in one call on the H200 machine (repo root, OUT=<folder>):
#   bench/engine_w.sh baseline   W alone: throughput, kernel time (profiled run), host phases
#   bench/engine_w.sh check      GPU correctness tests, W (+ halved lengths) with its kernel time
#                                and host phases, then the attention launch-settings sweep
#   bench/engine_w.sh full       GPU correctness tests, then bench.throughput: the no-regression
#                                rows, every row with its busy share, the host phases on W, and
#                                W on the previous path (sync scheduling, eager mixed steps)
# Tables go to stdout, JSON and logs under $OUT. Extra arguments go to bench.throughput.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT="${OUT:-out/engine_w}"
mkdir -p "$OUT"
mode="${1:-full}"
quiet() { grep -v "UserWarning\|_warn_once" || true; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
gpu_tests() {
  timeout "$1" python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_async_cuda.py \
    tests/engine/test_fast_path.py tests/engine/test_model_cuda.py > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?: $(tail -1 "$OUT/pytest.txt")"
  grep -E "^(FAILED|ERROR)|Error:|assert " "$OUT/pytest.txt" | head -20
}
case "$mode" in
  baseline)
    timeout 200 python3 -m bench.throughput --rows W --phases --out "$OUT/tp" "${@:2}" 2>&1 | tee "$OUT/tp.log" | quiet ;;
  check)
    gpu_tests 85
    timeout 85 python3 -m bench.throughput --rows W W_half --profile-rows W --phases --out "$OUT/tp" "${@:2}" 2>&1 \
      | tee "$OUT/tp.log" | quiet
    timeout 30 python3 -m bench.attention_sweep --out "$OUT/attn" 2>&1 | tee "$OUT/attn.log" | quiet ;;
  full)
    gpu_tests "${TEST_TIMEOUT:-60}"
    timeout "${TP_TIMEOUT:-138}" python3 -m bench.throughput --phases --regression --ablation --out "$OUT/tp" \
      "${@:2}" 2>&1 | tee "$OUT/tp.log" | quiet ;;
esac
