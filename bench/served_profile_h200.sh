#!/usr/bin/env bash
# Issue 11's serving-path measurements in one call on the H200 machine (repo root, after
# `source .device-ray/activate.sh`; py-spy from .device-ray/bin if carried). Results in $OUT.
#   1. bench.served_path --http: in-process engine vs tandem serve (default ingress), capacity
#   2. bench.served_profile, short requests at a saturating rate: CPU per process and py-spy
#      stacks, with --ingress direct and --ingress proxy
#   3. bench.served_profile, streamed bursts (48 x 516 -> 128, max_active 64), default ingress
# Set SKIP_SERVED=1 / SKIP_PROFILE=1 to leave parts out.
source bench/h200_common.sh
if [ "${SKIP_SERVED:-0}" != 1 ]; then
    timeout "${SERVED_TIMEOUT:-200}" python3 -m bench.served_path --http $M --threads 4 --repeats 1 \
        --capacity-rates "${RATES:-500,1000,2000}" --out "$OUT/served-path.json" >"$OUT/served.log" 2>&1
    echo "served_path exit $?"; quiet <"$OUT/served.log" | tail -16
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
    for ingress in direct proxy; do
        timeout 90 python3 -m bench.served_profile $M --ingress "$ingress" --load short --rate "${PROFILE_RATE:-1500}" \
            --clients 6 --seconds 5 --vocab 20000 --top 10 --out "$OUT/profile-short-$ingress" \
            >"$OUT/profile-short-$ingress.log" 2>&1
        echo "profile short $ingress exit $?"; quiet <"$OUT/profile-short-$ingress.log" | head -45
    done
    timeout 90 python3 -m bench.served_profile $M --load stream --max-active 64 --burst 48 --seconds 5 --vocab 20000 \
        --top 10 --out "$OUT/profile-stream" >"$OUT/profile-stream.log" 2>&1
    echo "profile stream exit $?"; quiet <"$OUT/profile-stream.log" | head -45
fi
echo "engine cores left: $(cores | wc -l)"
