#!/usr/bin/env bash
# Issue 17: the group turns on a thread of the pipeline's own (config turn_thread; 'auto', on for
# CUDA outputs, since the thirty-second session) against the turns inside next(), on one instance
# (~7 min). The turn thread waits without the GIL for the batches in flight to run low and takes
# the GIL when the training thread lets go of it (a CUDA step's backward() does), so the training
# thread's next() only takes batches. What to look at: the main job's input wait AND its samples/s against the
# device-resident loop (a turn that takes the GIL mid-forward costs the step instead of next()),
# and the launch-bound thread's rate beside each (beside_step.py --quick, TensorDataset rows).
# TESTS=1 runs the native CUDA tests first (the turn thread's among them); EDGES=0 skips the edges;
# BESIDE_ROUNDS (1) launch-bound rounds in alternating order, BESIDE_ARGS passed to beside_step.py,
# BESIDE_ONLY its feeds (default: the TensorDataset rows; "default: auto" for the default route alone).
#   bash benchmarks/gpu/turn_ab.sh      (at most 8 files under $OUT)
set -uo pipefail; ONE_CALL=turn_ab; source benchmarks/gpu/one-call.sh
rm -f "$OUT/build.log"  # the device tool returns 8 files a call
ROUNDS=${ROUNDS:-2}
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_native_cuda.py > "$OUT/native-cuda.log" 2>&1
  echo "native CUDA tests rc $?: $(tail -1 "$OUT/native-cuda.log")"; grep -E "^FAILED|^ERROR" "$OUT/native-cuda.log" | head
fi
for turn in $([ "${EDGES:-1}" = 1 ] && echo 0 1); do
  rm -rf "/tmp/edges-$turn"; mkdir -p "/tmp/edges-$turn"
  OUT="/tmp/edges-$turn" TORCH_FASTLOAD_TURN_THREAD=$turn PYTHONPATH=$PWD timeout 90 \
    python3 benchmarks/gpu/epoch_edges.py --repeats 2 > "/tmp/edges-$turn/log" 2>&1
  { echo "turn_thread=$turn:"; grep -E "^fastload\.(iter|next)|^pipeline\.(init|_fill)" "/tmp/edges-$turn/log"; } \
    | tee -a "$OUT/edges.txt"
done
for k in $(seq 1 "$ROUNDS"); do  # the order reverses every other round: the second run of a round reads higher
  for turn in $(ab_order "$k" 0 1); do
    TORCH_FASTLOAD_TURN_THREAD=$turn timeout 60 python3 -m torch_fastload.bench --no-progress --repeats 3 \
      --torch-workers 0 --json "$OUT/bench-turn$turn-$k.json" 2>&1 | grep -E "vs device-resident|input wait <=" \
      | sed "s/^/turn_thread=$turn: /"
  done
done
for k in $(seq 1 "${BESIDE_ROUNDS:-1}"); do  # launch-bound rows; BESIDE_ARGS e.g. "--launch-repeats 9"
  for turn in $(ab_order "$k" 0 1); do
    [ $((SECONDS - S)) -gt "${BESIDE_UNTIL_S:-480}" ] && { echo "beside round $k turn $turn skipped: out of time"; continue; }
    # shellcheck disable=SC2086
    TORCH_FASTLOAD_TURN_THREAD=$turn timeout 150 python3 benchmarks/beside_step.py --quick --no-progress ${BESIDE_ARGS:-} \
      --out "/tmp/beside-$turn" --only "${BESIDE_ONLY:-TensorDataset (C++}" 2>&1 | grep -A9 "^launch-bound" | sed "s/^/turn_thread=$turn: /"
  done
done
echo "done in $((SECONDS - S)) s"
