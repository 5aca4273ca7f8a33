"""Benchmark data on disk and the page cache: random files written once, residency (mincore),
dropping and warming."""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .output import GiB, MiB, Progress

PAGE = 4096
_FINITE_FLOAT32 = np.uint64(0xBFFFFFFFBFFFFFFF)  # bit 30 of each float32 cleared: |x| < 2, never inf/NaN


def fsync_file(path) -> None:
    """Flush a written file to storage (before its pages are dropped or timed cold)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path, offset: int = 0, length: int = 0) -> None:
    """Evict a file's pages (``length`` 0: to its end) from the page cache, so the next read
    comes from storage. fsync first: posix_fadvise(DONTNEED) drops clean pages only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(paths) -> None:
    """Read files once so the page cache holds them (benchmarks that start hot say so)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


_libc = None


def _mincore_lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def residency(path, offset: int = 0, nbytes: int | None = None) -> float | None:
    """Share of the range's pages in the page cache now (mmap + mincore); None where unknown.
    The mapping is never touched, so measuring does not change the answer."""
    try:
        size = os.path.getsize(path)
        nbytes = size - offset if nbytes is None else min(nbytes, size - offset)
        if nbytes <= 0:
            return 1.0
        libc = _mincore_lib()
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        length = offset + nbytes - start
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), length, vec) != 0:
                return None
            return float(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), length)
    except (OSError, AttributeError):
        return None


def residency_of(paths) -> float | None:
    """Residency of several files, weighted by size (None if any is unknown)."""
    sizes = [os.path.getsize(p) for p in paths]
    shares = [residency(p) for p in paths]
    if any(s is None for s in shares):
        return None
    return sum(s * n for s, n in zip(shares, sizes)) / max(1, sum(sizes))


def write_random(path: Path, nbytes: int, seed: int, header: bytes = b"", progress: bool = True) -> bool:
    """``header`` then ``nbytes`` of random bytes (every float32 finite), fsynced and renamed into
    place; a file already there with that header and size is kept. True if it was written."""
    path = Path(path)
    if path.exists() and path.stat().st_size == len(header) + nbytes:
        with open(path, "rb") as f:
            if f.read(len(header)) == header:
                return False
    free = shutil.disk_usage(path.parent).free
    if free < nbytes + 256 * MiB:
        raise OSError(
            errno.ENOSPC, f"{path.parent} has {free / GiB:.1f} GiB free; {path.name} needs {nbytes / GiB:.2f}"
        )
    rng = np.random.default_rng(seed)
    chunk = 64 * MiB
    bar = Progress(-(-nbytes // chunk), f"writing {path.name}", progress)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, random name
    try:
        os.write(fd, header)
        for start in range(0, nbytes, chunk):
            n = min(chunk, nbytes - start)
            words = rng.bit_generator.random_raw((n + 7) // 8) & _FINITE_FLOAT32  # ~3 GB/s; rng.bytes ~0.2
            view = memoryview(words.view(np.uint8)[:n])
            while view.nbytes:
                view = view[os.write(fd, view) :]
            bar.update()
        os.fsync(fd)
        os.fchmod(fd, 0o644)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
        bar.close()
    os.replace(tmp, path)
    return True


def random_npy(path: Path, shape: tuple, seed: int, progress: bool = True) -> bool:
    """A float32 ``.npy`` of ``shape`` holding finite random values (see ``write_random``)."""
    header = np.lib.format.header_data_from_array_1_0(np.empty((0,), np.float32))
    header["shape"] = tuple(int(s) for s in shape)
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return write_random(path, 4 * int(np.prod(shape)), seed, buf.getvalue(), progress)


def aligned_empty(nbytes: int, fill: int | None = None) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of ``nbytes`` (a view into a slightly larger one),
    touched with ``fill`` so every page is resident."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    view = raw[shift : shift + nbytes]
    if fill is not None:
        view.fill_(fill)
    return view
