"""Hot file -> GPU without pread: (1) mmap + C++ NT copy_ranges into pinned memory, CPU cost;
(2) cudaHostRegister(ReadOnly) of the file mapping + DMA copies straight from the page cache."""

import mmap
import os
import sys
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
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
base = np.frombuffer(m, dtype=np.uint8).ctypes.data
t = time.perf_counter()
s = 0
arr = np.frombuffer(m, dtype=np.uint8)
s = int(arr[::4096].sum())  # touch every page (fault in the mapping)
print(f"fault-in of {size / 2**30:.1f} GiB mapping: {time.perf_counter() - t:.2f} s")
pinned = torch.empty(B * row * 2, dtype=torch.uint8, pin_memory=True)
rng = np.random.default_rng(0)
for threads in (4, 8, 16):
    for stream_nt in (True, False):
        n = 40
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for k in range(n):
            idx = rng.choice(rows, B, replace=False)
            src = base + 128 + idx * row
            dst = pinned.data_ptr() + (k % 2) * B * row + np.arange(B) * row
            engine._require().copy_ranges(
                dst.astype(np.int64), src.astype(np.int64), np.full(B, row, np.int64), threads, 1 << 20, stream_nt
            )
        t1 = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        g = n * B * row / t1 / 1e9
        print(
            f"mmap copy_ranges {threads:2d} thr nt={stream_nt}: {g:6.2f} GB/s {cpu / t1:5.1f} cores {cpu / t1 / (g / 10):.2f} cores/10GB/s",
            flush=True,
        )
# registration of the read-only mapping
cudart = torch.cuda.cudart()
torch.zeros(1, device="cuda")
t = time.perf_counter()
err = cudart.cudaHostRegister(base, size, 8)  # cudaHostRegisterReadOnly
print(
    f"cudaHostRegister(ReadOnly) of {size / 2**30:.1f} GiB mapping: err={int(err)} in {time.perf_counter() - t:.2f} s",
    flush=True,
)
if int(err) == 0:
    import cupy

    dev = torch.empty(B * row, dtype=torch.uint8, device="cuda")
    for nstreams in (1, 2, 4):
        streams = [torch.cuda.Stream() for _ in range(nstreams)]
        n = 40
        torch.cuda.synchronize()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for k in range(n):
            idx = rng.choice(rows, B, replace=False)
            for j, i in enumerate(idx):
                cupy.cuda.runtime.memcpyAsync(
                    dev.data_ptr() + j * row, base + 128 + int(i) * row, row, 1, streams[j % nstreams].cuda_stream
                )
        torch.cuda.synchronize()
        t1 = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        g = n * B * row / t1 / 1e9
        print(
            f"registered mapping, {B} row copies/batch on {nstreams} stream(s): {g:6.2f} GB/s {cpu / t1:5.1f} cores",
            flush=True,
        )
    # one big contiguous copy for the ceiling
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(20):
        cupy.cuda.runtime.memcpyAsync(dev.data_ptr(), base + 128 + k * B * row, B * row, 1, 0)
    torch.cuda.synchronize()
    print(f"registered mapping, contiguous 48 MiB copies: {20 * B * row / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
    # check bytes
    idx = np.array([5, 77, 1000])
    for i in idx:
        cupy.cuda.runtime.memcpy(dev.data_ptr(), base + 128 + int(i) * row, row, 1)
        assert torch.equal(dev[:row].cpu(), torch.from_numpy(arr[128 + i * row : 128 + (i + 1) * row].copy())), (
            "bytes differ"
        )
    print("bytes match")
    cudart.cudaHostUnregister(base)
