#!/usr/bin/env bash
# Issue 13's live grid on the 2-GPU machine (nvidia-h200-x2): `tandem bench tenants` through the
# real HTTP endpoint, backends cpu,cuda*2 (the CPU plus one backend per H200), model
# qwen2.5-0.5b-random (bf16 on the GPUs), arms cost / prefix-affinity / least-requests /
# round-robin, 2 runs per arm, tenant counts 4 (every prefix fits in one GPU's cache) and 16
# (they do not), 3 Poisson arrival rates from light to saturating. One prefix size per call:
#
#   source .device-ray/activate.sh && bash bench/prefix_grid_h200x2.sh 1024    # call 1
#   source .device-ray/activate.sh && bash bench/prefix_grid_h200x2.sh 4096    # call 2
#
# And, a short call of its own (~2 min), whether the two H200s profile alike: `tandem profile`
# of GPU 0, GPU 1, then GPU 0 again, one GPU visible at a time, all against one profile cache;
# from the second on it prints how far the new profile is from the cached one (the same key:
# model, cuda:H200, bf16, threads, max_active), which should be within 10%:
#
#   source .device-ray/activate.sh && bash bench/prefix_grid_h200x2.sh profile
#
# Each call starts one cluster and runs 2 tenant counts x 3 rates x 4 arms x 2 runs = 48
# measurements on it. KV cache: every backend gets NUM_KV_BLOCKS = 6 prefixes' blocks plus room
# for 16 running requests' own blocks (6 x P/16 + 16 x (64 + 64)/16), as in route-sim's
# docs/route-sim-examples/tenants-2gpu.yaml: 4 tenants fit on one GPU, 16 do not.
#
# Budget per call (CELL_S seconds of arrivals per measurement, default 4; DRAIN_S, default 3,
# the most a measurement waits after its last arrival before cutting off what is unfinished:
# round-robin and least-requests give the CPU backend a share of 1k-4k-token prompts, which it
# would take minutes to serve; cut-off requests count with their time so far, see bench/tenants.py):
#   setup: Ray ~10 s + `tandem profile` of the 3 backends (the two H200s share one profile;
#          skipped when RATES_FILE from an earlier call on a warm machine exists) ~60 s
#          + cluster start and warm-up ~30 s                                       ~100 s
#   cells: 24 measurements of GPU-only arms (cost, prefix-affinity) x (CELL_S + ~1.5 s to drain,
#          reconfigure and write) = 24 x 5.5                                       ~132 s
#          24 of the arms that feed the CPU, cut off: 24 x (CELL_S + DRAIN_S + 1.5) ~204 s
#   bundle: report, plot, tarballs                                                 ~15 s
#   total ~450 s (7.5 min) per call, inside the 9 minutes asked for; both prefix sizes in one
#   call would be ~900 s, over the device's 10-minute limit, hence two calls. TIME_BUDGET_S
#   (default 480) makes the bench stop starting measurements in time to write its summary.
# Requests per measurement: max(40, rate x CELL_S), e.g. 40/160/400 at 10/40/100 per s.
#
# Results under $OUT (at most 8 files come back): the report (markdown, PNG, JSON), summary.json,
# runs.tar.xz (meta, rates, every run's requests and compact decisions, each cell's route-sim
# scenario, the bench and profile logs) and routing-logs.tar.xz (the full routing log).
set -uo pipefail
PREFIX=${1:-1024}
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=${OUT:-out/prefix-grid}
CELL_S=${CELL_S:-4}
DRAIN_S=${DRAIN_S:-3}
RUNS=${RUNS:-2}
TENANTS=${TENANTS:-4,16}
TIME_BUDGET_S=${TIME_BUDGET_S:-480}
CPU_THREADS=${CPU_THREADS:-16}  # leave cores to the serving path and the client (32 on this machine)
MODEL=${MODEL:-qwen2.5-0.5b-random}
BACKENDS=${BACKENDS:-cpu,cuda*2}  # a smoke test elsewhere: BACKENDS='cpu*2' MODEL=tiny-llama-random
if [ "$PREFIX" = profile ]; then
    mkdir -p "$OUT"
    for gpu in 0 1 0; do
        CUDA_VISIBLE_DEVICES=$gpu TANDEM_CACHE_DIR=/tmp/prefix-grid-profile timeout 200 python3 -m tandem.cluster.cli \
            profile --model "${MODEL:-qwen2.5-0.5b-random}" --backends cuda --max-active 16 \
            --output "$OUT/rates-gpu$gpu.json" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/profile-gpus.log"
    done
    exit 0
