#!/usr/bin/env bash
# One device call for one or more parts: the host KV tier on the tenants workload (tandem bench tenants through
# HTTP), with the GPU's KV cache holding a quarter of the tenants' prefixes and the host tier all
# of them, at light load and past saturation; then prints one table from the summaries, with
# route-sim's prediction (engine model) of each cell beside the live figures.
#   single: one engine, `cost`, tier on (every evicted block kept) and off: the tier's own
#           effect; after the tier's CUDA tests
#   gated:  the same with the tier gated (only blocks hit before are kept): the gate's effect
#   fit:    one engine, `cost`, the default KV cache (every prefix fits), tier on against off,
#           at FIT_RATES (no loss where the tier has nothing to do)
#   shared: two engines on the GPU with the tier, cost against prefix-affinity and round-robin
#   noreuse: one engine, every prompt its own (one shared block per tenant), tier on against off,
#           at NOREUSE_RATES: what keeping every evicted block costs where nothing is reloaded
# A part's first run profiles the backends (with the tier, so the reload rate is measured); its
# later runs reuse those rates. On cuda, `tandem profile --sim-profiles` first measures the decode
# step's context cost by batch at the prefixes' length (and the prefill table), which the rates
# leave out: route-sim's prediction of every cell times its steps with them (--step-profile).
# Each run comes back as NAME-summary.json, and every run's whole output (logs, per-request
# records, scenarios) in one host-tier-runs.tgz, and the scenarios, settings and profiles alone in
# host-tier-scenarios.tgz (a call returns 8 files).
# Usage, on the device after `source .device-ray/activate.sh`:  bench/device/host_tier_h200.sh PART...
# BACKEND=sim SIM_PROFILE=FILE runs the same commands on emulated devices (a dry run without a GPU).
set -uo pipefail
parts=("${@:-single}")
out=${OUT:-/tmp/out}
work=${WORK:-/tmp/host-tier}
backend=${BACKEND:-cuda}
model=${MODEL:-qwen2.5-0.5b-random}
tenants=${TENANTS:-64}
prefix=${PREFIX_TOKENS:-4096}
# light; below the tiered engine's capacity (where a prediction's TTFT can be judged: at capacity
# a step 10-20% longer moves it several times); past the untiered engine's saturation (about 80/s
# on an H100, about the tiered engine's capacity)
rates=${RATES:-8,64,96}
fit_rates=${FIT_RATES:-96}
noreuse_rates=${NOREUSE_RATES:-8,48}  # light, and about 80% of the untiered engine's prefill rate
duration=${DURATION_S:-12}
runs=${RUNS:-2}
max_active=${MAX_ACTIVE:-16}
budget=${TIME_BUDGET_S:-150}  # per run: stop starting cells after this; three runs fit one 600 s call
host_gb=${HOST_GB:-6}  # every prefix: 64 x 4096 tokens x 12 KiB (qwen2.5-0.5b, bf16) = 3 GiB, pinned twice at most
# A quarter of the prefixes on the GPU, plus room for the running requests' own blocks.
quarter=$(( tenants * prefix / 16 / 4 + max_active * 16 ))
export PYTHONUNBUFFERED=1
mkdir -p "$out" "$work"
common=(--model "$model" --tenants "$tenants" --prefix-tokens "$prefix" --suffix-tokens 64 --max-tokens 64
        --arrival-rates "$rates" --duration-s "$duration" --runs "$runs" --max-active "$max_active" --drain-timeout-s 120
        --time-budget-s "$budget" ${SIM_PROFILE:+--sim-profile "$SIM_PROFILE"})
profiled=""
step_profile=()
if [ "$backend" = cuda ]; then
  start=$SECONDS
  python3 -m tandem.cluster.cli profile --backends cuda --model "$model" --max-active "$max_active" \
    --sim-profiles "$work/step-profile" --context-len "$prefix" --output "$work/step-rates.json" \
    > "$work/step-profile.log" 2>&1 || { echo "step profile failed:"; tail -20 "$work/step-profile.log"; }
  if [ -f "$work/step-profile/cuda0.json" ]; then
    step_profile=(--step-profile "$work/step-profile/cuda0.json")
    echo "step profile: $(( SECONDS - start )) s; context cost by batch (s per context token):" \
      "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["decode_s_per_context_token_by_batch"])' \
         "$work/step-profile/cuda0.json")"
  fi
