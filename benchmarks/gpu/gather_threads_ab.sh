#!/usr/bin/env bash
# Issue 21: the shuffled Parquet gather's threads (parquet_gather_threads) against the loader's
# pace: parquet_pace.py (the loader alone over the overlap row's shuffled 16K-row batches of the
# 1M snappy alert file, whole epochs and feeds) under each value in turn, ROUNDS times; a line a
# run, the JSON and logs tarred into $OUT/gather-threads.tgz. ~2 min after the build. From the
# repo root:
#   [THREADS="16 8 4 2" ROUNDS=2] bash benchmarks/gpu/gather_threads_ab.sh
export OUT=${OUT:-out/gather-threads}
source benchmarks/gpu/parquet-setup.sh  # DATA, environment, $start, versions, the build
runs=/tmp/gather-threads
mkdir -p "$runs"
for turn in $(seq 1 "${ROUNDS:-2}"); do
    for t in ${THREADS:-16 8 4 2}; do
        TORCH_FASTLOAD_PARQUET_GATHER_THREADS=$t timeout 90 python3 benchmarks/gpu/parquet_pace.py "$DATA" 6 30 \
            > "$runs/pace-$t-$turn.log" 2>&1
        mv "$OUT/parquet_pace-default.json" "$runs/pace-$t-$turn.json" 2>/dev/null
        echo "threads $t, turn $turn: $(grep 'ms/batch sorted' "$runs/pace-$t-$turn.log" | tr '\n' ' ')"
    done
done
tar czf "$OUT/gather-threads.tgz" -C /tmp gather-threads
echo "total $((SECONDS - start)) s"
