#!/usr/bin/env bash
# Issue 17: who enqueues a planned batch's copies (config copy_enqueue): the training thread in
# next() against the loop's workers, on one instance: the tests of both modes, then the main job
# with its defaults under each, alternated ROUNDS times. From the repo root:
#   bash benchmarks/gpu/copy_enqueue_ab.sh    (JSON under $OUT; TESTS=0 skips the tests)
# The launch-bound thread's side: LAUNCHERS=python,native MODES="beside,config:copy_enqueue=workers"
# python3 benchmarks/gpu/launch_cpu_probe.py ROUNDS.
set -uo pipefail; ONE_CALL=copy_enqueue_ab; source benchmarks/gpu/one-call.sh
ROUNDS=${ROUNDS:-2}
if [ "${TESTS:-1}" = 1 ]; then
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_native_cuda.py \
    -k "enqueue or copies_enter or slot_is_rewritten or staged_batches or epoch_left or handed_to_the_gpu" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc $?: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head
fi
for k in $(seq 1 "$ROUNDS"); do  # which mode goes first alternates: the second run of a round reads higher
  for mode in $(ab_order "$k" next workers); do
  TORCH_FASTLOAD_COPY_ENQUEUE=$mode timeout 60 python3 -m torch_fastload.bench --no-progress --repeats 3 \
    --torch-workers 0 --json "$OUT/bench-$mode-$k.json" 2>&1 | grep -E "vs device-resident|input wait <=" | sed "s/^/$mode: /"
done; done
echo "done in $((SECONDS - S)) s"
