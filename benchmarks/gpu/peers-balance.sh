#!/usr/bin/env bash
# Issue 20's image floors at the library's route-trial default (the windowed trial; it was the
# balanced split, balance_split, when this script was written and named), after peers-part.sh
# carried parts aa..ae (af carried with this call): ResNet-18 fed by fastload
# and by DALI twice (two imagenet_train runs), ResNet-50 once, then imagenet_loader with each
# row in its own process. From the repo root:  bash benchmarks/gpu/peers-balance.sh
# (~9 min; logs and JSON in $OUT/peers-balance.tar.gz, the summary lines on stdout)
export PEERS_BUDGET_S=560
OUTROOT=$OUT
OUT=$OUTROOT/peers-balance; mkdir -p "$OUT"
source benchmarks/gpu/peers-setup.sh > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"; head -4 "$OUT/peers_status.log"
TR=(python3 benchmarks/imagenet_train.py --no-progress --dir /tmp/peers-work/imagenet-sample --classes 100 --per-class 100 --epochs 4 --warmup-steps 100)
stamp "train 1"
timeout $(budget 240) "${TR[@]}" --only resnet18:synthetic,resnet18:fastload,resnet18:dali,resnet50:synthetic,resnet50:fastload,resnet50:dali \
  --out /tmp/tr1 --json "$OUT/train-1.json" > "$OUT/train-1.txt" 2>&1; echo "rc $?"
grep -E "^resnet|PASS|FAIL|decode route" "$OUT/train-1.txt" | cut -c1-400
stamp "train 2"
timeout $(budget 90) "${TR[@]}" --only resnet18:dali,resnet18:fastload --out /tmp/tr2 --json "$OUT/train-2.json" > "$OUT/train-2.txt" 2>&1; echo "rc $?"
grep -E "^resnet|PASS|FAIL|decode route" "$OUT/train-2.txt" | cut -c1-400
stamp "imagenet_loader"
timeout $(budget 150) python3 benchmarks/imagenet_loader.py --isolate --dir /tmp/peers-work/imagenet-sample --classes 100 --per-class 100 \
  --epochs 2 --torch-batches 10 --runs torch,fastload-folder,fastload-folder-bf16-cl,dali,dali-fp16-nhwc --out /tmp/il \
  --json "$OUT/imagenet_loader.json" --no-progress > "$OUT/imagenet_loader.txt" 2>&1; echo "rc $?"
grep -E "^(torch|fastload|dali|spdl|gpu)|PASS|FAIL|route" "$OUT/imagenet_loader.txt" | cut -c1-300
stamp "done"
tar -czf "$OUTROOT/peers-balance.tar.gz" -C "$OUTROOT" peers-balance && rm -rf "$OUT"
