#!/usr/bin/env bash
# Issue 20: ResNet-18 fed by torch_fastload and by DALI in the same run, twice (peers.sh's install,
# then imagenet_train.py only). The rest of the header is peers.sh's.
# Needs the 6 parts of peers.tar in /tmp/peerparts (earlier calls of peers-part.sh) or carried now.
export PEERS_BUDGET_S=${PEERS_BUDGET_S:-520}
source benchmarks/gpu/peers-setup.sh

stamp "imagenet_train (ResNet-18 only, repeated)"
for k in 1 2; do
timeout $(budget 220) python3 benchmarks/imagenet_train.py --dir "$W/imagenet-sample" --classes "$CLASSES" --per-class "$PER_CLASS" --epochs 4 \
    --warmup-steps 100 --only ${PEERS_ONLY:-resnet18:synthetic,resnet18:fastload,resnet18:dali} \
    --out "$W/out$k" --json "$OUT/imagenet_train-$k.json" --no-progress > "$OUT/imagenet_train-$k.log" 2>&1
echo "rc $?"; grep -v "^\s*$" "$OUT/imagenet_train-$k.log" | grep -E "decode route|^resnet|PASS|FAIL"
done
stamp "done"
