#!/usr/bin/env bash
# Issue 21: the alert table's per-batch fetch (the variants decide fetch_threads for Parquet). Run from the repo root:
#   bash benchmarks/gpu/parquet-alert.sh          (logs + JSON under $OUT; ~5-7 min on an H100/H200)
# 1. build; 2. the Parquet CUDA tests; 3. benchmarks/parquet.py on the alert table only
# (1M, 2M, 4M rows; profile files skipped by --budget-s; small grid); its log line per file now
# ends with "(fetch: rows R tensors T)": R = waiting for the batch's row groups to decode (and
# gathers), T = building its tensors (was most of the fetch at main 68af35b?);
# 4. variants on alert 4M none / 1M snappy: default, fetch_threads 2 and 3 (batches fetched at
# once, new on this branch), GIL switch interval 0.1 ms, 8 row groups decoding at once; 5. the Parquet CPU tests if time is left.
OUT=${OUT:-out/parquet-alert}
source benchmarks/gpu/parquet-setup.sh  # DATA, environment, $start, versions, the build

echo "== CUDA tests of the Parquet source =="
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_parquet.py -m cuda 2>&1 | tail -5 | tee "$OUT/pytest_cuda.log"

echo "== benchmark: alert table only =="
timeout 200 python3 benchmarks/parquet.py --device cuda --out "$OUT" --dir "$DATA" --no-progress \
    --alert-rows 1000000,2000000,4000000 --profile-sizes 1M --budget-s 1 \
    --threads 16 --row-group-rows 131072 --grid-rows 1000000 --torch-workers 0 --torch-rows 2000 2>&1 \
    | tee "$OUT/benchmark.log" | grep -E "alert|read_table|FAIL|PASS|total"
echo "rc=${PIPESTATUS[0]} benchmark done at $((SECONDS - start)) s"

echo "== variants (second epoch timed, as the benchmark) =="
timeout 120 python3 benchmarks/gpu/parquet_variants.py alert "$DATA" 2>&1 | tee "$OUT/variants.log"

left=$((460 - (SECONDS - start)))
if [ "$left" -gt 40 ]; then
    echo "== Parquet CPU tests (${left} s left) =="
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_parquet.py tests/test_parquet_runs.py tests/test_parquet_ranges.py -x 2>&1 | tail -4 | tee "$OUT/pytest.log"
fi
echo "total $((SECONDS - start)) s"
