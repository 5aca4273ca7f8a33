# R50 steady state after the route trial vs every JPEG on the CPU from the start, one instance.
set -u
common="--arch resnet50 --sample-dir /work/main/benchmarks/out/imagenet-sample --sample-classes 100 --sample-train-per-class 100 --sample-val-per-class 10 --batch-size 256 --epochs 3 --warmup-steps 45 --no-val --no-progress"
for cfg in synthetic:0 fastload:1 fastload:auto fastload:1 fastload:auto fastload:0; do
  IFS=: read -r loader share <<< "$cfg"
  TORCH_FASTLOAD_CPU_DECODE_SHARE=$share python3 examples/imagenet.py --loader $loader $common --json /tmp/s.json > /tmp/s.log 2>&1 || { tail -5 /tmp/s.log; continue; }
  python3 -c "import json; d=json.load(open('/tmp/s.json')); print('$cfg', 'step %.2f ms wait %.1f%%' % (d['step_ms'], 100*d['input_wait_fraction']), d.get('decode_route', {}).get('measured', ''))"
done
