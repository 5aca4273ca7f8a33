#!/usr/bin/env bash
# Issue 20's floors at the defaults, after peers-part.sh carried parts aa..ae (af carried with
# this call): imagenet_loader (rows in one process, default order; then --peers-first with the
# JPEG engines in the trial off and on), ResNet-18 and ResNet-50 fed by fastload and by DALI.
# Run from the repo root:  bash benchmarks/gpu/peers-check.sh   (~5 min; logs, JSON under $OUT)
export PEERS_BUDGET_S=120
OUTROOT=$OUT
OUT=$OUTROOT/peers-check; mkdir -p "$OUT"
source benchmarks/gpu/peers-setup.sh > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"; head -4 "$OUT/peers_status.log"
IL=(python3 benchmarks/imagenet_loader.py --dir /tmp/peers-work/imagenet-sample --classes 100 --per-class 100 --epochs 2 --torch-batches 10 --no-progress)
timeout 200 "${IL[@]}" --out /tmp/il --json "$OUT/imagenet_loader.json" > "$OUT/imagenet_loader.txt" 2>&1; echo "rc $?"
grep -E "^(torch|fastload|dali|spdl|gpu)|PASS|FAIL" "$OUT/imagenet_loader.txt" | cut -c1-140
timeout 300 python3 benchmarks/imagenet_train.py --no-progress --dir /tmp/peers-work/imagenet-sample --classes 100 --per-class 100 \
  --epochs 4 --warmup-steps 100 --only resnet18:synthetic,resnet18:fastload,resnet18:dali,resnet50:synthetic,resnet50:fastload,resnet50:dali \
  --out /tmp/tr --json "$OUT/train.json" > "$OUT/train.txt" 2>&1; echo "rc $?"
grep -E "^resnet|PASS|FAIL" "$OUT/train.txt" | cut -c1-200
for v in off on; do
  [ $v = on ] && export TORCH_FASTLOAD_TRIAL_ENGINES=1
  timeout 200 "${IL[@]}" --peers-first --out /tmp/il-$v --json "$OUT/imagenet_loader-peers-first-engines-$v.json" > "$OUT/il-$v.txt" 2>&1
  echo "engines $v rc $?"; grep -E "^(torch|fastload|dali|spdl|gpu)|PASS|FAIL" "$OUT/il-$v.txt" | cut -c1-120
done
gzip -f "$OUT"/*.txt
