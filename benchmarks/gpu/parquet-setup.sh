# Sourced by the Parquet GPU scripts (from the repo root, OUT set first): the data folder
# ($DATA), the environment, $start, pyarrow's and torch's versions in $OUT/versions.txt, and the
# extension built (the calling script exits if the build fails).
set -uo pipefail
DATA=${DATA:-/tmp/fastload-parquet}
mkdir -p "$OUT" "$DATA"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$SECONDS
python3 -c "import pyarrow, torch; print('pyarrow', pyarrow.__version__, 'torch', torch.__version__)" | tee "$OUT/versions.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/versions.txt"
timeout 150 python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - start)) s"
