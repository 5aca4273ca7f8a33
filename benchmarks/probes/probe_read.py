"""Where does the hot read time go? pread into a big slot vs into reused small buffers; with/without concurrent H2D."""

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
# warm
with open(path, "rb", buffering=0) as f:
    while f.read(64 * MiB):
        pass
slot = torch.empty(48 * MiB * 3, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
stream = torch.cuda.Stream()


def rate(fn, nbytes, reps=20):
    fn(0)
    ts = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r)
        ts.append(time.perf_counter() - t)
    return nbytes / np.median(ts) / 1e9


B = 48 * MiB
nchunks = size // B - 1


def contiguous(r, threads=16, task=4 * MiB, dst_base=0):
    off = 128 + (r * B) % (nchunks * B)
    engine.read_ranges(path, None, [off], [B], slot, [dst_base + (r % 3) * B], num_threads=threads, task_size=task)


for th in (8, 16, 24, 32):
    print(f"contiguous 48MiB into big slot, {th} threads x 4MiB: {rate(lambda r: contiguous(r, th), B):.1f} GB/s")
for task in (1 * MiB, 2 * MiB, 8 * MiB):
    print(
        f"contiguous 48MiB into big slot, 16 threads x {task // MiB}MiB: {rate(lambda r: contiguous(r, 16, task), B):.1f} GB/s"
    )


# reused small destination: 48 MiB read as 12 x 4MiB ranges all landing in the same 16 MiB region? use 4 regions of 4MiB
def small(r, threads=16, region=4 * MiB):
    off = 128 + (r * B) % (nchunks * B)
    n = B // (1 * MiB)
    offs = off + np.arange(n) * MiB
    dsts = (np.arange(n) * MiB) % region
    engine.read_ranges(path, None, offs, np.full(n, MiB), slot, dsts, num_threads=threads, task_size=MiB)


for region in (4 * MiB, 16 * MiB, 32 * MiB, 144 * MiB):
    print(
        f"48MiB as 1MiB ranges into a {region // MiB} MiB reused region, 16 threads: {rate(lambda r: small(r, 16, region), B):.1f} GB/s"
    )
# shuffled rows 192KiB
rows = (size - 128) // (192 * 1024)
rng = np.random.default_rng(0)


def shuffled(r, threads=16):
    idx = rng.choice(rows, 256, replace=False)
    offs = 128 + idx * 192 * 1024
    engine.read_ranges(
        path,
        None,
        offs,
        np.full(256, 192 * 1024),
        slot,
        np.arange(256) * 192 * 1024 + (r % 3) * B,
        num_threads=threads,
        task_size=4 * MiB,
    )


print(f"shuffled 256x192KiB rows into big slot, 16 threads: {rate(shuffled, B):.1f} GB/s")
print(f"shuffled 256x192KiB rows into big slot, 32 threads: {rate(lambda r: shuffled(r, 32), B):.1f} GB/s")
# with concurrent H2D of another slot region running continuously
stop = threading.Event()


def h2d_loop():
    src = torch.empty(B, dtype=torch.uint8, pin_memory=True)
    while not stop.is_set():
        with torch.cuda.stream(stream):
            dev.copy_(src, non_blocking=True)
        stream.synchronize()


t = threading.Thread(target=h2d_loop)
t.start()
time.sleep(0.1)
print(f"[with concurrent H2D] contiguous 16x4MiB big slot: {rate(lambda r: contiguous(r), B):.1f} GB/s")
print(
    f"[with concurrent H2D] 1MiB ranges into 16 MiB reused region: {rate(lambda r: small(r, 16, 16 * MiB), B):.1f} GB/s"
)
print(f"[with concurrent H2D] shuffled rows: {rate(shuffled, B):.1f} GB/s")
stop.set()
t.join()
# memcpy bandwidth reference: copy_ranges streaming 48MiB pageable->pinned
src = torch.empty(B, dtype=torch.uint8)
src.fill_(1)
print(
    f"copy_ranges NT 48MiB pageable->pinned 16 thr: {rate(lambda r: engine.copy_ranges([slot.data_ptr()], [src.data_ptr()], [B], num_threads=16, task_size=2 * MiB), B):.1f} GB/s"
)
