#!/usr/bin/env bash
# Issue 17: the group turn made lighter (a group's submit wakes one loop worker, which wakes the
# next; the group's indices one slice of the drawn order; its addresses worked out in C++; no
# second randperm from a dropped generator) against the tree before, on one instance (~8 min).
# Modes: old (a source copy of the tree before, carried in .gpu/old and built under /tmp/old),
# new (this tree), wakeall (this tree with native.WAKE_ALL: the submit wakes every idle worker).
# TESTS=1 runs the CUDA suite first; then each epoch's edges (epoch_edges.py) under old and new;
# then the main job with its defaults, ROUNDS rounds in the order of MODES, reversed every other
# round (the second run of a round reads higher); ROUNDS=0 skips it. BESIDE_ROUNDS (0) rounds of
# beside_step.py --quick in each mode (BESIDE_ONLY its feeds, default the default-route rows;
# BESIDE_ARGS more arguments), the same order.
# From the repo root:
#   bash benchmarks/gpu/wake_ab.sh   (with .gpu/old carried; at most 8 files under $OUT)
set -uo pipefail; ONE_CALL=wake_ab
ROUNDS=${ROUNDS:-2}
MODES=${MODES:-old new wakeall}
rm -rf /tmp/old && cp -r .gpu/old /tmp/old
(cd /tmp/old && timeout 150 python3 setup.py build_ext --inplace -q > /tmp/old-build.log 2>&1) &
OLD_BUILD=$!
source benchmarks/gpu/one-call.sh
rm -f "$OUT/build.log"  # the device tool returns 8 files a call
wait $OLD_BUILD || { tail -20 /tmp/old-build.log; exit 1; }
echo "old tree built at $((SECONDS - S)) s"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 260 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests > "$OUT/cuda-suite.log" 2>&1
  echo "CUDA suite rc $?: $(tail -1 "$OUT/cuda-suite.log")"; grep -E "^FAILED|^ERROR" "$OUT/cuda-suite.log" | head
fi
tree_of() { [ "$1" = old ] && echo /tmp/old || echo "$PWD"; }
for mode in $([ "${EDGES:-1}" = 1 ] && echo old new); do  # EDGES=0 skips them
  rm -rf "/tmp/edges-$mode"; mkdir -p "/tmp/edges-$mode"
  OUT="/tmp/edges-$mode" PYTHONPATH=$(tree_of $mode) timeout 90 \
    python3 benchmarks/gpu/epoch_edges.py --repeats 2 > "/tmp/edges-$mode/log" 2>&1
  { echo "$mode:"; grep -E "^(fastload|resident)\.(iter|next)|^pipeline\.(init|_fill)" "/tmp/edges-$mode/log"; } \
    | tee -a "$OUT/edges.txt"
done
bench() {  # mode, json
  local wrap="import sys, runpy, torch_fastload.native as n; n.WAKE_ALL = sys.argv[1] == 'wakeall'; "
  wrap+="sys.argv = ['torch_fastload.bench', *sys.argv[2:]]; runpy.run_module('torch_fastload.bench', run_name='__main__')"
  PYTHONPATH=$(tree_of "$1") timeout 60 python3 -c "$wrap" "$1" --no-progress --repeats 3 --torch-workers 0 \
    --json "$2" 2>&1 | grep -E "vs device-resident|input wait <=" | sed "s/^/$1: /"
}
for k in $(seq 1 "$ROUNDS"); do  # even rounds reverse MODES: the second run of a round reads higher
  for mode in $(ab_order "$k" $MODES); do bench "$mode" "$OUT/bench-$mode-$k.json"; done
done
beside() {  # mode: beside_step.py --quick (the GEMM step and the launch-bound thread) in that tree
  local wrap="import sys, runpy, torch_fastload.native as n; n.WAKE_ALL = sys.argv[1] == 'wakeall'; "
  wrap+="sys.argv = ['beside_step.py', *sys.argv[2:]]; runpy.run_path('benchmarks/beside_step.py', run_name='__main__')"
  # shellcheck disable=SC2086
  PYTHONPATH=$(tree_of "$1") timeout 150 python3 -c "$wrap" "$1" --quick --no-progress ${BESIDE_ARGS:-} \
    --out "/tmp/beside-$1" --only "${BESIDE_ONLY:-default: auto}" 2>&1 | grep -E "^(PASS|FAIL)|^GEMM step|H2D beside|default: auto" \
    | sed "s/^/$1: /"
}
for k in $(seq 1 "${BESIDE_ROUNDS:-0}"); do  # BESIDE_ROUNDS: GEMM and launch-bound rows, alternating
  for mode in $(ab_order "$k" $MODES); do beside "$mode"; done
done
echo "done in $((SECONDS - S)) s"
