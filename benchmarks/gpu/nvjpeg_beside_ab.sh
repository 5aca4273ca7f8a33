#!/usr/bin/env bash
# Issue 20: the stage beside a ResNet-18 step with torchvision's nvJPEG op and with nvJPEG called
# directly (its streams at high and at normal priority), at CPU shares 0 and 0.5, on one instance
# (~4 min with the build). From the repo root (kvikio's wheels in .whl/ optional):
#   bash benchmarks/gpu/nvjpeg_beside_ab.sh        (JSON and logs under $OUT)
set -uo pipefail
ONE_CALL=nvjpeg_beside_ab; source benchmarks/gpu/one-call.sh
run() {  # name share backend priority
  timeout 120 python3 benchmarks/gpu/beside_probe.py "$OUT/beside-$1.json" --share "$2" --backend "$3" \
    --nvjpeg-priority "$4" > "$OUT/beside-$1.log" 2>&1
  echo "== $1 (share $2, $3, $4) rc $? at $((SECONDS - S)) s"
  grep -E "^beside the|^loader share|^_decode_on_gpu|^nvjpeg decode|^torchvision decode" "$OUT/beside-$1.log" | cut -c1-150
}
run tv-0 0 torchvision high
run direct-high-0 0 nvjpeg high
run direct-normal-0 0 nvjpeg normal
run tv-0.5 0.5 torchvision high
run direct-normal-0.5 0.5 nvjpeg normal
run tv-0-again 0 torchvision high