fi
run() {  # NAME ARGS...: one bench tenants run; the part's first profiles, the later ones reuse its rates
  local name=$1 start=$SECONDS; shift
  python3 -m tandem.cluster.cli bench tenants --out "$work/$name" "${common[@]}" ${profiled:+--rates "$profiled"} \
    "${step_profile[@]}" "$@" \
    > "$work/$name.log" 2>&1 || { echo "$name failed:"; tail -20 "$work/$name.log"; }
  echo "$name: $(( SECONDS - start )) s"
  [ -n "$profiled" ] || { [ -f "$work/$name/rates.json" ] && profiled="$work/$name/rates.json"; }
  cp "$work/$name/summary.json" "$out/$name-summary.json" 2>/dev/null
}
for part in "${parts[@]}"; do
  profiled=""
  case $part in
    single)
      [ "$backend" = cuda ] && python3 -m pytest -q -p no:cacheprovider tests/engine/test_host_tier_cuda.py 2>&1 \
        | tee "$out/cuda-tests.log" | tail -3
      run single-on --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb "$host_gb" \
        --kv-host-offload-min-hits 0
      run single-off --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb 0 ;;
    gated)
      run single-gated --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb "$host_gb" \
        --kv-host-offload-min-hits 1 ;;
    fit)
      run fit-on --backends "$backend" --arms cost --kv-host-memory-gb "$host_gb" --arrival-rates "$fit_rates"
      run fit-off --backends "$backend" --arms cost --kv-host-memory-gb 0 --arrival-rates "$fit_rates" ;;
    shared)
      run shared-on --backends "$backend*2" --arms cost,prefix-affinity,round-robin \
        --num-kv-blocks "$(( quarter / 2 ))" --kv-host-memory-gb "$(( host_gb / 2 ))" ;;
    noreuse)
      unique=(--prefix-tokens 16 --suffix-tokens "$(( prefix + 48 ))" --arrival-rates "$noreuse_rates")
      run noreuse-on --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb "$host_gb" \
        --kv-host-offload-min-hits 0 "${unique[@]}"
      run noreuse-off --backends "$backend" --arms cost --num-kv-blocks "$quarter" --kv-host-memory-gb 0 "${unique[@]}" ;;
    *) echo "part: single, gated, fit, shared or noreuse"; exit 2 ;;
  esac
done
tar czf "$out/host-tier-runs.tgz" -C "$work" .
# the scenarios, settings and profiles alone, small enough to come back where the runs are not
(cd "$work" && tar czf "$out/host-tier-scenarios.tgz" --exclude='*/runs' --exclude='*.log' .)
python3 - "$out" <<'PY'
import json, pathlib, sys
nan = float("nan")
print(f"{'run':<13} {'cell':<18} {'arm':<16} {'hit':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>8} {'sim p50':>8}"
      f" {'engine p50':>10} {'sim engine':>10}  (mean of runs; sim: route-sim's engine model; engine: the engine's"
      " queue and first step alone, live from Server-Timing, of the answers not queued for a slot)")
for summary in sorted(pathlib.Path(sys.argv[1]).glob("*-summary.json")):
    for cell in json.loads(summary.read_text())["cells"]:
        for arm, m in cell["arms"].items():
            sim = (cell.get("route_sim") or {}).get(arm, {}).get("engine", {})
            engine = m.get("engine_ttft_p50_s", {}).get("mean", nan)
            counted = m.get("engine_ttft_share", {}).get("mean", nan)
            print(f"{summary.name[:-13]:<13} {cell['cell']:<18} {arm:<16} {m['hit_rate']['mean']:>6.3f} "
                  f"{m['ttft_p50_s']['mean']:>8.3f}s {m['ttft_p90_s']['mean']:>8.3f}s {m['output_tok_s']['mean']:>8.0f}"
                  f" {sim.get('ttft_p50_s', nan):>7.3f}s {engine:>9.4f}s {sim.get('engine_ttft_p50_s', nan):>9.4f}s"
                  f" ({counted:.0%} counted)")
PY
python3 - "$work" <<'PY'
import json, pathlib, sys
print("each engine's steps over the run's wall (busy: near 1, the engine is the bottleneck), the prefill steps' part,"
      " and host / device-wait ms per step (a small wait: the step loop's host work is the bottleneck)")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/runs/*.json")):
    work = json.loads(path.read_text()).get("engine_work", {})
    print(f"{path.parent.parent.name:<13} {path.stem:<32} " + "  ".join(
        f"{b}: busy {w['busy_share']:.2f}, prefill {w['prefill_share_of_busy']:.2f},"
        f" {w.get('steps', 0)} steps, {w.get('host_ms_per_step', 0):.3f} / {w.get('device_wait_ms_per_step', 0):.3f} ms"
        for b, w in work.items()))
PY
