#!/usr/bin/env bash
# One device call: where the engine core's process spends its CPU behind HTTP. Samples every
# thread of the engine core (py-spy, 250 Hz, idle samples dropped) while a bench drives it:
#   served: the served path's rows through HTTP (tandem bench served-path, one repeat)
#   tiered: the host KV tier's heavy cell (tenants, 64 x 4k prefixes, a quarter on the GPU, 96/s)
# Writes NAME.log and NAME-core-PID.txt (collapsed stacks, one line per stack: thread;frames count)
# under $OUT (py-spy's raw format: each line a thread's stack, root first, and its sample count).
# DEVICE=sim (and SIM_PROFILE=FILE for the tiered part) runs on the sim device: a dry run without a GPU.
# py-spy travels as a wheel: in the repo root here,
#   pip download --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d .whl py-spy
# Usage, on the device (carry .device-ray and .whl):
#   source .device-ray/activate.sh && bash bench/device/profile_core_h200.sh [served] [tiered]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl || exit 1
spy=/tmp/pyspy/bin/py-spy
[ -x "$spy" ] || spy=$(find /tmp/pyspy -name py-spy -type f | head -1)

core_pids() {  # engine cores: multiprocessing children of a BackendActor
  local pid
  for pid in $(pgrep -f multiprocessing.spawn); do
    ps -o args= -p "$(ps -o ppid= -p "$pid" | tr -d ' ')" 2>/dev/null | grep -q BackendActor && echo "$pid"
  done
}

profile() {  # NAME COMMAND...: run the command, sample each engine core it starts until it ends
  local name=$1; shift
  "$@" >"$out/$name.log" 2>&1 &
  local bench=$! pid seen=" "
  while kill -0 "$bench" 2>/dev/null; do
    for pid in $(core_pids); do
      case $seen in *" $pid "*) continue ;; esac
      seen="$seen$pid "
      "$spy" record --pid "$pid" --rate 250 --threads --format raw --nonblocking \
        -o "$out/$name-core-$pid.txt" >>"$out/$name-spy.log" 2>&1 &
    done
    sleep 1
  done
  wait
  grep -v "^\s*$" "$out/$name.log" | tail -14
  echo "sampled engine cores:$seen"
}

for part in "${@:-served tiered}"; do
  for p in $part; do
    case $p in
      served) profile served python3 -m tandem.cluster.cli bench served-path --model qwen2.5-0.5b-random \
                --device "${DEVICE:-cuda}" --threads 4 --repeats 1 --capacity-rates '' --ttft-requests 4 \
                --out "$out/served.json" ;;
      tiered) profile tiered python3 -m tandem.cluster.cli bench tenants --out /tmp/tiered \
                --model qwen2.5-0.5b-random --tenants 64 --prefix-tokens 4096 --suffix-tokens 64 --max-tokens 64 \
                --arrival-rates 96 --duration-s 12 --runs 1 --max-active 16 --backends "${DEVICE:-cuda}" --arms cost ${SIM_PROFILE:+--sim-profile "$SIM_PROFILE"} \
                --num-kv-blocks 4352 --kv-host-memory-gb 6 --kv-host-offload-min-hits 0 ;;
      *) echo "unknown part $p" >&2; exit 2 ;;
    esac
  done
done
