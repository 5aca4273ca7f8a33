#!/usr/bin/env bash
# jpeg_engines.sh (issue 20): the GPU's hardware JPEG engines (nvImageCodec HW_GPU_ONLY) as a decode route,
# and whether ResNet-18 fed through them (alone, split with the CPU, or as auto keeps) beats the
# nvJPEG / CPU routes. Run from the repo root: bash benchmarks/gpu/jpeg_engines.sh   (<= 8 min; logs, JSON under $OUT)
#   wheels  nvImageCodec 0.9 + nvJPEG 13 from .gpu/frwheels into /tmp/site (said if absent: the
#           engine route is then "not usable" everywhere below, and auto keeps the old routes)
#   build   the extension
#   engines whether the engines decode here (jpeg_engines_missing), and nvidia-smi's engine line
#   tests   test_jpeg_engines (the real engines vs libjpeg-turbo), test_three_way (the three-way
#           split on the real engines and nvJPEG), test_gpu_backend, test_route_trial
#   train   examples/imagenet.py ResNet-18 on 10,000 JPEGs (100 x 100, the peers' set), 4 epochs,
#           100 untimed steps (the trial with the engines takes ~85 batches): a: synthetic, fastload
#           (auto: the route kept is printed, a three-way split named "cpu C + engines E + nvjpeg N"),
#           fastload-threeway (forced: 0.31 CPU, 0.29 engines, 0.40 nvJPEG); b: synthetic, DALI where
#           /tmp/site has it (peers.sh), fastload on one route alone: torchvision (nvJPEG on CUDA
#           cores), hardware (the engines). The all-CPU row is left out (38.4 ms on the H200: slowest)
#   alone   imagenet_loader (what time is left): each GPU decoder alone on batches from pinned
#           memory (gpu-decode-hardware vs gpu-decode-torchvision), then the loader alone on each
#           route (threeway too), fp32
set -uo pipefail
OUT=${OUT:-$PWD/out}
DATA=${DATA:-/tmp/peers-work/imagenet-sample}
mkdir -p "$OUT" "$(dirname "$DATA")"
export OUT PYTHONUNBUFFERED=1
SITE=/tmp/site
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
BUDGET=${BUDGET:-465}
source benchmarks/gpu/steps.sh  # step NAME TIMEOUT_S CMD...
(git log --oneline -1 2>/dev/null || echo "no git here") | tee "$OUT/tree.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/tree.txt"

if ls .gpu/frwheels/*.whl >/dev/null 2>&1; then
  ls .gpu/frwheels | tee -a "$OUT/tree.txt"
  step wheels 60 python3 -m pip install -q --no-index --no-deps --target $SITE .gpu/frwheels/*.whl
else
  echo "no .gpu/frwheels/*.whl: nvImageCodec not installed, the engine route cannot run" | tee -a "$OUT/tree.txt"
fi
step build 150 python3 setup.py build_ext --inplace -q
step engines 60 python3 -c "
import torch
from torch_fastload.vision import jpeg_engines
from torch_fastload.vision.gpu_backend import nvimgcodec_missing
device = torch.device('cuda', 0)
print('nvImageCodec:', nvimgcodec_missing() or 'imports, nvJPEG found')
print('JPEG engines:', jpeg_engines.jpeg_engines_missing(device, 256) or 'decode the self-test JPEG')
"
nvidia-smi -q 2>/dev/null | grep -i -A2 "jpg\|ofa" | head -12 >> "$OUT/engines.log"
step tests 110 python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_jpeg_engines.py tests/test_three_way.py \
  tests/test_gpu_backend.py tests/test_route_trial.py

routes=hardware,torchvision,threeway,cpu
[ -d $SITE/nvidia/dali ] || echo "DALI not in $SITE (peers.sh installs it): its row says not installed" | tee -a "$OUT/tree.txt"
TRAIN=(python3 benchmarks/imagenet_train.py --no-progress --dir "$DATA" --classes 100 --per-class 100 --epochs 4 --warmup-steps 100)
# a: the question (auto, DALI and the forced three-way split beside synthetic, one run); b: single routes
step train-a 220 "${TRAIN[@]}" --only resnet18:synthetic,resnet18:fastload,resnet18:dali --decode-routes threeway \
  --out "$OUT/train-a" --json "$OUT/train-a.json"
step train-b 150 "${TRAIN[@]}" --decode-routes torchvision,hardware \
  --only resnet18:synthetic,resnet18:fastload-torchvision,resnet18:fastload-hardware \
  --out "$OUT/train-b" --json "$OUT/train-b.json"
step ceiling 70 python3 benchmarks/imagenet_loader.py --no-progress --dir "$DATA" --classes 100 --per-class 100 \
  --epochs 1 --decode-backends hardware,torchvision --out "$OUT/ceiling" --json "$OUT/ceiling.json" \
  --runs gpu-decode-hardware,gpu-decode-torchvision
step alone 100 python3 benchmarks/imagenet_loader.py --no-progress --dir "$DATA" --classes 100 --per-class 100 \
  --epochs 1 --decode-backends $routes --out "$OUT/alone" --json "$OUT/alone.json" \
  --runs fastload-folder-hardware,fastload-folder-torchvision,fastload-folder-threeway,fastload-folder-cpu

python3 - <<'PY' | tee "$OUT/summary.txt"
import json, os
out = os.environ["OUT"]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError) as exc:
        print(f"{name}: not written ({exc})")
        return {}
print("ResNet-18 step, ms (input wait), by route (train-a, then train-b, each with its own synthetic):")
synthetic, steps = None, {}
for r in load("train-a.json").get("runs", []) + load("train-b.json").get("runs", []):
    if r["loader"] == "synthetic":
        synthetic = r["step_ms"]
    ratio = f", {r['step_ms'] / synthetic:.3f}x synthetic" if synthetic else ""
    steps[r["loader"]] = r["step_ms"]
    print(f"  {r['loader']:22s} {r['step_ms']:6.1f} ms ({100 * r['input_wait_fraction']:.1f}% wait{ratio})")
    if r.get("decode_route"):
        d = r["decode_route"]
        print(f"    auto kept: {d.get('route')} after {d.get('trial_batches')} batches; {d['measured']}")
    if r["loader"] in ("fastload", "fastload-threeway") and r.get("loader_stats"):
        print(f"    decoded per route: {r['loader_stats'].get('decoded')}")
for ours in ("fastload", "fastload-threeway", "fastload-hardware"):
    if ours in steps and "dali" in steps:
        over = steps[ours] / steps["dali"]
        print(f"  {ours} / DALI step: {over:.3f}x ({'PASS' if over <= 1.0 else 'FAIL'} the <= 1.0x floor; separate processes)")
print("Decode alone (gpu-decode-*) and the loader alone on each route, images/s (CPU cores):")
for r in load("ceiling.json").get("runs", []) + load("alone.json").get("runs", []):
    print(f"  {r['name']:28s} {r['images_per_s']:9,.0f} ({r.get('cores') or 0:.1f})  refused {r.get('refused', '-')}")
    if r.get("route_trial"):
        print(f"    trial: {r['route_trial']}")
PY
echo "total $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
