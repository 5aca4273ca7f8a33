#!/usr/bin/env bash
# Issue 20: image_batches_staged 2 against 3 beside a ResNet-18 step (examples/imagenet.py through
# imagenet_train.py), alternated a2 a3 b3 b2 on one instance, after the synthetic-step row; no
# peers needed (~4 min). Run from the repo root, kvikio's wheels in .whl/ (optional):
#   bash benchmarks/gpu/staged_ab.sh        (logs and JSON under $OUT)
set -uo pipefail
OUT=${OUT:-$PWD/out/staged_ab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/kvikio-env.sh
S=$SECONDS
timeout 150 python3 setup.py build_ext --inplace -q > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $((SECONDS - S)) s"
W=/tmp/ab; mkdir -p $W
run() {  # $1 label, $2 staged, $3 rows
  TORCH_FASTLOAD_IMAGE_BATCHES_STAGED=$2 timeout 150 python3 benchmarks/imagenet_train.py --dir $W/imagenet-sample --classes 100 \
    --per-class 100 --epochs 4 --warmup-steps 100 --only $3 --out $W/out --json $OUT/train-$1.json --no-progress > $OUT/train-$1.log 2>&1
  echo "== $1 (staged $2) rc $? at $((SECONDS - S)) s"; grep -E "decode route|^resnet" $OUT/train-$1.log
}
run synthetic 3 resnet18:synthetic
run a2 2 resnet18:fastload
run a3 3 resnet18:fastload
run b3 3 resnet18:fastload
run b2 2 resnet18:fastload
echo "done in $((SECONDS - S)) s"
