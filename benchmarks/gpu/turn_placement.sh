#!/usr/bin/env bash
# Issue 17: the data for a rule that places the group turns (turn thread or next()): the
# workloads of turn_contention_probe.py with both placements alternated, then the training
# thread's CPU share in the main job and a launch-bound loop (step_cpu_share.py); ~5 min.
#   bash benchmarks/gpu/turn_placement.sh   (ROUNDS: the probe's rounds, 5)
set -uo pipefail; ONE_CALL=turn_placement
source benchmarks/gpu/one-call.sh
rm -f "$OUT/build.log"
timeout 330 python3 benchmarks/gpu/turn_contention_probe.py --rounds "${ROUNDS:-5}" > "$OUT/turn-contention.log" 2>&1
echo "probe rc $?"; grep -v '^{' "$OUT/turn-contention.log" | tail -8
[ $((SECONDS - S)) -lt 420 ] && { timeout 150 python3 benchmarks/gpu/step_cpu_share.py > "$OUT/step-cpu-share.log" 2>&1
  echo "share rc $?"; grep -E "CPU share|vs device-resident" "$OUT/step-cpu-share.log"; }
echo "done in $((SECONDS - S)) s"
