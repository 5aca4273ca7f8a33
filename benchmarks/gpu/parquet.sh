#!/usr/bin/env bash
# GPU checks of branch parquet2 (issue 21). Run from the repo root:
#   bash .gpu/parquet.sh      (logs, parquet.json and parquet.png under $OUT; <= 8 min on an H100/H200)
# Data is generated under /tmp/fastload-parquet (never under $OUT): ~6 GB, written once, by 8
# processes at once. Order: build, CUDA tests, the benchmark (alert + profile suite), then the
# CPU tests of the Parquet file in whatever time is left.
OUT=${OUT:-out/parquet}
source benchmarks/gpu/parquet-setup.sh  # DATA, environment, $start, versions, the build

echo "== CUDA tests of the Parquet source =="
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_parquet.py -m cuda 2>&1 | tail -15 | tee "$OUT/pytest_cuda.log"

left=$((430 - (SECONDS - start)))
echo "== benchmark (time left: ${left} s; the JSON is saved after every file, so a cut run keeps its cells) =="
timeout "$left" python3 benchmarks/parquet.py --device cuda --out "$OUT" --dir "$DATA" --no-progress --budget-s $((left - 40)) 2>&1 \
    | tee "$OUT/benchmark.log" | tail -90
echo "rc=${PIPESTATUS[0]} benchmark done at $((SECONDS - start)) s"

left=$((470 - (SECONDS - start)))
if [ "$left" -gt 20 ]; then
    echo "== the whole Parquet test file on this machine (CPU paths; ${left} s left) =="
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_parquet.py -x 2>&1 | tail -8 | tee "$OUT/pytest.log"
else
    echo "== no time left for the CPU test file (it passes on the CPU machine) ==" | tee "$OUT/pytest.log"
fi
echo "total $((SECONDS - start)) s"
