#!/usr/bin/env bash
# Issue 22 (object storage) on the GPU host, no network: boto3 from local wheels, the remote
# tests (CUDA ones included), then benchmarks/remote.py (capped + uncapped grids, fastload vs
# boto3 vs kvikio; cache-hit vs local loader epochs on cuda). Run from the repo root:
#   bash .gpu/remote.sh            (wheels: .gpu/wheels/remote, or WHEELS=dir)
# kvikio's wheels in .whl/ (as gpu_suite.sh carries them) are installed too: its grids then run.
# Everything comes back as one file, $OUT/remote.tgz (remote.log, remote.json, remote.png,
# tests.log); the verdicts are also printed at the end. About 5-6 minutes.
# Dry run elsewhere: REMOTE_BENCH_ARGS=--cpu-smoke REMOTE_TESTS="tests/test_remote.py -k cache" bash .gpu/remote.sh
set -uo pipefail
OUT=${OUT:-$PWD/.gpu/out}
WHEELS=${WHEELS:-.gpu/wheels/remote}
WORK=$(mktemp -d /tmp/remote-run.XXXXXX)
mkdir -p "$OUT" "$WORK/remote"
started=$(date +%s)

{
  echo "== machine"; python3 --version; nvidia-smi -L 2>/dev/null; nproc
  echo "== wheels from $WHEELS into /tmp/site (pure Python: boto3 botocore s3transfer jmespath python-dateutil six urllib3)"
  rm -rf /tmp/site && mkdir -p /tmp/site
  ls "$WHEELS"/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
      || echo "the wheels in .whl/ (kvikio) did not install"
  fi
} 2>&1 | tee "$WORK/tests.log"
export PYTHONPATH=/tmp/site:$PWD
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

{
  python3 -c "import boto3, botocore, urllib3, dateutil; print('boto3', boto3.__version__, 'botocore', botocore.__version__, 'urllib3', urllib3.__version__)"
  python3 -c "import moto; print('moto', moto.__version__)" 2>/dev/null \
    || echo "moto is not installed: tests/test_remote_s3.py skips (the loopback HTTP tests in test_remote.py run)"
  python3 -c "import kvikio; print('kvikio', kvikio.__version__)" 2>/dev/null || echo "kvikio is not installed"
  echo "== build"
  python3 setup.py build_ext --inplace -q 2>&1 | grep -v -i "warning\|^\s*$\|\*\*\*\|!!\|license\|See https\|By 20\|corresp\|_finalize" | tail -5
  python3 -c "import torch_fastload, torch; print(torch_fastload.__file__, torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
  echo "== tests ($(($(date +%s) - started)) s)"
  timeout 150 python3 -m pytest -q -rs ${REMOTE_TESTS:-tests/test_remote.py tests/test_remote_s3.py tests/test_remote_client.py tests/test_remote_ahead.py} 2>&1 | tail -25
} 2>&1 | tee -a "$WORK/tests.log"

echo "== benchmark ($(($(date +%s) - started)) s)"
# the full grid took 3-4 min on the H200 host with two libraries; with boto3 as a third, one
# concurrency row fewer and 0.4 s cells (~190 cells, ~3 min estimated) keep the call in 8 minutes.
# The capped grids' loader row (DataLoader on cuda with the remote read-ahead: the cap verdict)
# adds 24 cells of ~0.6-1.2 s (16/64/128 x 4 sizes x 2 latencies)
timeout 330 python3 benchmarks/remote.py --no-progress ${REMOTE_BENCH_ARGS:---concurrency 1,16,64,128 --min-seconds 0.4} \
  --out "$WORK/remote" --dir /tmp/remote-bench-data \
  > "$WORK/remote/remote.log" 2>&1
echo "benchmarks/remote.py: rc $? after $(($(date +%s) - started)) s" | tee -a "$WORK/remote/remote.log"
grep -E "uncapped loopback|loader epochs|^    (cache|local):|cache-hit epochs|  io:" "$WORK/remote/remote.log"
sed -n '/^loader, latency/,/^$/p' "$WORK/remote/remote.log"
sed -n '/^no cap: each library/,/^$/p;/^verdicts:/,$p' "$WORK/remote/remote.log"

cp "$WORK/tests.log" "$WORK/remote/"
rm -rf /tmp/remote-bench-data
tar czf "$OUT/remote.tgz" -C "$WORK" remote && ls -la "$OUT/remote.tgz"
rm -rf "$WORK"
