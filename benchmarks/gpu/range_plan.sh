#!/usr/bin/env bash
# Issue 21: Parquet batches of consecutive rows planned in C++ (parquet_range_plan, csrc/range_plan.cpp)
# against the Python route (range_tensors + plan_batch + plan_copy) on one instance: the CUDA tests
# of the Parquet routes and the native loop, then parquet-ab.sh with the route off as the other side
# (240K and 1M rows, none and snappy, AB_TURNS turns), then the 1M-row uncompressed epoch traced.
# From the repo root (~6-8 min with the data written):
#   bash benchmarks/gpu/range_plan.sh
set -uo pipefail
OUT=${OUT:-$PWD/out/range_plan}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
source benchmarks/gpu/kvikio-env.sh
S=$SECONDS
timeout 150 python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - S)) s"
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_parquet_ranges.py \
    tests/test_parquet_arena.py tests/test_parquet.py tests/test_native_cuda.py > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests rc $? at $((SECONDS - S)) s: $(tail -1 "$OUT/cuda-tests.log")"
OLD_ENV="TORCH_FASTLOAD_PARQUET_RANGE_PLAN=0" AB_ROWS=${AB_ROWS:-240000,1000000} AB_TURNS=${AB_TURNS:-3} \
    bash benchmarks/gpu/parquet-ab.sh > "$OUT/ab.log" 2>&1
cat "$OUT/ab.log"
TIMELINE_ROWS=1000000,240000 TIMELINE_AT_ONCE= VARIANTS=default TIMELINE_REPEAT=2 bash benchmarks/gpu/parquet-timeline.sh \
    > /dev/null 2>&1
grep -E "GB/s x|ms busy" "$OUT/timeline.log" | head -6
echo "total $((SECONDS - S)) s"
