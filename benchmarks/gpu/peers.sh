#!/usr/bin/env bash
# Issue 20: the peers (DALI, SPDL, torchdata, FFCV) beside torch_fastload on the GPU machine.
# Needs the 6 parts of peers.tar (benchmarks/gpu/peers-wheels.sh) in /tmp/peerparts (earlier calls of peers-part.sh) or
# carried now under .gpu/wheels/parts/. Reduced sizes so everything ends in <= 9 minutes (PEERS_BUDGET_S=540):
#   imagenet_loader  100 classes x 100 (10,000 JPEGs), 2 timed epochs, each row in its own process,
#                    torch stopped after 10 batches, fastload-packed left out (peers-loader.sh: this step alone)
#   imagenet_train   ResNet-50 (synthetic, fastload, dali) and ResNet-18 (fastload, dali) on the
#                    same folder, 4 epochs of 39 steps, the first 100 left out (past the route trial; torch: not run)
#   file_loader      --quick with a 1 GiB .npy, 0.25 GiB of records, torch w16 only
#   resume_peers     full (seconds)
# Wheels (peers.tar, 298 MiB): nvidia-dali-cuda130 2.4.0 + nvidia-nvimgcodec-cu13 0.9.0.20,
# nvidia-libnvcomp-cu13 5.3.0.16, nvidia-nvjpeg 13.3.2.43, astunparse, gast, makefun, optree, nvtx,
# libcst (DALI's needs); spdl-io/spdl-core 0.8.0 and av 19.0.2 (PyAV: its bundled FFmpeg 9 serves
# SPDL, which links FFmpeg's libraries by name); torchdata 0.11.0; a few pure packages installed
# only where missing. Logs and JSON under $OUT; the peers' versions in $OUT/peers_status.log.
PEERS_BUDGET_S=${PEERS_BUDGET_S:-540}
source benchmarks/gpu/peers-setup.sh

stamp "resume_peers"
timeout $(budget 60) python3 benchmarks/resume_peers.py --device cpu --out "$W/out" --json "$OUT/resume_peers.json" --no-progress \
    2>&1 | grep -v "naively fast-forwarding" | tee "$OUT/resume_peers.log" | tail -16

stamp "imagenet_loader"
timeout $(budget 240) python3 benchmarks/imagenet_loader.py --isolate --dir "$W/imagenet-sample" --classes "$CLASSES" --per-class "$PER_CLASS" \
    --epochs 2 --torch-batches 10 --runs torch,fastload-folder,fastload-folder-bf16-cl,dali,dali-fp16-nhwc,spdl-cpu --out "$W/out" --json "$OUT/imagenet_loader.json" --no-progress \
    > "$OUT/imagenet_loader.log" 2>&1
echo "rc $?"; grep -v "^\s*$" "$OUT/imagenet_loader.log" | tail -22

stamp "imagenet_train"
timeout $(budget 220) python3 benchmarks/imagenet_train.py --dir "$W/imagenet-sample" --classes "$CLASSES" --per-class "$PER_CLASS" --epochs 4 \
    --warmup-steps 100 --only resnet50:synthetic,resnet50:fastload,resnet50:dali,resnet18:fastload,resnet18:dali \
    --out "$W/out" --json "$OUT/imagenet_train.json" --no-progress > "$OUT/imagenet_train.log" 2>&1
echo "rc $?"; grep -v "^\s*$" "$OUT/imagenet_train.log" | tail -20

stamp "file_loader"
timeout $(budget 150) python3 benchmarks/file_loader.py --quick --array-gib "$ARRAY_GIB" --record-gib "$RECORD_GIB" --torch-workers 16 \
    --torch-batches 20 --hot-epochs 2 --dir "$W/data" --out "$W/out" --json "$OUT/file_loader.json" --no-progress \
    > "$OUT/file_loader.log" 2>&1
echo "rc $?"; grep -v "^\s*$" "$OUT/file_loader.log" | tail -34
stamp "done"
