#!/usr/bin/env bash
# p21d (issue 21, alert table floor): range batches' offsets rebased by the stager in C++ (PendingOffsets),
# masks as PendingConcat, no per-batch Arrow table. Run from the repo root: bash benchmarks/gpu/parquet-offsets.sh  (<= 6 min)
# 1. build; 2. benchmarks/parquet.py on the alert table only (the lines of benchmarks/gpu/parquet-alert.sh);
# 3. the variants (default, fetch_threads 2/3, ...) on alert 4M none / 1M snappy; 4. the fetch probe
# (fetch alone, beside Python threads, live; cProfile; the loader to cuda over row groups decoded
# beforehand: the pipeline's pace without decode); 5. the Parquet CPU tests if time is left.
# Every step's timeout is cut to what is left of 350 s.
set -uo pipefail
OUT=${OUT:-out/p21d}
DATA=${DATA:-/tmp/fastload-parquet}
mkdir -p "$OUT" "$DATA"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$SECONDS
cap() { local left=$((350 - (SECONDS - start))); [ "$left" -lt 1 ] && left=1; [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
python3 -c "import pyarrow, torch; print('pyarrow', pyarrow.__version__, 'torch', torch.__version__)" | tee "$OUT/versions.txt"
git log --oneline -1 | tee -a "$OUT/versions.txt"
timeout $(cap 150) python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "from torch_fastload._C import rebase_offsets" || { echo "rebase_offsets missing from the build"; exit 1; }
echo "built in $((SECONDS - start)) s"

echo "== CUDA tests of the Parquet source (offsets staged into the pinned slot) =="
timeout $(cap 60) python3 -m pytest -q -p no:cacheprovider tests/test_parquet.py tests/test_parquet_offsets.py -m cuda 2>&1 | tail -5 | tee "$OUT/pytest_cuda.log"

echo "== benchmark: alert table only (as benchmarks/gpu/parquet-alert.sh) =="
timeout $(cap 150) python3 benchmarks/parquet.py --device cuda --out "$OUT" --dir "$DATA" --no-progress \
    --alert-rows 1000000,2000000,4000000 --profile-sizes 1M --budget-s 1 \
    --threads 16 --row-group-rows 131072 --grid-rows 1000000 --torch-workers 0 --torch-rows 2000 2>&1 \
    | tee "$OUT/benchmark.log" | grep -E "alert|read_table|FAIL|PASS|total"
echo "rc=${PIPESTATUS[0]} benchmark done at $((SECONDS - start)) s"

echo "== variants (second epoch timed, as the benchmark) =="
timeout $(cap 100) python3 benchmarks/gpu/parquet_variants.py offsets "$DATA" 2>&1 | tee "$OUT/variants.log"
echo "variants done at $((SECONDS - start)) s"

echo "== fetch probe: alert 4M none, 16 decode threads =="
timeout $(cap 60) python3 benchmarks/parquet_fetch_probe.py --dir "$DATA" --rows 4000000 --compression none \
    --batch-rows 67517 --threads 16 --copy-threads 8 --hogs 16 --repeat 2 --profile --device cuda 2>&1 | tee "$OUT/probe.log"
echo "probe done at $((SECONDS - start)) s"

left=$((350 - (SECONDS - start)))
if [ "$left" -gt 30 ]; then
    echo "== Parquet CPU tests (${left} s left) =="
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_parquet_offsets.py tests/test_parquet_ranges.py \
        tests/test_parquet.py tests/test_parquet_runs.py tests/test_parquet_parallel.py -x 2>&1 | tail -4 | tee "$OUT/pytest.log"
fi
echo "total $((SECONDS - start)) s"
