"""Issue 21: how a decoded row group can reach the GPU, each route on its own decode threads
with nothing else running, against read_table in the same process (interleaved rounds, medians).

    python3 benchmarks/gpu/parquet_copy_routes.py [DATA_DIR]     (ROUNDS=5 by default; ~1 min)

Routes, every row group of the file on N threads (each row group decoded and copied by the same
thread, the copy waited for):
  decode      pyarrow's read_row_group only (the decode's own ceiling)
  pageable    each Arrow buffer copied to the device from pageable memory (the driver stages it)
  pinned      each buffer copied into a pinned buffer of the thread, then one device copy
  registered  buffers of 256 KiB and more cudaHostRegister'ed where they lie, copied to the
              device and unregistered (the smaller ones through the pinned buffer)
Sources: the file read by pyarrow (pre-buffered), arrow's memory_map=True, and one shared
mapping of the file faulted in before the clock starts ("shared map": the best case of a
memory-mapped read mode, whose page faults are paid outside the timing).
Also the loader at its defaults (``benchmarks/parquet.py``'s timed second epoch).
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
REGISTER_MIN = 256 << 10
ROUTES = [  # (label, copy route, threads, source)
    ("decode x8", "decode", 8, "file"),
    ("decode x8, memory_map", "decode", 8, "memory_map"),
    ("decode x8, shared map", "decode", 8, "shared"),
    ("pageable x8", "pageable", 8, "file"),
    ("pinned x8", "pinned", 8, "file"),
    ("pinned x12", "pinned", 12, "file"),
    ("pinned x8, shared map", "pinned", 8, "shared"),
    ("registered x8", "registered", 8, "file"),
]


def shared_mapping(path: Path) -> pa.Buffer:
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buffer = pa.py_buffer(region)
    int(np.frombuffer(buffer, dtype=np.uint8)[:: mmap.PAGESIZE].sum())  # every page faulted in
    return buffer


def route_gbps(path: Path, route: str, threads: int, source: str, shared: pa.Buffer, device) -> float:
    meta = pq.read_metadata(path)
    local = threading.local()
    cudart = torch.cuda.cudart()

    def one(i: int) -> int:
        if not hasattr(local, "file"):
            if source == "shared":
                local.file = pq.ParquetFile(pa.BufferReader(shared), pre_buffer=True)
            else:
                local.file = pq.ParquetFile(path, pre_buffer=True, memory_map=source == "memory_map")
            local.stream = torch.cuda.Stream(device)
            local.pinned = torch.empty(96 << 20, dtype=torch.uint8, pin_memory=True)
        table = local.file.read_row_group(i)
        if route == "decode":
            return table.nbytes
        buffers = [b for c in table.columns for k in c.chunks for b in k.buffers() if b is not None and b.size]
        total = sum(b.size for b in buffers)
        registered = []
        with torch.cuda.stream(local.stream):
            out = torch.empty(total, dtype=torch.uint8, device=device)
            offset = 0
            for b in buffers:
                host = torch.frombuffer(b, dtype=torch.uint8)
                dst = out[offset : offset + b.size]
                if route == "pageable":
                    dst.copy_(host, non_blocking=True)
                elif (
                    route == "registered"
                    and b.size >= REGISTER_MIN
                    and int(cudart.cudaHostRegister(b.address, b.size, 0)) == 0
                ):
                    registered.append(b.address)
                    dst.copy_(host, non_blocking=True)
                else:
                    local.pinned[offset : offset + b.size].copy_(host)
                    if route == "registered":
                        dst.copy_(local.pinned[offset : offset + b.size], non_blocking=True)
                offset += b.size
            if route == "pinned":
                out.copy_(local.pinned[:total], non_blocking=True)
            local.stream.synchronize()
        for address in registered:
            cudart.cudaHostUnregister(address)
        return table.nbytes

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(min(threads, meta.num_row_groups))))  # threads, readers, buffers made
        torch.cuda.synchronize()
        started = time.perf_counter()
        nbytes = sum(pool.map(one, range(meta.num_row_groups)))
        seconds = time.perf_counter() - started
    return nbytes / seconds / 1e9


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fastload-parquet")
    root.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.set_num_threads(1)  # each thread's copies into its pinned buffer on that thread
    files = [
        parquet_data.write_alert(root, 4_000_000, "none", 131072),
        parquet_data.write_alert(root, 1_000_000, "snappy", 131072),
    ]
    args = types.SimpleNamespace(device=device, batch_rows=65536)
    for path in files:
        shared = shared_mapping(path)
        ratios: dict = {}
        for round_ in range(ROUNDS):
            baseline = bench.read_table_best(path)
            for label, route, threads, source in ROUTES:
                gbps = route_gbps(path, route, threads, source, shared, device)
                ratios.setdefault(label, []).append(gbps / baseline["gbps"])
            loader = bench.fastload_run(path, args)
            ratios.setdefault("loader, defaults", []).append(loader["gbps"] / baseline["gbps"])
            line = ", ".join(f"{k} {v[-1]:.2f}" for k, v in ratios.items())
            print(f"{path.name} round {round_} (read_table {baseline['gbps']:.2f} GB/s): {line}", flush=True)
        for label, values in ratios.items():
            print(
                f"{path.name:40s} {label:24s} median x{statistics.median(values):.2f} read_table"
                f" (min {min(values):.2f}, max {max(values):.2f}, {len(values)} rounds)",
                flush=True,
            )


if __name__ == "__main__":
    main()
