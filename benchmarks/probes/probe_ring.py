"""DeviceStager alone: 48 MiB batches of shuffled 192 KiB rows (hot) -> GPU, by threads x task x ring; 1 or 2 concurrent readers."""

import os
import sys
import threading
import time

import numpy as np
import torch

from torch_fastload import engine

MiB = 1 << 20
path = sys.argv[1]
size = os.path.getsize(path)
with open(path, "rb", buffering=0) as f:
    while f.read(64 * MiB):
        pass
row = 192 * 1024
rows = (size - 128) // row
B = 256
dev = [torch.empty(B * row, dtype=torch.uint8, device="cuda") for _ in range(4)]
stream = torch.cuda.Stream()


def run(threads, task, chunks, readers=1, n=48):
    st = engine.DeviceStager(task, chunks)

    def work(r):
        torch.cuda.set_device(0)
        rng = np.random.default_rng(r)
        for k in range(n // readers):
            idx = rng.choice(rows, B, replace=False)
            st.read(
                path,
                None,
                128 + idx * row,
                np.full(B, row),
                dev[(2 * r + k) % 4],
                np.arange(B) * row,
                stream=stream.cuda_stream,
                num_threads=threads,
                task_size=task,
            )

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(r,)) for r in range(readers)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    stream.synchronize()
    t = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    st.close()
    return n * B * row / t / 1e9, cpu / t


torch.zeros(1, device="cuda")
for threads, task, chunks, readers in [
    (16, 4 * MiB, 20, 1),
    (16, 1 * MiB, 20, 1),
    (16, 2 * MiB, 20, 1),
    (16, 1 * MiB, 32, 1),
    (8, 1 * MiB, 12, 1),
    (8, 2 * MiB, 12, 1),
    (12, 1 * MiB, 16, 1),
    (24, 1 * MiB, 30, 1),
    (8, 1 * MiB, 20, 2),
    (16, 1 * MiB, 32, 2),
    (8, 2 * MiB, 20, 2),
    (16, 4 * MiB, 20, 2),
    (12, 1 * MiB, 24, 2),
]:
    g, c = run(threads, task, chunks, readers)
    print(
        f"threads {threads:2d} task {task // MiB} MiB ring {chunks:2d} ({chunks * task // MiB:3d} MiB) readers {readers}: {g:6.2f} GB/s  {c:5.1f} cores  {c / (g / 10):.2f} cores/10GB/s",
        flush=True,
    )
