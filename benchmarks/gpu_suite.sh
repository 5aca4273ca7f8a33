#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the cuda-marked tests and the whole
# suite, then the benchmarks. Logs and JSON/PNG land in $OUT (tarred: the tool returns <= 8 files).
# Usage: bash benchmarks/gpu_suite.sh [quick|full] [tests|bench|files|images|all]
#   files: the file-backed read benchmarks only (doctor, file_loader, read_sweep)
#   images: image tests and imagenet_loader; train: imagenet_train (ResNet-50/18 end to end)
# kvikio is not on the GPU machine: carry its wheels (../shared/scripts/gpu-wheels.sh) in .whl/.
set -uo pipefail
mode=${1:-full}; what=${2:-all}
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT/res"
log() { echo "=== $* [$(date +%T)]"; }
if ls .whl/*.whl >/dev/null 2>&1; then  # outside the { } | tee below: that runs in a subshell
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/fastload-site .whl/*.whl \
    && export PYTHONPATH=/tmp/fastload-site${PYTHONPATH:+:$PYTHONPATH} || echo "kvikio wheels did not install"
fi
{
log "machine"; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'gpus', torch.cuda.device_count())"
nproc; free -g | head -2
log "build"; python3 setup.py -q build_ext --inplace 2>&1 | tail -3
python3 -c "import torch_fastload._C as c; print('_C ok', [n for n in dir(c) if not n.startswith('__')])"
} 2>&1 | tee "$OUT/res/suite.log"
if [[ $what == tests || $what == all ]]; then
  log "cuda tests" | tee -a "$OUT/res/suite.log"
  timeout 900 python3 -m pytest tests -m "cuda or multigpu" -v -rs 2>&1 | tee "$OUT/res/cuda_tests.log" | tail -40
  if [[ $mode == full ]]; then
    log "all tests" | tee -a "$OUT/res/suite.log"
    timeout 900 python3 -m pytest tests -q -x -rs 2>&1 | tee "$OUT/res/all_tests.log" | tail -15
  fi
fi
if [[ $what == files || $what == all ]]; then
  q=""; [[ $mode == quick ]] && q="--quick"
  log "doctor" | tee -a "$OUT/res/suite.log"
  timeout 240 python3 -m torch_fastload doctor --size 2G --no-progress --json "$OUT/res/doctor.json" 2>&1 | tee "$OUT/res/doctor.log" | tail -30
  log "file_loader" | tee -a "$OUT/res/suite.log"
  timeout 400 python3 benchmarks/file_loader.py $q --no-progress --out "$OUT/res" 2>&1 | tee "$OUT/res/file_loader.log" | tail -45
  log "read_sweep" | tee -a "$OUT/res/suite.log"
  timeout 500 python3 benchmarks/read_sweep.py $q --no-progress --out "$OUT/res" 2>&1 | tee "$OUT/res/read_sweep.log" | tail -30
fi
if [[ $what == images || $what == all ]]; then
  log "image tests" | tee -a "$OUT/res/suite.log"
  timeout 300 python3 -m pytest tests/test_images.py -v -rs -s 2>&1 | tee "$OUT/res/image_tests.log" | tail -40
  log "imagenet_loader" | tee -a "$OUT/res/suite.log"
  timeout 400 python3 benchmarks/imagenet_loader.py --no-progress --out "$OUT/res" 2>&1 | tee "$OUT/res/imagenet_loader.log" | tail -25
fi
if [[ $what == train || $what == all ]]; then
  log "imagenet_train" | tee -a "$OUT/res/suite.log"
  timeout 600 python3 benchmarks/imagenet_train.py --no-progress --out "$OUT/res" 2>&1 | tee "$OUT/res/imagenet_train.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  q=""; [[ $mode == quick ]] && q="--quick"
  log "pin_memory" | tee -a "$OUT/res/suite.log"
  timeout 600 python3 benchmarks/pin_memory.py $q --out "$OUT/res" 2>&1 | tee "$OUT/res/pin_memory.log" | tail -40
  log "overlap" | tee -a "$OUT/res/suite.log"
  timeout 600 python3 benchmarks/overlap.py $q --out "$OUT/res" 2>&1 | tee "$OUT/res/overlap.log" | tail -40
  log "main job" | tee -a "$OUT/res/suite.log"
  timeout 300 python3 -m torch_fastload.bench --json "$OUT/res/bench.json" 2>&1 | tee "$OUT/res/bench.log" | tail -25
fi
tar -C "$OUT" -czf "$OUT/results.tgz" res && rm -rf "$OUT/res"
log "done"
