#!/usr/bin/env bash
# The served path on the H200 machine in one call (see docs/benchmarks/served-path-h200.md):
# the in-process engine vs `tandem serve`'s HTTP API, the capacity curve, no orphaned engine
# cores afterwards, and the GPU cluster test (a killed cuda backend's core dies and Ray
# restarts it). Run from the repo root after `source .device-ray/activate.sh`; results in $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
BENCH_ARGS=${BENCH_ARGS:-}
cores() { ps -eo pid,args | grep "[s]pawn_main" | grep -v grep || true; }

timeout "${BENCH_TIMEOUT:-150}" python3 -m bench.served_path --http --model qwen2.5-0.5b-random --device cuda \
    --dtype bfloat16 --threads 4 --repeats 1 --out "$OUT/served-path-h200.json" $BENCH_ARGS \
    >"$OUT/bench.log" 2>&1
echo "bench exit $?"
grep -v "pid=\|Warning\|warn(\|INFO\|^\s*$" "$OUT/bench.log" | tail -30
echo "engine cores left after the bench: $(cores | wc -l)"
if [ "${GPU_TEST_TIMEOUT:-0}" != 0 ]; then
    timeout "$GPU_TEST_TIMEOUT" python3 tests/cluster/test_gpu_cluster.py >"$OUT/gpu-cluster.log" 2>&1
    echo "gpu cluster test exit $?"
    grep -v "pid=\|Warning\|warn(\|INFO" "$OUT/gpu-cluster.log" | tail -25
    echo "engine cores left after the cluster test: $(cores | wc -l)"
fi
