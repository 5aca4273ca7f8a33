#!/usr/bin/env python3
"""Issue 21: what holds the GIL while shuffled Parquet batches feed a GPU step, thread by
thread: parquet.py's overlap row (the 1M snappy alert file, shuffled batches of 16,384 rows over
decoded row groups kept in the cache, the bf16 GEMM step sized from one epoch's decode) fed for
SECONDS, to run under ``py-spy record --gil`` (only the GIL's holder is sampled). The
training thread's launches need the GIL between its ops; the loader's Python takes it from
them, and when CUDA's launch queue is full the training thread blocks in a launch holding it.

  py-spy record --gil -r 1000 -f raw -o gil.txt -- python3 benchmarks/gpu/parquet_gil_feed.py /tmp/pqdata 20
  python3 benchmarks/gpu/parquet_gil_feed.py --summarize gil.txt   (GIL-held samples by role and frame)

Prints the steps fed, ms a step and the host's mean lead over the GPU.
"""

import sys
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import parquet  # noqa: E402
import parquet_gil_epochs  # noqa: E402

from torch_fastload import DataLoader  # noqa: E402
from torch_fastload.sources import ParquetDataset, ParquetSampler  # noqa: E402

ROLES = (
    ("training step (launches)", "step (parquet.py"),
    ("next()", "__next__"),
    ("take threads (gather)", "RowGroupCache.take"),
    ("fetch thread", "_fetch_loop"),
    ("stage threads", "_stage_loop"),
    ("decode threads", "RowGroupCache._decode"),
    ("epoch start (iter)", "__iter__"),
)


def main() -> None:
    data = Path(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    device = torch.device("cuda")
    path, rows, decode, step, gemms = parquet.overlap_probe_setup(data, device)
    dataset = ParquetDataset(path)
    loader = DataLoader(
        dataset, batch_sampler=ParquetSampler(dataset, shuffle=True, seed=1).batches(rows), device=device
    )
    for _ in loader:  # every row group decoded and cached, the pool and threads made
        pass
    steps, leads, launched = 0, [], deque()
    torch.cuda.synchronize()
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for batch in loader:
            while launched and launched[0].query():
                launched.popleft()
            leads.append(len(launched))
            step(batch)
            event = torch.cuda.Event()
            event.record()
            launched.append(event)
            steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - began
    print(
        f"decode {1e3 * decode:.2f} ms a batch, {gemms} GEMMs a step; {steps} steps fed in {wall:.1f} s: "
        f"{1e3 * wall / steps:.2f} ms a step, the host's lead {sum(leads) / len(leads):.1f} steps",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        parquet_gil_epochs.summarize(sys.argv[2], top=40, roles_by_frame=ROLES)
    else:
        main()
