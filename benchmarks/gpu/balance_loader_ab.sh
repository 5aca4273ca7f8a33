#!/usr/bin/env bash
# Issue 20: the loader alone under cpu_decode_share='auto' with balance_split on (the default:
# a split started at once and balanced online) and off (splits timed in windows, the fastest
# kept), alternated three times on one instance, 10,000 JPEGs, 3 stage threads (~4 min):
#   bash benchmarks/gpu/balance_loader_ab.sh        (JSON and logs under $OUT)
set -uo pipefail
ONE_CALL=balance_loader_ab; source benchmarks/gpu/one-call.sh
for turn in 1 2 3; do
  for balance in 1 0; do
    TORCH_FASTLOAD_BALANCE_SPLIT=$balance timeout 60 python3 benchmarks/gpu/split_probe.py "$OUT/loader-$turn-$balance.json" \
      --skip-raw --shares auto --stage-threads 3 --per-class 100 > "$OUT/loader-$turn-$balance.log" 2>&1
    echo "== turn $turn balance_split=$balance rc $? at $((SECONDS - S)) s"
    grep -E "^loader share" "$OUT/loader-$turn-$balance.log" | cut -c1-300
  done
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/loader-*.json")):
    r = json.load(open(path))["loader"][0]
    print(path.rsplit("/", 1)[1], round(r["images_per_s"]), r["chosen"], "|", (r.get("trial") or [""])[0][-160:])
PY
tar -czf "$OUT/logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
