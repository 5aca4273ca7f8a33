#!/usr/bin/env bash
# Issue 20: an image batch's stage phases alone and beside a ResNet-18 step, at CPU shares 0
# (nvJPEG alone), 0.25 and 1 (every JPEG on the CPU), ~2 min after the build. Run from the repo
# root (kvikio's wheels in .whl/ optional):  bash benchmarks/gpu/beside_probe.sh   (JSON under $OUT)
set -uo pipefail
ONE_CALL=beside_probe; source benchmarks/gpu/one-call.sh
for share in 0 0.25 1; do
  timeout 150 python3 benchmarks/gpu/beside_probe.py "$OUT/beside-$share.json" --share $share > "$OUT/beside-$share.log" 2>&1
  echo "== share $share rc $? at $((SECONDS - S)) s"; grep -A14 "on a resident batch\|^beside the" "$OUT/beside-$share.log" | grep -v "^   "
done