fi
case "$PREFIX" in
  1024) RATES=${RATES:-20,60,150} ;;   # 150/s: past what the served path sustains with 1k prefixes
  4096) RATES=${RATES:-10,40,100} ;;   # 100/s: about two H200s' prefill capacity (route-sim)
  *) RATES=${RATES:?set RATES for prefix $PREFIX} ;;
esac
NUM_KV_BLOCKS=${NUM_KV_BLOCKS:-$((6 * PREFIX / 16 + 16 * (64 + 64) / 16))}
WORK=${WORK:-/tmp/prefix-grid-p$PREFIX}
RATES_FILE=${RATES_FILE:-out/prefix-grid-rates.json}  # kept between calls on a warm machine
mkdir -p "$OUT" "$WORK" "$(dirname "$RATES_FILE")"
NAME=tenants-h200x2-p$PREFIX
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
echo "prefix $PREFIX, tenants $TENANTS, rates $RATES/s, $CELL_S s per cell (drain $DRAIN_S s), $RUNS runs, kv blocks $NUM_KV_BLOCKS"

RATES_ARGS=()
[ -s "$RATES_FILE" ] && RATES_ARGS=(--rates "$RATES_FILE")
start=$(date +%s)
timeout $((TIME_BUDGET_S + 60)) python3 -m tandem.cluster.cli bench tenants --out "$WORK" \
    --model "$MODEL" --backends "$BACKENDS" --cpu-threads "$CPU_THREADS" \
    --tenants "$TENANTS" --prefix-tokens "$PREFIX" --suffix-tokens 64 --max-tokens 64 --zipf-s 1.0 \
    --arrival-rates "$RATES" --duration-s "$CELL_S" --min-requests 40 --runs "$RUNS" --drain-timeout-s "$DRAIN_S" \
    --max-active 16 --cpu-max-active 4 --num-kv-blocks "$NUM_KV_BLOCKS" \
    --time-budget-s "$TIME_BUDGET_S" --report "$OUT/$NAME.md" "${RATES_ARGS[@]}" >"$WORK/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"
grep -v "req/s\]\|Warning\|warn(\|INFO\|^\s*$" "$WORK/bench.log" | tail -15
[ -s "$WORK/rates.json" ] && [ ! -s "$RATES_FILE" ] && cp "$WORK/rates.json" "$RATES_FILE"
if [ ! -s "$OUT/$NAME.md" ] && [ -d "$WORK/runs" ]; then  # stopped early: render what finished
    timeout 60 python3 -m tandem.cluster.cli bench report "$WORK" --tenants-report "$OUT/$NAME.md"
fi
cp "$WORK/summary.json" "$OUT/$NAME-summary.json" 2>/dev/null
export XZ_OPT="-T0 -6"
tar -C "$WORK" -cJf "$OUT/$NAME-runs.tar.xz" meta.json runs scenarios bench.log \
    $(cd "$WORK" && ls rates.json profile.log profile-config.yaml 2>/dev/null)
tar -C "$WORK" -cJf "$OUT/$NAME-routing-logs.tar.xz" $(cd "$WORK" && ls logs/routing-*.jsonl 2>/dev/null)
ls -la "$OUT"
sed -n '/^## cost against/,/judged/p' "$OUT/$NAME.md"
