# Sourced by the GPU scripts: step NAME TIMEOUT_S CMD... runs CMD under `timeout`, given at most
# what is left of $BUDGET seconds since $start (skipped below 15 s), output in $OUT/NAME.log (its
# last $STEP_TAIL lines printed), status and seconds appended to $OUT/steps.txt.
step() {
  local name=$1 limit=$2 t0=$(date +%s) rc left
  shift 2
  left=$(( BUDGET - (t0 - start) ))
  (( left < limit )) && limit=$left
  if (( limit < 15 )); then echo "$name skipped: out of time" | tee -a "$OUT/steps.txt"; return 124; fi
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s (at $(( $(date +%s) - start ))s)" | tee -a "$OUT/steps.txt"
  tail -n "${STEP_TAIL:-25}" "$OUT/$name.log"
  return $rc
}
