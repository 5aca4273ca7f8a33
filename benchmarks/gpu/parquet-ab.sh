#!/usr/bin/env bash
# Issue 21: this tree against another, on one instance. The other side is either a tree (OLD: the
# package at an earlier commit, e.g.
#   mkdir -p .ab/old && git archive <commit> csrc torch_fastload setup.py pyproject.toml | tar -x -C .ab/old
# carried to the device and built here) or this tree under other environment settings (OLD_ENV,
# e.g. "TORCH_FASTLOAD_DMA_ORDER=stream"). benchmarks/gpu/parquet_ab.py runs with each side in
# turn, AB_TURNS times: each turn's JSON line in $OUT/ab.jsonl. From the repo root:
#   OLD=.ab/old [AB_TURNS=3 AB_ROWS=1000000] bash benchmarks/gpu/parquet-ab.sh
#   OLD_ENV="TORCH_FASTLOAD_DMA_ORDER=stream" bash benchmarks/gpu/parquet-ab.sh
OUT=${OUT:-out/parquet-ab}
OLD=${OLD:-}
OLD_ENV=${OLD_ENV:-}
source benchmarks/gpu/parquet-setup.sh  # DATA, environment, $start, versions, this tree built
if [ -n "$OLD" ]; then
    (cd "$OLD" && timeout 150 python3 setup.py build_ext --inplace -q > "$OUT/build-old.log" 2>&1) \
        || { tail -20 "$OUT/build-old.log"; exit 1; }
    echo "old tree built at $((SECONDS - start)) s"
fi
for turn in $(seq 1 "${AB_TURNS:-3}"); do
    for side in new old; do
        tree=$PWD
        settings=""
        if [ "$side" = old ]; then
            [ -n "$OLD" ] && tree=$(cd "$OLD" && pwd)
            settings=$OLD_ENV
        fi
        env $settings PYTHONPATH="$tree" timeout 200 python3 benchmarks/gpu/parquet_ab.py "$DATA" "$side" \
            "${AB_ROUNDS:-7}" 2>> "$OUT/ab.err" | tee -a "$OUT/ab.jsonl" | python3 -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    print(d['label'], ' '.join(f\"{k} {v['over_read_table']:.3f}x first {v['first_batch_ms']} ms\" for k, v in d['files'].items()))"
    done
done
echo "total $((SECONDS - start)) s"
