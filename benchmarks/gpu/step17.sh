#!/usr/bin/env bash
# Issue 17 on the GPU host, one call (~3 min): the native loop's CUDA tests, the main job with its
# defaults twice (3 repeats a loader; the device-resident row is the same-run baseline), next()'s
# pieces timed inside the job (next_pieces.py), and beside_step.py --quick for the TensorDataset
# feeds (the bare pinned copy row is the link's own cost). Run from the repo root with kvikio's
# wheels in .whl/ (optional):  bash benchmarks/gpu/step17.sh      (logs and JSON under $OUT)
set -uo pipefail
OUT=${OUT:-$PWD/out/step17}; mkdir -p "$OUT"
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python && chmod +x /tmp/bin/python
export PATH=/tmp/bin:$PATH PYTHONUNBUFFERED=1 OUT
source benchmarks/gpu/kvikio-env.sh
S=$SECONDS
nvidia-smi -L
timeout 150 python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_native_cuda.py 2>&1 | tail -2 | tee "$OUT/tests.log"
for k in 1 2; do
  timeout 100 python3 -m torch_fastload.bench --no-progress --repeats 3 --torch-workers 0 --json "$OUT/bench-$k.json" 2>&1 \
    | grep -E "^torch_fastload \(|^device-resident|path=|vs device-resident|^PASS|^FAIL" | tee -a "$OUT/bench.log"
done
timeout 90 python3 benchmarks/gpu/next_pieces.py > "$OUT/next_pieces.log" 2>&1; tail -40 "$OUT/next_pieces.log"
timeout 150 python3 benchmarks/beside_step.py --quick --no-progress --out /tmp/beside --only "TensorDataset (C++" 2>&1 \
  | grep -B10 -A9 "^launch-bound" | tee "$OUT/beside.log"
cp /tmp/beside/beside_step.json "$OUT/" 2>/dev/null
echo "done in $((SECONDS - S)) s"
