#!/usr/bin/env bash
# Issue 21: per-thread timelines of the loader's timed epoch over the alert table (4M rows none,
# 1M snappy), with the GIL probe; JSON and PNG per variant under $OUT. From the repo root:
#   [VARIANTS="default arrow-off prefetch8"] bash benchmarks/gpu/parquet-timeline.sh   (~1-2 min)
OUT=${OUT:-out/parquet-timeline}
source benchmarks/gpu/parquet-setup.sh  # DATA, environment, $start, versions, the build
timeout ${TIMELINE_S:-300} python3 benchmarks/gpu/parquet_timeline.py "$DATA" "$OUT" ${VARIANTS:-default arrow-off prefetch8} 2>&1 | tee "$OUT/timeline.log"
python3 benchmarks/gpu/parquet_timeline_plot.py "$OUT"/timeline-*.json > /dev/null 2>&1 || echo "no PNG (matplotlib?)"
# the device tool returns few files: one archive of the JSON and PNGs
tar czf "$OUT/timelines.tgz" -C "$OUT" $(cd "$OUT" && ls timeline-*) && rm -f "$OUT"/timeline-*
echo "total $((SECONDS - start)) s"
