#!/usr/bin/env bash
# Issue 17: memory_rows routes in the main job on one instance (~4 min with the build): the main
# job with its defaults (3 rounds, device-resident baseline in each run) under
# TORCH_FASTLOAD_MEMORY_ROWS=auto (the default), gather (CPU threads into a pinned slot, one H2D
# copy a batch) and kernel, interleaved ROUNDS times (default 2).
# From the repo root:  bash benchmarks/gpu/rows_ab.sh        (logs and JSON under $OUT)
set -uo pipefail
ONE_CALL=rows_ab; source benchmarks/gpu/one-call.sh
for k in $(seq 1 "${ROUNDS:-2}"); do
  for rows in $(ab_order "$k" ${ROUTES:-auto gather kernel}); do
    echo "== memory_rows=$rows, round $k"
    TORCH_FASTLOAD_MEMORY_ROWS=$rows timeout 100 python3 -m torch_fastload.bench --no-progress --repeats 3 \
      --torch-workers 0 --json "$OUT/bench-$rows-$k.json" 2>&1 \
      | grep -E "^torch_fastload \(|^device-resident|vs device-resident|input wait|^PASS|^FAIL"
  done
done
echo "done in $((SECONDS - S)) s"
