# Sourced by one-call scripts from the repo root: kvikio's wheels, where carried in .whl/
# (benchmarks/gpu/README.md's table names what each script carries), installed under /tmp/site
# and PYTHONPATH set to find them and this tree; without wheels, this tree alone.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
