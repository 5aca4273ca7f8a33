#!/usr/bin/env bash
# Issue 17: allocate_ahead A/B on one instance (~6 min with the build; since the group submit,
# =1 also submits each batch alone). The native loop's CUDA
# tests, then the main job with its defaults (3 rounds, device-resident baseline in each run)
# under TORCH_FASTLOAD_ALLOCATE_AHEAD=1 (a switch to the copy stream for each batch, as before)
# and =4 (the default), interleaved twice; then next()'s pieces inside the job under each.
# From the repo root:  bash benchmarks/gpu/alloc_ab.sh        (logs and JSON under $OUT)
set -uo pipefail
ONE_CALL=alloc_ab; source benchmarks/gpu/one-call.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_native_cuda.py 2>&1 | tail -2 | tee "$OUT/tests.log"
for k in 1 2; do
  for ahead in 1 4; do
    echo "== allocate_ahead=$ahead, round $k"
    TORCH_FASTLOAD_ALLOCATE_AHEAD=$ahead timeout 100 python3 -m torch_fastload.bench --no-progress --repeats 3 \
      --torch-workers 0 --json "$OUT/bench-$ahead-$k.json" 2>&1 \
      | grep -E "^torch_fastload \(|^device-resident|vs device-resident|^PASS|^FAIL"
  done
done
for ahead in 1 4; do
  mkdir -p "$OUT/pieces-$ahead"
  OUT="$OUT/pieces-$ahead" TORCH_FASTLOAD_ALLOCATE_AHEAD=$ahead timeout 90 python3 benchmarks/gpu/next_pieces.py \
    > "$OUT/pieces-$ahead/log" 2>&1
  python3 - "$OUT/pieces-$ahead/next-pieces.json" "$ahead" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"allocate_ahead={sys.argv[2]}: " + ", ".join(
    f"{k} p50 {d[k]['p50_us']:.1f} mean {d[k]['mean_us']:.1f} us" for k in ("next", "_fill", "_allocate", "loop.take") if k in d))
PY
done
echo "done in $((SECONDS - S)) s"
