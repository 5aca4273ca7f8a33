# examples/imagenet.py ResNet-50 (ARCH=...; 2 epochs x 39 steps, 10k images, --no-val) repeated over
# image-decode settings, each a fresh process, synthetic first: the run-to-run spread of the
# end-to-end step is ~1-1.5 ms, so settings are compared over repeats in one call.
#   bash benchmarks/probes/sweep_share.sh "synthetic:0:0:2 fastload:0:0:2 fastload:auto:0:2 ..." [REPEATS]
# Each config is loader:cpu_decode_share:cpu_decode_threads:prefetch. Writes $OUT/$ARCH-*.json.
# EXTRA="--compile" adds arguments to every run (their name goes into the files' names).
set -u
configs=${1:-"synthetic:0:0:2 fastload:0:0:2 fastload:0.6:0:2 fastload:auto:0:2"}
repeats=${2:-2}
OUT=${OUT:-/tmp/sweep}
mkdir -p "$OUT"
arch=${ARCH:-resnet50}
extra=${EXTRA:-}
tag=$(echo "$extra" | tr -cd 'a-z0-9')
common="$extra --arch $arch --sample-dir /tmp/inet-sample --sample-classes 100 --sample-train-per-class 100 --sample-val-per-class 10 --batch-size 256 --epochs 2 --warmup-steps 15 --no-val --no-progress"
for rep in $(seq "$repeats"); do
  for cfg in $configs; do
    IFS=: read -r loader share threads prefetch <<< "$cfg"
    out="$OUT/$arch${tag:+-$tag}-$loader-$share-$threads-$prefetch-$rep.json"
    TORCH_FASTLOAD_CPU_DECODE_SHARE=$share TORCH_FASTLOAD_CPU_DECODE_THREADS=$threads TORCH_FASTLOAD_PREFETCH=$prefetch \
      python3 examples/imagenet.py --loader "$loader" $common --json "$out" > /tmp/sweep-run.log 2>&1 \
      || { echo "$cfg failed:"; tail -5 /tmp/sweep-run.log; continue; }
    python3 -c "import json; d=json.load(open('$out')); print('$arch $extra rep $rep $loader share=$share threads=$threads prefetch=$prefetch: step %.2f ms, wait %.1f%%, decoded %s' % (d['step_ms'], 100*d['input_wait_fraction'], d.get('loader_stats',{}).get('decoded')))"
  done
done
