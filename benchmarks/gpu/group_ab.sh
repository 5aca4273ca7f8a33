#!/usr/bin/env bash
# Issue 17: grouped submission and group blocks A/B on one instance (~8 min with two builds).
# The tree before (a source copy carried in .gpu/old, built under /tmp/old), this tree with
# output_blocks='batch' (the default: planned batches allocated and submitted allocate_ahead at a
# time, each field of each batch its own allocation) and with 'group' (a field of the group one
# block, views handed out): the main job with its defaults (3 rounds, device-resident baseline
# in each run), interleaved ROUNDS times; then next()'s pieces inside the job under each.
# From the repo root, with .gpu/old carried:  bash benchmarks/gpu/group_ab.sh   (logs under $OUT)
# MODES="batch group" ROUNDS=4 PIECES=0 TESTS=1: without the old tree, the CUDA tests first.
set -uo pipefail
ONE_CALL=group_ab
ROUNDS=${ROUNDS:-2}
MODES=${MODES:-old batch group}  # old needs .gpu/old carried
PIECES=${PIECES:-1}
TESTS=${TESTS:-0}  # 1: the native loop's CUDA tests first
case " $MODES " in *" old "*)
  rm -rf /tmp/old && cp -r .gpu/old /tmp/old
  (cd /tmp/old && timeout 150 python3 setup.py build_ext --inplace -q > /tmp/old-build.log 2>&1) &
  OLD_BUILD=$! ;;
esac
source benchmarks/gpu/one-call.sh
case " $MODES " in *" old "*)
  wait $OLD_BUILD || { tail -20 /tmp/old-build.log; exit 1; }
  echo "old tree built at $((SECONDS - S)) s" ;;
esac
[ "$TESTS" = 1 ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_native_cuda.py 2>&1 | tail -3
run() {  # name, tree, output_blocks, json
  PYTHONPATH=$2 TORCH_FASTLOAD_OUTPUT_BLOCKS=$3 timeout 100 python3 -m torch_fastload.bench --no-progress \
    --repeats 3 --torch-workers 0 --json "$4" 2>&1 | grep -E "^torch_fastload \(|^device-resident|vs device-resident|^PASS|^FAIL" \
    | sed "s/^/$1: /"
}
for k in $(seq 1 "$ROUNDS"); do
  for mode in $(ab_order "$k" $MODES); do
    if [ "$mode" = old ]; then run old /tmp/old batch "$OUT/bench-old-$k.json"
    else run "$mode" "$PWD" "$mode" "$OUT/bench-$mode-$k.json"; fi
  done
done
[ "$PIECES" = 1 ] || { echo "done in $((SECONDS - S)) s"; exit 0; }
for mode in $MODES; do
  tree=$PWD; blocks=$mode
  [ "$mode" = old ] && { tree=/tmp/old; blocks=batch; }
  mkdir -p "$OUT/pieces-$mode"
  OUT="$OUT/pieces-$mode" PYTHONPATH=$tree TORCH_FASTLOAD_OUTPUT_BLOCKS=$blocks timeout 90 \
    python3 benchmarks/gpu/next_pieces.py > "$OUT/pieces-$mode/log" 2>&1
  python3 - "$OUT/pieces-$mode/next-pieces.json" "$mode" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("next", "_fill", "_allocate", "_allocate_group", "loop.take", "loop.submit_fields", "loop.submit_group")
print(f"{sys.argv[2]}: " + ", ".join(f"{k} p50 {d[k]['p50_us']:.1f} mean {d[k]['mean_us']:.1f} us" for k in keys if k in d))
PY
done
echo "done in $((SECONDS - S)) s"
