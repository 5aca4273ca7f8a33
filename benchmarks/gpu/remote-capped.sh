#!/usr/bin/env bash
# Issue 22: the capped cells of benchmarks/remote.py only (no uncapped grid, no boto3, no epochs),
# at a given cap, twice, 1 s cells: the loader row (read-ahead) and the reader's span loop.
# Run from the repo root:  bash benchmarks/gpu/remote-capped.sh   (~1.5 min)
#   CAP=7.92e9 (the H200's auto cap: 60% of its uncapped loopback rate)
#   TORCH_FASTLOAD_LOOPBACK_PACE_S=0 restores the server's 256 KiB paced sends (the control)
set -uo pipefail
O=$OUT/remote-capped; mkdir -p "$O"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 120 python3 setup.py build_ext --inplace -q > "$O/build.log" 2>&1 || { tail -5 "$O/build.log"; exit 1; }
A="--skip-uncapped --skip-epochs --skip-boto3 --cap ${CAP:-7.92e9} --concurrency 16,64,128 --sizes 4MiB,16MiB"
A="$A --loader-concurrency 16,64,128 --min-seconds 1.0 --no-progress"
for k in 1 2; do
  timeout 150 python3 benchmarks/remote.py $A --out "$O/run-$k" > "$O/run-$k.log" 2>&1
  echo "== run $k: rc $?"; grep -E "latency .*(16|64|128) x  16 MiB|>= 80%" "$O/run-$k.log" | cut -c1-150
done
