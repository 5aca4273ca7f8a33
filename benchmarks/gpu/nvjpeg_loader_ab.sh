#!/usr/bin/env bash
# decode_backend='nvjpeg' (nvJPEG called directly) against torchvision's op inside the loader, on
# one instance: the direct decoder's CUDA tests (its pixels, its refusals, no wait for the caller's
# stream), the loader alone at CPU shares 0 / 0.25 / 0 with each backend in turn, then the stage
# phases beside a ResNet-18 step at share 0 with each. ~4 min with the build. From the repo root
# (kvikio's wheels in .whl/ optional):  bash benchmarks/gpu/nvjpeg_loader_ab.sh   (JSON under $OUT)
set -uo pipefail
ONE_CALL=nvjpeg_loader_ab; source benchmarks/gpu/one-call.sh
timeout 120 python3 -m pytest -q tests/test_images.py tests/test_gpu_backend.py -m cuda -k "nvjpeg or direct" > "$OUT/tests.log" 2>&1
echo "tests rc $? at $((SECONDS - S)) s"; tail -1 "$OUT/tests.log"
timeout 150 python3 benchmarks/gpu/split_probe.py "$OUT/loader-ab.json" --skip-raw --shares 0,0.25,0 --stage-threads 3 \
  --backends torchvision,nvjpeg > "$OUT/loader-ab.log" 2>&1
echo "loader rc $? at $((SECONDS - S)) s"
grep -E "^decode_backend|^loader share" "$OUT/loader-ab.log" | paste - - | cut -c1-160
for backend in nvjpeg torchvision; do
  timeout 100 python3 benchmarks/gpu/beside_probe.py "$OUT/beside-$backend.json" --share 0 --backend "$backend" \
    > "$OUT/beside-$backend.log" 2>&1
  echo "== $backend rc $? at $((SECONDS - S)) s"; grep -E "^beside the|^loader share|^_decode_on_gpu" "$OUT/beside-$backend.log"
done
