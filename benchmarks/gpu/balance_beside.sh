#!/usr/bin/env bash
# Issue 20: the route trial with a kept split balanced online (route_trial.ShareBalancer), the
# loader alone and beside a ResNet-18 step, against fixed shares 0.5 and 0 on one instance
# (~7 min with the build). From the repo root:
#   bash benchmarks/gpu/balance_beside.sh        (JSON and logs under $OUT)
set -uo pipefail
ONE_CALL=balance_beside; source benchmarks/gpu/one-call.sh
timeout 120 python3 -m pytest -q -s -m cuda tests/test_images.py -k "balanced" > "$OUT/tests-cuda.log" 2>&1
echo "== CUDA test rc $?"; grep -E "balanced online|passed|failed|Error" "$OUT/tests-cuda.log" | cut -c1-400
run() {  # name share
  timeout 140 python3 benchmarks/gpu/beside_probe.py "$OUT/beside-$1.json" --share "$2" --warmup 100 \
    > "$OUT/beside-$1.log" 2>&1
  echo "== $1 (share $2) rc $? at $((SECONDS - S)) s"
  grep -E "^beside the|^loader share|^route trial" "$OUT/beside-$1.log" | cut -c1-700
}
run auto-1 auto
run fixed-0.5 0.5
run auto-2 auto
run fixed-0 0
