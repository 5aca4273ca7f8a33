import sys
import time

import torch

from torch_fastload import DataLoader, uva
from torch_fastload.sources import ArrayDataset

ds = ArrayDataset(sys.argv[1], sys.argv[2])
for f in sys.argv[1:3]:
    with open(f, "rb", buffering=0) as fh:
        while fh.read(64 << 20):
            pass
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
for _ in range(10):
    a @ b
torch.cuda.synchronize()


def step(x, reps=10):
    c = a
    for _ in range(reps):
        c = c @ b
    return c[0, 0] + x.view(-1)[:1].float()


def resident(n=40):
    x = torch.empty(256 * 196608 // 4, device="cuda")
    step(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


print(f"resident step {resident():.3f} ms", flush=True)
for blocks in (8, 16, 24, 32, 48, 64):
    uva.BLOCKS = blocks
    loader = DataLoader(ds, batch_size=256, shuffle=True)
    it = iter(loader)
    next(it)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    for bt in it:
        n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    gb = n * 256 * 196608 / dt / 1e9
    it = iter(loader)
    next(it)
    torch.cuda.synchronize()
    t = time.perf_counter()
    m = 0
    for bt in it:
        step(bt[0])
        m += 1
        if m == 40:
            break
    torch.cuda.synchronize()
    st = (time.perf_counter() - t) / m * 1e3
    it.close()
    print(
        f"blocks {blocks:5d}: pure input {gb:6.2f} GB/s; step with loader {st:.3f} ms  io={list(loader.stats().io_bytes)}",
        flush=True,
    )
    loader.close()
