#!/usr/bin/env bash
# harden (issue 18 items 4-8, 10): build the extension, then the CUDA tests that touch file
# opens, file pins (Python pipeline and the native loop on the GPU ring/mapped paths), zero-byte
# rows, the gather-block option and the sampler. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/harden-out}
mkdir -p "$OUT"
python3 setup.py build_ext --inplace -q > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
python3 - <<'PY' > "$OUT/env.txt" 2>&1
import torch, torch_fastload
print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print(torch_fastload.__file__)
PY
timeout 420 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_hardening_files.py tests/test_cuda.py tests/test_native_cuda.py tests/test_io.py \
  tests/test_features.py tests/test_records.py tests/test_arrays.py tests/test_gnn.py \
  > "$OUT/harden_full.txt" 2>&1
echo "pytest exit: $?" >> "$OUT/harden_full.txt"
tail -30 "$OUT/harden_full.txt" > "$OUT/harden.txt"
# a file replaced mid-run on the GPU (native loop through the ring and the mapped gather kernel)
timeout 120 python3 - <<'PY' >> "$OUT/harden.txt" 2>&1
import os, tempfile, numpy as np, torch
from torch_fastload import DataLoader, config
from torch_fastload.errors import FileChangedError
from torch_fastload.sources import ArrayDataset
d = tempfile.mkdtemp()
rows = np.arange(40000 * 16, dtype=np.float32).reshape(40000, 16)
for native, budget in (("auto", "25%"), ("auto", "0"), ("off", "25%"), ("off", "0")):
    path = os.path.join(d, "rows.npy"); np.save(path, rows)
    with config.override(native=native, map_budget=budget):
        it = iter(DataLoader(ArrayDataset(path), batch_size=64, device="cuda"))
        delivered, error = 0, None
        try:
            for k, b in enumerate(it):
                assert torch.equal(b.cpu(), torch.from_numpy(rows[64 * k: 64 * k + 64])), f"batch {k} wrong"
                delivered += 1
                if k == 0:
                    np.save(os.path.join(d, "o.npy"), np.ones((40000, 9), np.float32)); os.replace(os.path.join(d, "o.npy"), path)
        except FileChangedError as exc:
            error = exc
        print(f"native={native} map_budget={budget}: {delivered} batches right, then {type(error).__name__}")
PY
cat "$OUT/harden.txt"
