#!/usr/bin/env bash
# The served path with several direct-ingress replicas on the H200 machine, in one call (repo
# root, after `source .device-ray/activate.sh`; py-spy from .device-ray/bin if carried):
#   1. bench.served_path --http with the default replicas (one per 4 cores) and the capacity curve
#   2. the same with one replica, for the difference the replicas make
#   3. bench.served_profile under streamed bursts: CPU per process with the default replicas
# Results in $OUT; see docs/benchmarks/served-path-h200.md. SKIP_ONE=1 leaves part 2 out.
source bench/h200_common.sh
timeout "${SERVED_TIMEOUT:-230}" python3 -m bench.served_path --http $M --threads 4 --repeats 1 \
    --capacity-rates "${RATES:-500,1000,1500,2000}" --capacity-clients 8 --ttft-requests 10 \
    --out "$OUT/served-path.json" >"$OUT/served.log" 2>&1
echo "served_path (default replicas) exit $?"; quiet <"$OUT/served.log" | tail -16
if [ "${SKIP_ONE:-0}" != 1 ]; then
    timeout "${ONE_TIMEOUT:-190}" python3 -m bench.served_path --http $M --threads 4 --repeats 1 --http-replicas 1 \
        --capacity-rates 500,1000 --capacity-clients 8 --ttft-requests 10 \
        --out "$OUT/served-path-1replica.json" >"$OUT/served-1.log" 2>&1
    echo "served_path (1 replica) exit $?"; quiet <"$OUT/served-1.log" | tail -12
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
    timeout 90 python3 -m bench.served_profile $M --load stream --max-active 64 --burst 48 --seconds 5 --vocab 20000 \
        --top 8 --out "$OUT/profile-stream" >"$OUT/profile-stream.log" 2>&1
    echo "profile stream exit $?"; quiet <"$OUT/profile-stream.log" | head -40
fi
echo "engine cores left: $(cores | wc -l)"
