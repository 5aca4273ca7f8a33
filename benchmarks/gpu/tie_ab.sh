#!/usr/bin/env bash
# Issue 20: the route trial's tie rule A/B, interleaved on one instance (~7 min with the build).
# beside_probe.py --share auto (the loader alone, then beside a ResNet-18 step) under three tie
# rules between nvJPEG alone and a split within the trial's margin: inf (every tie to nvJPEG
# alone: the rule before 2026-11-28), 0.5 (the default: to the split where the step kept the GPU
# busy for half of nvJPEG's batch period) and 0 (every tie to the split, the loader alone too).
# Only runs whose windows tied differ; each log's "route trial" lines show the windows.
# From the repo root:  bash benchmarks/gpu/tie_ab.sh        (JSON and logs under $OUT)
set -uo pipefail
ONE_CALL=tie_ab; source benchmarks/gpu/one-call.sh
for k in 1 2 3 4; do
  for rule in inf 0.5 0; do
    left=$(( 560 - (SECONDS - S) )); (( left < 45 )) && break 2
    timeout $(( left < 120 ? left : 120 )) python3 benchmarks/gpu/beside_probe.py "$OUT/beside-$rule-$k.json" \
      --share auto --warmup 100 --busy-gpu "$rule" > "$OUT/beside-$rule-$k.log" 2>&1
    echo "== rule $rule, round $k: rc $? at $((SECONDS - S)) s"
    grep -E "^loader share|^beside the" "$OUT/beside-$rule-$k.log" | cut -c1-240
  done
done
