#!/usr/bin/env bash
# GPU checks of branch fidelity (issue 18 items 3 and 9, drop-in a-f). Run from the repo root:
#   bash .gpu/fidelity.sh        (writes logs and readahead.json under $OUT; ~5 min on an H100)
set -uo pipefail
OUT=${OUT:-out/fidelity}
mkdir -p "$OUT"
python3 setup.py build_ext --inplace -q > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PWD

echo "== tests (CUDA device present: the loaders' default device is cuda) =="
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_fidelity.py tests/test_cuda.py \
    tests/test_loader.py -x 2>&1 | tail -25 | tee "$OUT/pytest.log"

echo "== read-ahead: does the torch-bounded fetch (prefetch beyond torch's bound) still hide the step? =="
timeout 180 python3 - "$OUT/readahead.json" <<'PY' 2>&1 | tee "$OUT/readahead.log"
import json, sys, time
import torch
from torch.utils.data import Dataset
from torch_fastload import DataLoader, config

class Rows(Dataset):  # per-sample Python: the pipeline's fetch thread (native loop not used)
    def __init__(self, n, row):
        self.data = torch.randn(n, row)
    def __len__(self):
        return len(self.data)
    def __getitem__(self, i):
        return self.data[i]

dev = torch.device("cuda")
ds = Rows(16384, 48 * 1024 // 4)  # 48 KiB rows, 256 per batch: 12 MiB batches
a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

def step(batch, reps):
    for _ in range(reps):
        a @ a
    return batch.sum()

def run(prefetch, num_workers, fetch_threads, reps, batches=48):
    loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=num_workers, prefetch=prefetch,
                        fetch_threads=fetch_threads, prefetch_factor=2 if num_workers else None)
    it = iter(loader)
    for _ in range(4):
        step(next(it), reps)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(batches):
        step(next(it), reps)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / batches
    del it
    loader.close()
    return dt

# the step alone (device-resident batch) sets the reps so the step is ~ the fetch time
resident = ds.data[:256].to(dev)
results = {}
for reps in (4, 16):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20):
        step(resident, reps)
    torch.cuda.synchronize()
    alone = (time.perf_counter() - t) / 20
    for nw, ft in ((0, 4), (4, 1)):
        for pf in (0, 1, 2, 4, 8):
            dt = run(pf, nw, ft, reps)
            key = f"reps={reps} workers={nw} fetch_threads={ft} prefetch={pf}"
            results[key] = {"step_alone_ms": alone * 1e3, "step_ms": dt * 1e3, "ratio": dt / alone}
            print(f"{key:50s} step alone {alone*1e3:7.2f} ms, with loader {dt*1e3:7.2f} ms, ratio {dt/alone:5.2f}", flush=True)
json.dump(results, open(sys.argv[1], "w"), indent=1)
PY
