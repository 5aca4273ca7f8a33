#!/usr/bin/env bash
# One call on the 2-GPU machine (issue 6): the file loader and the ImageNet example at 1 and 2
# GPUs (benchmarks/ddp_scaling.py), GraphSAGE under torchrun with a mid-epoch stop and resume,
# and the multi-GPU tests. Logs and JSON land in $RES, tarred into $OUT/ddp.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/out}
RES=${RES:-/tmp/fastload-ddp/res}
DATA=${DATA:-/tmp/fastload-ddp/data}
mkdir -p "$OUT" "$RES" "$DATA"
log() { echo "=== $* [$(date +%T)]"; }
{
  log machine; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv; nvidia-smi topo -m
  log build; python3 setup.py -q build_ext --inplace 2>&1 | tail -2
  log "file loader 1,2 GPUs"
  timeout 150 python3 benchmarks/ddp_scaling.py --driver --gpus 1,2 --no-progress --dir "$DATA/arrays" --out "$RES/files" 2>&1 | tail -25
  log "imagenet example 1,2 GPUs"
  timeout 260 python3 benchmarks/ddp_scaling.py --imagenet --gpus 1,2 --no-progress --imagenet-per-class 192 \
    --imagenet-dir "$DATA/imagenet" --out "$RES/imagenet" 2>&1 | tail -25
  G="--preset medium --root $DATA/gnn-medium --epochs 1 --max-steps 150 --pin --no-progress"
  log "gnn 1 GPU"; timeout 120 python3 examples/gnn_sage.py $G --json "$RES/gnn-1gpu.json" 2>&1 | tail -4
  log "gnn 2 GPUs"; timeout 90 torchrun --standalone --nproc-per-node 2 examples/gnn_sage.py $G --json "$RES/gnn-2gpu.json" 2>&1 | tail -4
  log "gnn 2 GPUs: stop at 100, resume"
  timeout 60 torchrun --standalone --nproc-per-node 2 examples/gnn_sage.py $G --checkpoint "$DATA/gnn-ck.pt" \
    --checkpoint-every 50 --stop-after 100 --json "$RES/gnn-stop.json" 2>&1 | tail -3
  timeout 60 torchrun --standalone --nproc-per-node 2 examples/gnn_sage.py $G --checkpoint "$DATA/gnn-ck.pt" \
    --resume "$DATA/gnn-ck.pt" --json "$RES/gnn-resumed.json" 2>&1 | tail -3
  log "multi-GPU tests"; timeout 100 python3 -m pytest tests -m "multigpu or cuda" -q -rs -k "ddp or distributed or resume or gnn" 2>&1 | tail -8
  log compare; python3 benchmarks/compare.py "$RES"
  log done
} 2>&1 | tee "$RES/gpu_ddp.log"
tar -C "$(dirname "$RES")" -czf "$OUT/ddp.tgz" "$(basename "$RES")"
