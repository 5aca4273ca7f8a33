#!/usr/bin/env bash
# Issue 17: allocate_ahead A/B on one instance (4 against 8: ~4.5 min with the build): next()'s
# pieces inside the main job with allocate_on timed in pieces (PIECES_DETAIL=1), then the main job
# under each, alternated ROUNDS times. From the repo root:  bash benchmarks/gpu/ahead_ab.sh
# (JSON under $OUT);  AHEADS="8 16" ROUNDS=3 PIECES=0: other sizes, more rounds, no pieces.
set -uo pipefail; ONE_CALL=ahead_ab; source benchmarks/gpu/one-call.sh
AHEADS=${AHEADS:-4 8}; ROUNDS=${ROUNDS:-2}
[ "${PIECES:-1}" = 1 ] && for ahead in $AHEADS; do
  mkdir -p "$OUT/a$ahead"
  OUT="$OUT/a$ahead" PIECES_DETAIL=1 TORCH_FASTLOAD_ALLOCATE_AHEAD=$ahead timeout 70 python3 benchmarks/gpu/next_pieces.py --repeats 2 > "$OUT/a$ahead/log" 2>&1
  python3 - "$OUT/a$ahead/next-pieces.json" $ahead <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("ahead", sys.argv[2], "; ".join(f"{k} n{v['n']} p50 {v['p50_us']:.1f} mean {v['mean_us']:.1f}" for k, v in d.items() if isinstance(v, dict)))
PY
done
for k in $(seq 1 "$ROUNDS"); do for ahead in $(ab_order "$k" $AHEADS); do
  TORCH_FASTLOAD_ALLOCATE_AHEAD=$ahead timeout 60 python3 -m torch_fastload.bench --no-progress --repeats 3 --torch-workers 0 --json "$OUT/bench-a$ahead-$k.json" 2>&1 | grep -E "vs device-resident|input wait <=" | sed "s/^/ahead $ahead: /"
done; done
echo "done in $((SECONDS - S)) s"
