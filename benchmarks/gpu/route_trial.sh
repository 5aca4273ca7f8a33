#!/usr/bin/env bash
# Issue 20: the route trial judged by the step's GPU pace and imagenet_loader timed past the trial.
# Run from the repo root: bash benchmarks/gpu/route_trial.sh   (<= 6 min; logs and small JSON under $OUT)
# Steps, each under its own timeout within BUDGET=350 s:
#   build   the extension
#   tests   pytest -m cuda tests/test_images.py tests/test_route_trial.py (the GPU step probe,
#           the trial on real batches, the transform kernel vs its reference)
#   after   imagenet_loader (40 x 100 = 4,000 JPEGs, as the 2026-11-26 short run), timed past the
#           route trial: fp32 and bf16 channels_last on 'auto', nvJPEG only and 'steal' in bf16
#           channels_last, the nvJPEG decode ceiling, DALI fp32 / fp16 NHWC where DALI imports
#           (/tmp/site from an earlier peers.sh on this machine; else "not installed")
#   before  the same auto rows with --timed-trial (the old timing: the trial's windows timed)
#   train   what time is left: ResNet-18 and ResNet-50 fed by fastload's default (the trial
#           prints what it saw: "GPU .. ms a step, caught up ..%"), beside synthetic
set -uo pipefail
OUT=${OUT:-$PWD/out}
DATA=${DATA:-/tmp/t20-data}
mkdir -p "$OUT" "$DATA"
export OUT PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/site/nvidia/dali ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
start=$(date +%s)
BUDGET=${BUDGET:-350}
STEP_TAIL=30
source benchmarks/gpu/steps.sh  # step NAME TIMEOUT_S CMD...
(git log --oneline -1 2>/dev/null || echo "no git here") | tee "$OUT/tree.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/tree.txt"

step build 150 python3 setup.py build_ext --inplace -q
step tests 120 python3 -m pytest -q -rs -m cuda tests/test_images.py tests/test_route_trial.py -p no:cacheprovider

SIZES=(--classes 40 --per-class 100 --dir "$DATA/images" --no-progress)
step after 100 python3 benchmarks/imagenet_loader.py "${SIZES[@]}" --out "$OUT/after" --epochs 2 \
  --decode-backends torchvision,steal --route-output bf16-cl \
  --runs fastload-folder,fastload-folder-bf16-cl,fastload-folder-torchvision,fastload-folder-steal,dali,dali-fp16-nhwc,gpu-decode-torchvision
step before 50 python3 benchmarks/imagenet_loader.py "${SIZES[@]}" --out "$OUT/before" --epochs 1 --timed-trial \
  --runs fastload-folder,fastload-folder-bf16-cl

only="resnet18:synthetic,resnet18:fastload,resnet50:synthetic,resnet50:fastload"
step train 200 python3 benchmarks/imagenet_train.py --no-progress --out "$OUT/train" --dir "$DATA/images" \
  --classes 40 --per-class 100 --epochs 4 --warmup-steps 40 --only "$only"

python3 - <<'PY' | tee "$OUT/summary.txt"
import glob, json, os
out = os.environ["OUT"]
def load(path):
    try:
        return json.load(open(os.path.join(out, path)))
    except (OSError, ValueError) as exc:
        print(f"{path}: {exc}")
        return None
for label in ("after", "before"):
    data = load(f"{label}/imagenet_loader.json")
    if not data:
        continue
    print(f"\n{label}: images/s, CPU cores, output, route trial")
    for r in data["runs"]:
        trial = r.get("route_trial") or {}
        print(f"  {r['name']:30s} {r['images_per_s']:9,.0f}  {r.get('cores') or float('nan'):5.1f}  {r.get('output', '-'):26s} "
              f"{trial.get('chosen', '')} {trial.get('seen', '')}")
    for name, why in (data.get("peer_rows_not_run") or {}).items():
        print(f"  {name:30s} not run: {why}")
    for failure in data.get("failures") or []:
        print("  failure:", str(failure)[:300])
train = load("train/imagenet_train.json")
runs = train["runs"] if train else [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "train", "train-*.json")))]
if runs:
    print("\nbeside a training step (step ms, input wait, decode route the trial kept and what it saw):")
    for r in runs:
        print(f"  {r.get('arch', '?'):9s} {r.get('loader', '?'):12s} {r.get('step_ms', float('nan')):7.1f}  "
              f"{100 * r.get('input_wait_fraction', float('nan')):5.1f}%  {r.get('decode_route', '')}")
PY
echo "total $(( $(date +%s) - start ))s" | tee -a "$OUT/steps.txt"
