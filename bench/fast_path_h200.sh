#!/usr/bin/env bash
# Issue 5's measurements in one call on the H200 machine (repo root, OUT=<folder>):
# the GPU correctness tests, the full fast-path benchmark, then the CPU decode step again with
# oneDNN kept off AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, faster at decode's few rows, slower
# at prefill), and bench.cpu_step's breakdown and 8 x (516 -> 128) throughput under both.
# Tables go to stdout, JSON under $OUT.
set -uo pipefail
export PYTHONPATH=. OUT="${OUT:-out/fast_path_h200}"
mkdir -p "$OUT"
quiet() { grep -v "USDT\|UserWarning\|_warn_once" || true; }

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_fast_path.py tests/engine/test_model_cuda.py \
  tests/engine/test_attention.py tests/engine/test_cpu_linear.py tests/engine/test_model_runner.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.txt")"

python3 -m bench.fast_path --out "$OUT/default" --sections floor gpu cpu_b4 hf_gpu hf_batch \
  --timeout floor=20 --timeout gpu=140 --timeout cpu_b4=150 --timeout hf_gpu=50 --timeout hf_batch=50 \
  > "$OUT/default.log" 2>&1
echo "fast_path rc=$?"
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python3 -m bench.fast_path --out "$OUT/no_amx" --sections cpu_b4 \
  --timeout cpu_b4=150 > "$OUT/no_amx.log" 2>&1
echo "fast_path (no AMX) rc=$?"

for isa in ALL AVX512_CORE_BF16; do
  cpu_step=(timeout 120 env ONEDNN_MAX_CPU_ISA=$isa python3 -m bench.cpu_step --threads 14 --out "$OUT/cpu_step")
  "${cpu_step[@]}" --tag "_$isa" 2>&1 | quiet | grep -v "^   aten\|^   mkldnn\| [48] threads:"
  "${cpu_step[@]}" --tag "_$isa" --requests 8 --max-tokens 128 2>&1 | quiet
done

cat "$OUT/default/fast_path.md" | grep -v "^Profile\|^  top\|^Host\|^Eager\|^CPU B=4 torch"
grep -A6 "CPU B=4 decode" "$OUT/no_amx/fast_path.md"
