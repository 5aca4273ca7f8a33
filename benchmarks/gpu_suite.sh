#!/usr/bin/env bash
# One call on the GPU machine: build the extension, then tests and/or benchmarks. Logs, JSON and
# PNGs go to $RES (default /tmp/fastload-suite/res), tarred into $OUT/results.tgz after every
# part, so $OUT holds three files whenever the call ends: results.tgz, times.txt, compare.txt.
#
#   bash benchmarks/gpu_suite.sh MODE [PARTS]
#   MODE   full    every study at its full size (as the record was taken)
#          quick   the studies' --quick sizes
#          verify  every benchmark once, short enough that all fit in ~9 min on one H100, then
#                  benchmarks/compare.py prints each figure RESULTS.md cites beside the record's
#   PARTS  comma-separated: tests, pinned (h2d_copy, staging, pinned_loop), overlap, bench (the
#          main job), files (file_loader, read_sweep; doctor in full), features, images (image
#          tests in full, imagenet_loader), train (imagenet_train), ddp (ddp_scaling, 1 GPU in
#          verify); all = every part (tests only in full and quick)
#
# verify on one H100, expected seconds a part (a part whose estimate would pass VERIFY_BUDGET,
# default 540 s, is skipped and says so): build 0 (built) to 60; pinned 40; overlap 60; bench 45;
# files 150 (writes 7 GiB once); features 40; images 90 (writes 11k JPEGs once); train 120 (four
# fresh example processes); ddp 30 (writes 4 GiB once). About 9 min in all.
# kvikio is not on an offline GPU machine: download its wheels elsewhere (pip download kvikio-cu13
# libkvikio-cu13 rapids-logger --python-version 3.12 --only-binary=:all: -d .whl) and carry .whl/.
set -uo pipefail
mode=${1:-full}
parts=${2:-all}
[[ $parts == all && $mode == verify ]] && parts=pinned,overlap,bench,files,features,images,train,ddp
OUT=${OUT:-$PWD/out}
RES=${RES:-/tmp/fastload-suite/res}
DATA=${DATA:-/tmp/fastload-suite/data}  # generated data: never under $OUT
BUDGET=${VERIFY_BUDGET:-540}
mkdir -p "$OUT" "$RES" "$DATA"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/fastload-site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fastload-site || echo "kvikio wheels did not install"
fi
q=()
[[ $mode != full ]] && q=(--quick)
want() { [[ $parts == all || ,$parts, == *,$1,* ]]; }
pack() { tar -C "$(dirname "$RES")" -czf "$OUT/results.tgz" "$(basename "$RES")"; }

# run NAME ESTIMATE_S TIMEOUT_S CMD...: the command's output in $RES/NAME.log; on the terminal its
# verdict lines (all of its tail with TAIL=N) and its time
run() {
  local name=$1 estimate=$2 limit=$3 t0=$SECONDS rc
  shift 3
  if [[ $mode == verify ]] && ((SECONDS + estimate > BUDGET)); then
    echo "--- $name skipped: ${SECONDS} s gone, ~${estimate} s more would pass the ${BUDGET} s budget" | tee -a "$OUT/times.txt"
    return
  fi
  echo "=== $name [$(date +%T)]"
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  rc=$?
  if [[ -n ${TAIL:-} ]]; then tail -n "$TAIL" "$RES/$name.log"; else grep -E '^(PASS|FAIL|INFO|FAILED)' "$RES/$name.log" | cut -c1-160; fi
  echo "--- $name: rc $rc, $((SECONDS - t0)) s" | tee -a "$OUT/times.txt"
  pack
}

: >"$OUT/times.txt"
{
  nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'gpus', torch.cuda.device_count())"
  echo "cpus $(nproc), $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-80)"
} | tee "$RES/machine.txt"
run build 60 600 python3 setup.py -q build_ext --inplace
if want tests && [[ $mode != verify ]]; then
  run cuda_tests 300 900 python3 -m pytest tests -m "cuda or multigpu" -v -rs
  [[ $mode == full ]] && run all_tests 420 900 python3 -m pytest tests -q -x -rs
fi
B=(--no-progress --out "$RES")
if want pinned; then
  sizes=(); [[ $mode == verify ]] && sizes=(--sizes 1MiB,16MiB,256MiB,1GiB)
  run h2d_copy 15 120 python3 benchmarks/h2d_copy.py "${q[@]}" "${sizes[@]}" "${B[@]}"
  [[ $mode == verify ]] && sizes=(--sizes 64MiB,256MiB)
  run staging 10 120 python3 benchmarks/staging.py "${q[@]}" "${sizes[@]}" "${B[@]}"
  run pinned_loop 15 180 python3 benchmarks/pinned_loop.py "${q[@]}" "${B[@]}"
fi
if want overlap; then
  best=(); [[ $mode == verify ]] && best=(--torch-workers 0 --stage-threads 8)  # the record's best of each
  run overlap 60 600 python3 benchmarks/overlap.py "${q[@]}" "${best[@]}" "${B[@]}"
fi
if want bench; then  # verify: one run a loader, as the record was taken; full/quick: the default 3 repeats
  if [[ $mode == verify ]]; then
    run bench 45 300 python3 -m torch_fastload.bench --repeats 1 --no-progress --json "$RES/bench.json"
  else
    run bench 135 600 python3 -m torch_fastload.bench --no-progress --json "$RES/bench.json"
  fi
fi
if want files; then
  [[ $mode == full ]] && run doctor 60 240 python3 -m torch_fastload doctor --size 2G --no-progress --json "$RES/doctor.json"
  run file_loader 90 420 python3 benchmarks/file_loader.py "${q[@]}" --dir "$DATA/files" "${B[@]}"
  run read_sweep 60 500 python3 benchmarks/read_sweep.py "${q[@]}" --dir "$DATA/files" "${B[@]}"
fi
if want features; then
  rows=(); [[ $mode == verify ]] && rows=(--row-bytes 256,4096)
  run feature_gather 40 400 python3 benchmarks/feature_gather.py "${q[@]}" "${rows[@]}" --dir "$DATA/features" "${B[@]}"
fi
if want images; then
  [[ $mode != verify ]] && run image_tests 120 300 python3 -m pytest tests/test_images.py -v -rs
  epochs=(); [[ $mode == verify ]] && epochs=(--epochs 1)
  run imagenet_loader 90 400 python3 benchmarks/imagenet_loader.py "${epochs[@]}" --dir "$DATA/imagenet-sample" "${B[@]}"
fi
if want train; then
  only=(); [[ $mode == verify ]] && only=(--only resnet50:synthetic,resnet50:fastload,resnet18:fastload,resnet18:torch)
  run imagenet_train 120 900 python3 benchmarks/imagenet_train.py "${only[@]}" --dir "$DATA/imagenet-sample" "${B[@]}"
fi
if want ddp; then
  gpus=(--gpus 1,2); [[ $mode == verify ]] && gpus=(--gpus 1)
  run ddp_scaling 30 300 python3 benchmarks/ddp_scaling.py --driver "${gpus[@]}" "${q[@]}" --dir "$DATA/ddp" "${B[@]}"
fi
python3 benchmarks/compare.py "$RES" | tee "$OUT/compare.txt"
pack
echo "=== done in $SECONDS s [$(date +%T)]"
