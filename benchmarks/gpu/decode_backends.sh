#!/usr/bin/env bash
# Issue 19, decode backend: nvImageCodec vs torchvision's nvJPEG vs the CPU route on the H100.
# Run from the repo root with .gpu carried (its wheels: nvidia-nvimgcodec-cu13, nvidia-nvjpeg):
#   bash .gpu/firstrun.sh            # <= 8 min; logs and small JSON under $OUT
# Steps (each under its own timeout, all within BUDGET=470 s): install the carried wheels into
# /tmp/site; build the extension; which backend 'auto' picks (backend.json); pytest -m cuda of
# tests/test_images.py (nvImageCodec and torchvision's nvJPEG vs the CPU decode, the rest on
# 'auto'); imagenet_loader (generates 3,500 JPEGs; decode-only ceilings of both GPU backends and
# the loader on each route); imagenet_train (ResNet-50 and ResNet-18 steps: synthetic,
# fastload-torchvision, fastload-nvimgcodec, fastload-cpu); $OUT/summary.txt and steps.txt.
set -uo pipefail
OUT=${OUT:-$PWD/out}
DATA=${DATA:-/tmp/firstrun-data}  # generated JPEGs: never under $OUT
mkdir -p "$OUT" "$DATA"
export OUT PYTHONUNBUFFERED=1
start=$(date +%s)
BUDGET=${BUDGET:-470}  # seconds for everything; a step gets at most what is left
source benchmarks/gpu/steps.sh  # step NAME TIMEOUT_S CMD...

# 1. the carried wheels; nvidia/ made a namespace over every 'nvidia' folder on the path, so the
#    torch wheels' nvidia/cu13 stays visible beside nvimgcodec
ls -la .gpu/frwheels | tee "$OUT/wheels.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/frwheels/*.whl 2>&1 | tail -3
echo '__path__ = __import__("pkgutil").extend_path(__path__, __name__)' >/tmp/site/nvidia/__init__.py
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
ls /tmp/site/nvidia /tmp/site/nvidia/cu13/lib 2>&1 | tee -a "$OUT/wheels.txt"

# 2. the extension
step build 150 python3 setup.py build_ext --inplace -q

# 3. which backend 'auto' picks, and why
step backend 45 python3 - <<'EOF'
import json, logging, os, torch
logging.basicConfig(level=logging.DEBUG)
from torch_fastload.vision import gpu_backend
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}
info["nvimgcodec_missing"] = gpu_backend.nvimgcodec_missing()
info["auto"] = gpu_backend.gpu_backend(torch.device("cuda", 0), "auto").name
if info["nvimgcodec_missing"] is None:
    import nvidia.nvimgcodec as nv
    info["nvimgcodec_version"] = nv.__version__
print(json.dumps(info, indent=1))
json.dump(info, open(os.path.join(os.environ["OUT"], "backend.json"), "w"), indent=1)
EOF

# 4. the image tests on the GPU (prints the decode differences with -s via the 'vs CPU' lines)
step tests 110 python3 -m pytest -q -s -m cuda tests/test_images.py -p no:cacheprovider

# 5. decode alone and the loader alone, each route (3,000 JPEGs, hot page cache)
step loader 90 python3 benchmarks/imagenet_loader.py --no-progress --out "$OUT/loader" --dir "$DATA/images" \
  --classes 50 --per-class 60 --epochs 1 --decode-backends torchvision,nvimgcodec,cpu \
  --runs fastload-folder,fastload-folder-torchvision,fastload-folder-nvimgcodec,fastload-folder-cpu,gpu-decode-torchvision,gpu-decode-nvimgcodec

# 6. beside a training step: ResNet-50 and ResNet-18 (bf16, channels_last, batch 256), each route;
#    gets what time is left; each run's JSON is written as it ends (train/train-ARCH-RUN.json)
only=""
for arch in resnet50 resnet18; do
  for run in synthetic fastload-torchvision fastload-nvimgcodec fastload-cpu; do only+="$arch:$run,"; done
done
step train 300 python3 benchmarks/imagenet_train.py --no-progress --out "$OUT/train" --dir "$DATA/images" \
  --classes 50 --per-class 60 --epochs 3 --warmup-steps 10 --decode-routes torchvision,nvimgcodec,cpu \
  --only "${only%,}"

# 7. one small summary
python3 - <<'EOF' | tee "$OUT/summary.txt"
import json, os
out = os.environ["OUT"]
def load(path):
    try:
        return json.load(open(os.path.join(out, path)))
    except (OSError, ValueError) as exc:
        print(f"{path}: {exc}")
        return None
backend = load("backend.json")
if backend:
    print("auto picks:", backend["auto"], "| nvImageCodec:", backend.get("nvimgcodec_version") or backend["nvimgcodec_missing"])
loader = load("loader/imagenet_loader.json")
if loader:
    print("\ninput pipeline alone (images/s, CPU cores):")
    for r in loader["runs"]:
        print(f"  {r['name']:32s} {r['images_per_s']:9,.0f}  {r.get('cores', float('nan')):5.1f}  {r.get('decoded', '')}")
train = load("train/imagenet_train.json")
runs = train["runs"] if train else []
if not runs:  # the study was cut short: the runs that finished
    import glob
    runs = [json.load(open(f)) | {"loader": os.path.basename(f)[:-5].split("-", 2)[2]} for f in sorted(glob.glob(os.path.join(out, "train", "train-*.json")))]
if runs:
    print("\nbeside a training step (train images/s, step ms, input wait, step vs synthetic):")
    for r in runs:
        print(
            f"  {r['arch']:9s} {r['loader']:22s} {r['train_images_per_s']:8,.0f}  {r['step_ms']:7.1f}  "
            f"{100 * r['input_wait_fraction']:5.1f}%  {r.get('vs_synthetic_step') or float('nan'):.3f}x"
        )
for data in (loader, train):
    for failure in (data or {}).get("failures") or []:
        print("failure:", str(failure)[:300])
EOF
echo "total $(( $(date +%s) - start ))s" | tee -a "$OUT/steps.txt"
