"""The two ceilings every I/O figure is compared with, measured in the same run: the link
(pinned host -> device cudaMemcpy) and the disk (parallel O_DIRECT reads, no engine code)."""

from __future__ import annotations

import itertools
import mmap
import os
import statistics
import threading
import time

import torch

from .files import drop_page_cache, residency
from .output import MiB, fmt_size, gbps
from .timing import h2d_copy_seconds


def link_baseline(device: torch.device, nbytes: int = 256 * MiB, reps: int = 5) -> dict:
    """Pinned (``torch.empty(pin_memory=True)``) -> device ``copy_(non_blocking=True)`` of
    ``nbytes``: GB/s, the median of ``reps`` samples of back-to-back copies (>= 256 MiB a sample,
    so launch gaps do not count), and the median time of one copy alone. On the CPU: a host
    memcpy, so CPU runs have a figure of the same shape."""
    if device.type != "cuda":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        return {
            "what": "host memcpy (no GPU)",
            "bytes": nbytes,
            "gbps": gbps(nbytes, seconds),
            "copy_ms": 1e3 * seconds,
        }
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    inner = max(1, min(64, (256 * MiB) // nbytes))
    samples = [nbytes * inner / s / 1e9 for s in h2d_copy_seconds(src, dst, reps, inner=inner)]
    singles = h2d_copy_seconds(src, dst, reps) if inner > 1 else [nbytes / g / 1e9 for g in samples]
    verified = int(dst[0].item()) == 1 and int(dst[-1].item()) == 1
    return {
        "what": "pinned (torch.empty(pin_memory=True)) -> cuda, copy_(non_blocking=True), CUDA events",
        "bytes": nbytes,
        "inner": inner,
        "gbps": statistics.median(samples),
        "best_gbps": max(samples),
        "copy_ms": 1e3 * statistics.median(singles),
        "samples_gbps": samples,
        "bytes_verified": verified,
    }


def disk_baseline(path, offset: int = 0, nbytes: int | None = None, threads: int = 16, block: int = 4 * MiB) -> dict:
    """The disk's parallel O_DIRECT read rate over a range dropped from the page cache first:
    ``threads`` Python threads, each ``os.preadv`` of ``block`` bytes from an O_DIRECT fd into its
    own page-aligned anonymous mmap (the GIL is released in the syscall)."""
    size = os.path.getsize(path)
    end = min(size, offset + (size if nbytes is None else nbytes)) // block * block
    blocks = list(range(offset, end, block))
    threads = max(1, min(threads, len(blocks)))
    drop_page_cache(path, offset, end - offset)
    resident = residency(path, offset, end - offset)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    counter = itertools.count()
    errors: list = []

    def worker() -> None:
        buf = mmap.mmap(-1, block)
        try:
            while (i := next(counter)) < len(blocks):
                if os.preadv(fd, [buf], blocks[i]) != block:
                    raise EOFError(f"short O_DIRECT read of {path} at {blocks[i]}")
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            buf.close()

    try:
        workers = [threading.Thread(target=worker, name=f"disk-baseline-{k}") for k in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return {
        "what": f"{threads} Python threads, os.preadv of {fmt_size(block)} blocks, O_DIRECT, range dropped first",
        "offset": offset,
        "bytes": end - offset,
        "threads": threads,
        "block": block,
        "seconds": seconds,
        "gbps": gbps(end - offset, seconds),
        "resident_before": resident,
    }
