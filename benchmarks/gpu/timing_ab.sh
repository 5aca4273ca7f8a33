#!/usr/bin/env bash
# Issue 17: copy_timing_every A/B on one instance (~7 min with the build). The native loop's CUDA
# tests; then the main job with its defaults (3 rounds, the device-resident baseline in each run)
# under TORCH_FASTLOAD_COPY_TIMING_EVERY=1 (the copies of every batch timed by two CUDA events, as
# before) and =16 (the default), alternated PAIRS times; then beside_step.py's launch-bound rows
# for the TensorDataset feeds under each, alternated twice (9 alone/beside pairs a row).
# From the repo root:  bash benchmarks/gpu/timing_ab.sh [PAIRS]     (logs and JSON under $OUT)
set -uo pipefail
PAIRS=${1:-5}
ONE_CALL=timing_ab; source benchmarks/gpu/one-call.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_native_cuda.py 2>&1 | tail -2 | tee "$OUT/tests.log"
for k in $(seq "$PAIRS"); do
  for every in $(ab_order "$k" 1 16); do
    echo "== copy_timing_every=$every, pair $k"
    TORCH_FASTLOAD_COPY_TIMING_EVERY=$every timeout 100 python3 -m torch_fastload.bench --no-progress --repeats 3 \
      --torch-workers 0 --json "/tmp/bench-$every-$k.json" 2>&1 \
      | grep -E "^torch_fastload \(|^device-resident|vs device-resident|^PASS|^FAIL"
  done
done 2>&1 | tee "$OUT/bench.log"
python3 - "$PAIRS" <<'PY' | tee "$OUT/bench-summary.log"
import json, statistics, sys
pairs = int(sys.argv[1])
summary = {}
for every in (1, 16):
    runs = [json.load(open(f"/tmp/bench-{every}-{k}.json")) for k in range(1, pairs + 1)]
    vs = [r["vs_resident"] for r in runs if r.get("vs_resident")]
    rounds = [x for v in vs for x in v["round_ratios"]]
    summary[every] = {
        "rounds_median_per_run": [v["paired_ratio"] for v in vs],
        "all_rounds": rounds,
        "wait": [v["wait_fraction"] for v in vs],
        "resident_wait": [v["resident_wait_fraction"] for v in vs],
    }
    print(f"copy_timing_every={every}: rounds' medians {[round(v['paired_ratio'], 3) for v in vs]}, "
          f"all {len(rounds)} rounds median {statistics.median(rounds):.3f}x; input wait "
          f"{[round(100 * v['wait_fraction'], 1) for v in vs]}% (resident "
          f"{[round(100 * v['resident_wait_fraction'], 1) for v in vs]}%)")
json.dump(summary, open("/tmp/bench-summary.json", "w"), indent=1)
PY
cp /tmp/bench-summary.json "$OUT/"
for k in 1 2; do
  for every in $(ab_order "$k" 1 16); do
    echo "== beside_step launch-bound, copy_timing_every=$every, run $k"
    TORCH_FASTLOAD_COPY_TIMING_EVERY=$every timeout 120 python3 benchmarks/beside_step.py --quick --launch-repeats 9 \
      --no-progress --out "/tmp/beside-$every-$k" --only "TensorDataset (C++" 2>&1 | grep -A9 "^launch-bound"
  done
done 2>&1 | tee "$OUT/beside.log"
echo "done in $((SECONDS - S)) s"
