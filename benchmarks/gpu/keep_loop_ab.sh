#!/usr/bin/env bash
# Issue 17: the C++ loop kept across epochs (config keep_loop) against a new loop each epoch, on
# one instance (~7 min with the build and the CUDA suite): what each epoch's edges cost the
# training thread (epoch_edges.py: iter(), the first next(), the next() that stops), then the
# main job with its defaults under each, alternated ROUNDS times. From the repo root:
#   bash benchmarks/gpu/keep_loop_ab.sh      (logs and JSON under $OUT; TESTS=0 skips the suite;
#   ROUNDS=2, the default, keeps what comes back within the device tool's 8 files)
set -uo pipefail; ONE_CALL=keep_loop_ab; source benchmarks/gpu/one-call.sh
ROUNDS=${ROUNDS:-2}
if [ "${TESTS:-1}" = 1 ]; then
  timeout 260 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests > "$OUT/cuda-suite.log" 2>&1
  echo "CUDA suite rc $?: $(tail -1 "$OUT/cuda-suite.log")"; grep -E "^FAILED|^ERROR" "$OUT/cuda-suite.log" | head
fi
for keep in 1 0; do  # the device tool returns 8 files a call: one JSON a mode from these runs
  rm -rf "/tmp/edges-keep$keep"; mkdir -p "/tmp/edges-keep$keep"
  OUT="/tmp/edges-keep$keep" TORCH_FASTLOAD_KEEP_LOOP=$keep PYTHONPATH=$PWD timeout 90 \
    python3 benchmarks/gpu/epoch_edges.py --repeats 2 > "/tmp/edges-keep$keep/log" 2>&1
  cp "/tmp/edges-keep$keep/epoch-edges.json" "$OUT/edges-keep$keep.json"
  echo "keep_loop=$keep:"; grep -E "^(fastload|resident)\.(iter|next)|^loop\.|^pipeline\.init" "/tmp/edges-keep$keep/log"
done
for k in $(seq 1 "$ROUNDS"); do  # which mode goes first alternates: the second run of a round reads higher
  for keep in $(ab_order "$k" 1 0); do
  TORCH_FASTLOAD_KEEP_LOOP=$keep timeout 60 python3 -m torch_fastload.bench --no-progress --repeats 3 --torch-workers 0 \
    --json "$OUT/bench-keep$keep-$k.json" 2>&1 | grep -E "vs device-resident|input wait <=" | sed "s/^/keep_loop=$keep: /"
done; done
echo "done in $((SECONDS - S)) s"
