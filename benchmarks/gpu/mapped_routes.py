"""The loader alone over a hot .npy (2 GiB, shuffled), file -> GPU GB/s with each mapped_copy
setting, 3 interleaved rounds of 2 timed epochs (after one untimed). Rows of ROW_KIB KiB
(default 192) in batches of BATCH_MIB MiB (default 48).

    python3 benchmarks/gpu/mapped_routes.py                # ~40 s on the H100 machine
    ROW_KIB=4 python3 benchmarks/gpu/mapped_routes.py      # small rows: 12,288 ranges a batch
"""

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import torch_fastload
from torch_fastload import ArrayDataset, DataLoader


def main():
    d = Path(tempfile.mkdtemp(dir="/tmp"))
    row = int(os.environ.get("ROW_KIB", "192")) * 1024
    batch = int(os.environ.get("BATCH_MIB", "48")) * 2**20 // row
    rows = (2 << 30) // row
    np.save(d / "x.npy", np.random.default_rng(0).integers(0, 256, (rows, row), dtype=np.uint8))
    print(f"rows of {row} bytes, batches of {batch}", flush=True)
    with open(d / "x.npy", "rb") as f:
        while f.read(64 << 20):
            pass
    res = {}
    for r in range(3):
        for mode in ("kernel", "dma", "auto"):
            with torch_fastload.config.override(mapped_copy=mode):
                loader = DataLoader(
                    ArrayDataset(d / "x.npy"), batch_size=batch, shuffle=True, drop_last=True, device="cuda"
                )
            for epoch in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                n = 0
                for b in loader:
                    n += b.numel()
                torch.cuda.synchronize()
                if epoch:
                    res.setdefault(mode, []).append(n / (time.perf_counter() - t0) / 1e9)
            print(r, mode, [round(x, 1) for x in res[mode][-2:]], loader.stats().path, flush=True)
            loader.close()
    for m, v in res.items():
        print(f"{m}: median {statistics.median(v):.1f} GB/s  {[round(x, 1) for x in v]}")


if __name__ == "__main__":
    main()
