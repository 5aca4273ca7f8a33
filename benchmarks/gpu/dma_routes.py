"""GPU time of one 48 MiB batch's H2D by route, alone and beside bf16 GEMMs on another stream:
one contiguous copy vs 256 scattered 192 KiB rows in one cuMemcpyBatchAsync, from pinned
(cudaHostAlloc), registered (cudaHostRegister of a pageable tensor) or page-cache (a mapped,
registered file) memory; one vs several copy streams; random vs ascending source order. The
copy stream first runs a sleep kernel, so the host's enqueueing is not timed.

    python3 benchmarks/gpu/dma_routes.py        # ~15 s on the H100 machine; JSON to $OUT
"""

import ctypes
import json
import os
import statistics
from pathlib import Path

import torch

dev = torch.device("cuda")


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attrs(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("src", Loc), ("dst", Loc), ("flags", ctypes.c_uint)]


def batch(dsts, srcs, sizes, stream):
    n = len(dsts)
    D = (ctypes.c_uint64 * n)(*dsts)
    S = (ctypes.c_uint64 * n)(*srcs)
    Z = (ctypes.c_size_t * n)(*sizes)
    a = Attrs(1, Loc(0, 0), Loc(0, 0), 0)
    idx = (ctypes.c_size_t * 1)(0)
    batch_async = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2  # CUDA 13's symbol
    count, stream_handle = ctypes.c_size_t(n), ctypes.c_void_p(stream.cuda_stream)
    r = batch_async(D, S, Z, count, ctypes.byref(a), idx, ctypes.c_size_t(1), stream_handle)
    assert r == 0, r


ROW, N = 192 * 1024, 256
ROWS = (1 << 30) // ROW
OUT = Path(os.environ.get("OUT", "/tmp"))


def main():
    g = torch.Generator().manual_seed(0)
    pageable = torch.randint(0, 256, (ROWS, ROW), dtype=torch.uint8, generator=g)
    assert int(torch.cuda.cudart().cudaHostRegister(pageable.data_ptr(), pageable.numel(), 0)) == 0
    pinned = torch.empty((ROWS, ROW), dtype=torch.uint8, pin_memory=True)
    pinned.copy_(pageable)
    from torch_fastload import _C

    pageable.numpy().tofile("/tmp/dma_routes.bin")
    with open("/tmp/dma_routes.bin", "rb") as f:
        while f.read(64 << 20):
            pass
    mapped = _C.MappedFile("/tmp/dma_routes.bin")

    class Src:
        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr

    mapped_src = Src(mapped.data_ptr)
    dst = torch.empty(N * ROW, dtype=torch.uint8, device=dev)
    streams = [torch.cuda.Stream() for _ in range(8)]
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    gs = torch.cuda.Stream()

    def rows_for(src, order):
        idx = torch.randperm(ROWS, generator=g)[:N].tolist()
        pairs = [(src.data_ptr() + i * ROW, dst.data_ptr() + k * ROW) for k, i in enumerate(idx)]
        if order == "ascending":
            pairs.sort()
        return pairs

    def run(case, beside):
        kind, src_name, nstreams, order = case
        src = {"pinned": pinned, "registered": pageable, "mapped": mapped_src}[src_name]
        times = []
        for rep in range(25):
            if beside and rep % 5 == 0:
                with torch.cuda.stream(gs):
                    for _ in range(60):
                        a @ a
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0 = streams[0]
            pairs = rows_for(src, order)
            start = torch.randint(0, ROWS - N, (1,), generator=g).item()
            with torch.cuda.stream(s0):
                torch.cuda._sleep(2_000_000)  # the GPU waits while the host enqueues
            e0.record(s0)
            if kind == "contiguous":
                batch([dst.data_ptr()], [src.data_ptr() + start * ROW], [N * ROW], s0)
            else:
                ends = []
                for s in range(nstreams):
                    part = pairs[s::nstreams]
                    st = streams[s]
                    if s:
                        st.wait_event(e0)
                    batch([d for _, d in part], [p for p, _ in part], [ROW] * len(part), st)
                    if s:
                        ev = torch.cuda.Event()
                        ev.record(st)
                        ends.append(ev)
                for ev in ends:
                    s0.wait_event(ev)
            e1.record(s0)
            e1.synchronize()
            if rep >= 3:
                times.append(e0.elapsed_time(e1))
        torch.cuda.synchronize()
        return statistics.median(times)

    cases = [
        ("contiguous", "pinned", 1, "-"),
        ("contiguous", "registered", 1, "-"),
        ("scattered", "pinned", 1, "random"),
        ("scattered", "registered", 1, "random"),
        ("scattered", "registered", 1, "ascending"),
        ("scattered", "registered", 2, "random"),
        ("scattered", "registered", 4, "random"),
        ("scattered", "registered", 8, "random"),
        ("scattered", "pinned", 2, "random"),
        ("contiguous", "mapped", 1, "-"),
        ("scattered", "mapped", 1, "random"),
        ("scattered", "mapped", 2, "random"),
    ]
    res = {}
    for _round in range(2):
        for case in cases:
            for beside in (False, True):
                key = " ".join(map(str, case)) + (" beside GEMM" if beside else " alone")
                res.setdefault(key, []).append(run(case, beside))
    for k, v in res.items():
        print(f"{k:55s} {statistics.median(v):.3f} ms  {N * ROW / statistics.median(v) / 1e6:.1f} GB/s  {v}")
    (OUT / "dma_routes.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
