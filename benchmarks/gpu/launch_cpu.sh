#!/usr/bin/env bash
# Issue 17: the launch-bound thread beside each loader with its own CPU time recorded, in the modes
# of launch_cpu_probe.py, on one instance (~2-4 min). TESTS=1: the native tests first (CPU and CUDA).
#   bash benchmarks/gpu/launch_cpu.sh   (ROUNDS, FEEDS, MODES, DATA_GIB, LAUNCH_SCALE as the probe reads them)
set -uo pipefail; ONE_CALL=launch_cpu
source benchmarks/gpu/one-call.sh
rm -f "$OUT/build.log"
lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\))" | sed 's/  */ /g' | tr '\n' ';'; echo
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_native_cuda.py tests/test_native.py \
    > "$OUT/native-tests.log" 2>&1
  echo "native tests rc $?: $(tail -1 "$OUT/native-tests.log")"; grep -E "^FAILED|^ERROR" "$OUT/native-tests.log" | head
fi
timeout 420 python3 benchmarks/gpu/launch_cpu_probe.py "${ROUNDS:-9}" > "$OUT/launch-cpu.log" 2>&1
echo "probe rc $?"; grep -v '^{' "$OUT/launch-cpu.log" | grep -v "Warning\|for worker" | tail -40
tail -1 "$OUT/launch-cpu.log" > "$OUT/launch-cpu.json"
echo "done in $((SECONDS - S)) s"
