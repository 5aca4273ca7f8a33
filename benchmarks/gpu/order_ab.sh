#!/usr/bin/env bash
# Issue 17: the loop's copies enqueued in the batches' order (native.ORDERED_COPIES) against the
# workers enqueuing them as they get there (unordered, the control), on one instance (~8 min).
# TESTS=1: the native CUDA tests first (the ordering's test and its control among them). Then
# edge_gpu_gap.py (the GPU's idle gap at each step of an epoch), beside_step.py --quick (the GEMM
# and launch-bound rows at the default routes) and the main job, ROUNDS rounds each in the order
# of MODES, reversed every other round (the second run of a round reads higher); GAP_ROUNDS and
# BESIDE_ROUNDS (1) set those studies' own; UNTIL_S (430) skips what would start later.
#   bash benchmarks/gpu/order_ab.sh   (at most 8 files under $OUT)
set -uo pipefail; ONE_CALL=order_ab
ROUNDS=${ROUNDS:-2}
MODES=${MODES:-ordered unordered}
source benchmarks/gpu/one-call.sh
rm -f "$OUT/build.log"  # the device tool returns 8 files a call
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_native_cuda.py > "$OUT/native-cuda.log" 2>&1
  echo "native CUDA tests rc $?: $(tail -1 "$OUT/native-cuda.log")"; grep -E "^FAILED|^ERROR" "$OUT/native-cuda.log" | head
fi
# python3 -c "$IN_MODE" MODE SCRIPT-OR-MODULE ARGS...: runs it with native.ORDERED_COPIES set for MODE
IN_MODE="import sys, runpy, torch_fastload.native as n; n.ORDERED_COPIES = sys.argv[1] == 'ordered'; "
IN_MODE+="sys.argv = sys.argv[2:]; "
IN_MODE+="runpy.run_path(sys.argv[0], run_name='__main__') if sys.argv[0].endswith('.py') "
IN_MODE+="else runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
for k in $(seq 1 "${GAP_ROUNDS:-$ROUNDS}"); do
  for mode in $(ab_order "$k" $MODES); do
    mkdir -p "/tmp/gap-$mode-$k"
    OUT="/tmp/gap-$mode-$k" timeout 120 python3 -c "$IN_MODE" "$mode" benchmarks/gpu/edge_gpu_gap.py --rounds 1 2>&1 \
      | grep -E "^[A-Z]|^device|^batch|^  path" | sed "s/^/$mode: /"
    cp "/tmp/gap-$mode-$k/edge-gpu-gap.json" "$OUT/gap-$mode-$k.json" 2>/dev/null
  done
done
for k in $(seq 1 "${BESIDE_ROUNDS:-1}"); do
  for mode in $(ab_order "$k" $MODES); do
    [ $((SECONDS - S)) -gt "${UNTIL_S:-430}" ] && { echo "beside $mode skipped: out of time"; continue; }
    timeout 150 python3 -c "$IN_MODE" "$mode" benchmarks/beside_step.py --quick --no-progress --out "/tmp/beside-$mode" \
      --only "${BESIDE_ONLY:-default: auto}" 2>&1 | grep -E "^(PASS|FAIL)|^GEMM step|H2D beside|default: auto" \
      | sed "s/^/$mode: /"
  done
done
for k in $(seq 1 "$ROUNDS"); do
  for mode in $(ab_order "$k" $MODES); do
    [ $((SECONDS - S)) -gt "${UNTIL_S:-430}" ] && { echo "main job $mode skipped: out of time"; continue; }
    timeout 60 python3 -c "$IN_MODE" "$mode" torch_fastload.bench --no-progress --repeats 3 --torch-workers 0 \
      --json "/tmp/bench-$mode-$k.json" 2>&1 | grep -E "vs device-resident|input wait <=" | sed "s/^/$mode: /"
  done
done
echo "done in $((SECONDS - S)) s"
