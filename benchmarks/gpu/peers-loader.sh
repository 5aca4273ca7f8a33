#!/usr/bin/env bash
# Issue 20: the ImageNet input pipeline alone, each row in its own process (--isolate): fastload
# (fp32, bf16 channels_last), DALI (fp32, fp16 NHWC), SPDL, torch (10 batches). peers.sh's
# imagenet_loader step alone with a longer limit (each fastload row runs its route trial first).
# Needs the peers.tar parts as peers.sh does. Run from the repo root: bash benchmarks/gpu/peers-loader.sh (~4 min)
PEERS_BUDGET_S=${PEERS_BUDGET_S:-560}
source benchmarks/gpu/peers-setup.sh
stamp "imagenet_loader"
timeout $(budget 480) python3 benchmarks/imagenet_loader.py --isolate --dir "$W/imagenet-sample" --classes "$CLASSES" --per-class "$PER_CLASS" \
    --epochs 2 --torch-batches 10 --runs torch,fastload-folder,fastload-folder-bf16-cl,dali,dali-fp16-nhwc,spdl-cpu \
    --out "$W/out" --json "$OUT/imagenet_loader.json" --no-progress > "$OUT/imagenet_loader.log" 2>&1
echo "rc $?"; grep -v "^\s*$" "$OUT/imagenet_loader.log" | tail -22
stamp "done"
