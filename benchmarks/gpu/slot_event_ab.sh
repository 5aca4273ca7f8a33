#!/usr/bin/env bash
# Issue 17: one event record a batch fewer from the loop's threads (a slotted batch's ready event
# is its slot's; a group's batches share one allocation event and one copy-stream wait on it)
# against the tree before (TORCH_FASTLOAD_SLOT_EVENT=own, TORCH_FASTLOAD_ALLOCATION_MARK=batch),
# on one instance. From the repo root:
#   PART=probe bash benchmarks/gpu/slot_event_ab.sh   # the loader's driver calls a step (COUNT=1),
#                                                     # then the launch-bound thread beside, ROUNDS
#   PART=bench bash benchmarks/gpu/slot_event_ab.sh   # the main job under each, alternated ROUNDS times
set -uo pipefail; ONE_CALL=slot_event_ab; source benchmarks/gpu/one-call.sh
# BEFORE: the environment of the "before" side, K=V;K=V (default: the two changes above off;
# BEFORE=TORCH_FASTLOAD_MERGE_PARTS=0: a slot's parts copied by a call each)
BEFORE=${BEFORE:-"TORCH_FASTLOAD_SLOT_EVENT=own;TORCH_FASTLOAD_ALLOCATION_MARK=batch"}
if [ "${PART:-probe}" = probe ]; then
  export FEEDS=${FEEDS:-"TensorDataset,RecordDataset"} MODES="beside,env:$BEFORE"
  COUNT=1 timeout 200 python3 benchmarks/gpu/launch_cpu_probe.py 1 > "$OUT/counts.log" 2>&1
  echo "counts rc $?"; tail -1 "$OUT/counts.log" > "$OUT/counts.json"
  grep -E "^[A-Z].*\| |driver calls a step" "$OUT/counts.log" | cut -c1-400
  timeout 330 python3 benchmarks/gpu/launch_cpu_probe.py "${ROUNDS:-3}" > "$OUT/launch.log" 2>&1
  echo "probe rc $?"; grep -v '^{' "$OUT/launch.log" | grep -v "Warning\|for worker" | tail -20
  tail -1 "$OUT/launch.log" > "$OUT/launch.json"
else
  for k in $(seq 1 "${ROUNDS:-2}"); do
    for mode in $(ab_order "$k" after before); do
      vars=(); [ "$mode" = before ] && IFS=";" read -ra vars <<< "$BEFORE"
      env "${vars[@]}" timeout 70 python3 -m torch_fastload.bench --no-progress --repeats 3 --torch-workers 0 \
        --json "$OUT/bench-$mode-$k.json" 2>&1 | grep -E "vs device-resident|input wait <=" | sed "s/^/$mode: /"
    done
  done
fi
echo "done in $((SECONDS - S)) s"
