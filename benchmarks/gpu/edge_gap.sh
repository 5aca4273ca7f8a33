#!/usr/bin/env bash
# Issue 17: where the GPU waits at an epoch's edge, and which setting moves it (~3 min with the
# build). The CUDA smoke test of edge_gpu_gap.py, then edge_gpu_gap.py (TensorDataset and
# ArrayDataset mapped at their defaults against device-resident batches, 10 batches an epoch at
# GIB=0.5) under each of VARIANTS: settings given as environment variables, "default" for none.
# The defaults' variants test the suspects: the group's one block a field (output_blocks=batch),
# the turn thread (0), the loop kept across epochs (0), a group of one batch (allocate_ahead=1).
#   bash benchmarks/gpu/edge_gap.sh      (at most 8 files under $OUT)
set -uo pipefail; ONE_CALL=edge_gap; source benchmarks/gpu/one-call.sh
rm -f "$OUT/build.log"  # the device tool returns 8 files a call
timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_benchmarks_smoke.py -k edge_gpu_gap \
  > "$OUT/smoke.log" 2>&1
echo "smoke test rc $?: $(tail -1 "$OUT/smoke.log")"
VARIANTS=${VARIANTS:-default TORCH_FASTLOAD_OUTPUT_BLOCKS=batch TORCH_FASTLOAD_TURN_THREAD=0 TORCH_FASTLOAD_KEEP_LOOP=0 TORCH_FASTLOAD_ALLOCATE_AHEAD=1}
for variant in $VARIANTS; do
  [ $((SECONDS - S)) -gt "${UNTIL_S:-480}" ] && { echo "$variant skipped: out of time"; continue; }
  name=$(echo "$variant" | sed 's/^TORCH_FASTLOAD_//; s/=/-/' | tr 'A-Z' 'a-z')
  mkdir -p "/tmp/gap-$name"
  settings=(); [ "$variant" = default ] || settings=("$variant")
  echo "== $variant"
  env "${settings[@]}" OUT="/tmp/gap-$name" timeout 150 python3 benchmarks/gpu/edge_gpu_gap.py --data-gib "${GIB:-0.5}" \
    --rounds "${ROUNDS:-2}" 2>&1 | tail -13
  cp "/tmp/gap-$name/edge-gpu-gap.json" "$OUT/gap-$name.json" 2>/dev/null
done
echo "done in $((SECONDS - S)) s"
