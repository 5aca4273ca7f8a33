# Sourced by the one-call scripts from the repo root, after `set -uo pipefail`: $OUT (default
# out/$ONE_CALL, the script's name), unbuffered Python, kvikio's wheels where carried
# (kvikio-env.sh), $S the start, the GPU named, and the extension built (its log in
# $OUT/build.log; the script stops if the build fails).
OUT=${OUT:-$PWD/out/$ONE_CALL}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/kvikio-env.sh
S=$SECONDS
nvidia-smi -L
timeout 150 python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - S)) s"
# The modes of an A/B's round k, reversed every other round (the second run of a round reads
# higher, thirty-first session): for mode in $(ab_order "$k" $MODES); do ...
ab_order() { local k=$1; shift; if [ $((k % 2)) = 0 ]; then printf '%s\n' "$@" | tac | tr '\n' ' '; else echo "$@"; fi; }
