#!/usr/bin/env bash
# Issue 21: where the alert table's loader epoch goes: the decode-only ceiling, then the loader
# under pipeline settings (SET: ceiling, depth, stages, threads; benchmarks/gpu/parquet_variants.py),
# each line with the timed epoch's CPU seconds by thread group. Run from the repo root:
#   [SET=depth] bash benchmarks/gpu/parquet-pipeline.sh   (~1-2 min after the build; logs under $OUT)
OUT=${OUT:-out/parquet-pipeline}
source benchmarks/gpu/parquet-setup.sh  # DATA, environment, $start, versions, the build
{ lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA)"; echo "cpu0 siblings: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list)"; } | tee "$OUT/cpu.txt"
timeout ${VARIANTS_S:-330} python3 benchmarks/gpu/parquet_variants.py ${SET:-ceiling} "$DATA" 2>&1 | tee "$OUT/variants.log"
echo "total $((SECONDS - start)) s"
