#!/usr/bin/env python3
"""torch_fastload read sweep: file -> GPU GB/s by threads x task size, hot and cold, for the C++
engine and for kvikio (in the manner of cuDF's GDS parameter sweep).

One data file of ``--size`` random bytes (written once with numpy's default_rng and fsynced,
reused while its size matches) is read ``--read-bytes`` at a time; consecutive reads rotate
through the file's windows so hot cells do not all hit the same pages.

  engine   the C++ engine's device path, as the loader runs it for files not mapped from the
           page cache (torch_fastload.engine.DeviceStager): one call per window; each task
           preads into a chunk of a pinned ring and its H2D copy is enqueued on a stream (a
           chunk is reused only after its copy's event completed). Time ends when the last copy
           completes: file -> GPU. (--cpu-smoke: engine.read_ranges into host memory in chunks
           of max(--chunk-bytes, task).)
  kvikio   kvikio.CuFile(path).pread(device tensor, nbytes, offset, task_size=task) straight into
           GPU memory (GDS where present, else compat mode: POSIX reads + bounce buffers),
           with kvikio.defaults.set("num_threads", threads) per cell.

  hot            the whole file was read once first and sits in the page cache
  cold-buffered  the window is dropped from the page cache (posix_fadvise DONTNEED; the file is
                 clean) before each read; the engine reads with pread
  cold-odirect   the same, the engine reads with O_DIRECT
  cold           kvikio after the same drop, reading as kvikio does by default

Baselines measured in the same run, and the ratios printed against them: raw pinned H2D (the
link's ceiling), the disk's parallel O_DIRECT rate (16 Python threads of os.preadv, 4 MiB blocks,
GIL released; no engine code) and a hot single-thread buffered os.preadv rate. Every backend's
first cell of each temperature is checked against the file (sampled 4 KiB pieces).

Prints one grid table per backend x temperature (rows threads, columns task size, GB/s), then
the summary (baselines, best cell of each, engine/kvikio ratios) last; writes read_sweep.json
(every cell, baselines, machine, command, date) and read_sweep.png (heatmaps) to --out.

    python benchmarks/read_sweep.py                      # full grid, ~2-4 min on one H100 (+ writing 4 GiB once)
    python benchmarks/read_sweep.py --quick              # threads 1,4,16,64 x tasks 1,4,16 MiB, 512 MiB reads
    python benchmarks/read_sweep.py --no-cold            # page-cache-hot cells only
    python benchmarks/read_sweep.py --backends engine --threads 8,16 --task-sizes 4MiB
    python benchmarks/read_sweep.py --dir /mnt/nvme/tmp --size 16GiB   # data file elsewhere
    python benchmarks/read_sweep.py --cpu-smoke --out /tmp/rs           # no GPU: tiny sizes, code paths only

Cells marked '*' have more threads than tasks per call (chunk or window / task): the extra
threads idle. Cold cells marked '!' still had more than 5 % of the window in the page cache.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import faulthandler
import itertools
import math
import mmap
import os
import shutil
import statistics
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout, not some installed copy

import numpy as np  # noqa: E402
import torch  # noqa: E402

from torch_fastload import engine  # noqa: E402
from torch_fastload import io as fio
from torch_fastload._benchutil import (
    Progress,
    error_text,
    fmt,
    h2d_copy_seconds,
    log,
    machine_info,  # noqa: E402
    positive_int_list,
    size_arg,
    size_list,
    sync,
    table,
    write_json,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096
SENTINEL = 0xAB
NOT_COLD = 0.05  # a cold cell with more of its window resident than this is flagged '!'

FULL_THREADS = [1, 2, 4, 8, 16, 32, 64]
FULL_TASKS = [256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_THREADS = [1, 4, 16, 64]
QUICK_TASKS = [MiB, 4 * MiB, 16 * MiB]
COLD_THREADS = [1, 4, 16, 64]
COLD_TASKS = [MiB, 4 * MiB, 16 * MiB]

# (backend, mode) series in the order they are measured and shown
HOT_SERIES = [("engine", "hot"), ("kvikio", "hot")]
COLD_SERIES = [("engine", "cold-buffered"), ("engine", "cold-odirect"), ("kvikio", "cold")]

DESIGN_REFERENCE = {  # DESIGN.md, measured facts of the H100 test machine
    "pinned_h2d_gbps": [53.5, 55.3],
    "disk_cold_gbps": [1.0, 2.6],
    "page_cache_one_thread_gbps": [6, 8],
    "kvikio_compat_hot_best_gbps": 44,
    "kvikio_compat_hot_best_at": "16 threads x 4 MiB",
    "kvikio_compat_hot_one_thread_gbps": 5,
    "kvikio_compat_cold_gbps": 1.3,
}


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def fmt_size(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def ratio(a, b) -> float | None:
    return a / b if (a is not None and b) else None


def aligned_host(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 numpy array (a view into a slightly larger one), every page touched."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    shift = (-raw.ctypes.data) % PAGE
    view = raw[shift : shift + nbytes]
    view.fill(0)
    return view


def aligned_pinned(nbytes: int) -> torch.Tensor:
    """A page-aligned pinned uint8 tensor (O_DIRECT reads into it need no bounce buffer)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
    shift = (-raw.data_ptr()) % PAGE
    return raw[shift : shift + nbytes]


# --------------------------------------------------------------------------------------------
# the data file
# --------------------------------------------------------------------------------------------
def default_data_dir() -> Path:
    """benchmarks/out/data, or $TMPDIR (tempfile's choice) where that cannot be created."""
    here = Path(__file__).resolve().parent / "out" / "data"
    try:
        here.mkdir(parents=True, exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    import tempfile

    return Path(tempfile.gettempdir())


def prepare_file(directory: Path, size: int, seed: int, progress: bool) -> dict:
    """The data file: reused when it exists with the right size, else written (random bytes in
    64 MiB chunks from numpy's default_rng, fsynced, renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"read_sweep_{fmt_size(size).replace(' ', '')}.bin"
    info = {"path": str(path), "size": size, "seed": seed}
    if path.exists() and path.stat().st_size == size:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # clean pages, or posix_fadvise(DONTNEED) cannot drop them
        finally:
            os.close(fd)
        info.update(reused=True, write_s=0.0)
        return info
    free = shutil.disk_usage(directory).free
    if free < size + 256 * MiB:
        raise OSError(
            errno.ENOSPC,
            f"{directory} has {free / GiB:.1f} GiB free; the data file needs "
            f"{size / GiB:.2f} GiB (use --dir elsewhere or a smaller --size)",
        )
    tmp = path.with_suffix(".bin.tmp")
    rng = np.random.default_rng(seed)
    chunk = 64 * MiB
    bar = Progress(math.ceil(size / chunk), f"writing {fmt_size(size)} data file", progress)
    t0 = time.perf_counter()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, size, chunk):
            n = min(chunk, size - start)
            data = rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]  # ~3 GB/s; rng.bytes is ~0.2
            view = memoryview(data)
            while view.nbytes:
                written = os.write(fd, view)
                view = view[written:]
            bar.update()
        os.fsync(fd)
    finally:
        os.close(fd)
        bar.close()
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    seconds = time.perf_counter() - t0
    info.update(reused=False, write_s=seconds, write_gbps=gbps(size, seconds))
    return info


# --------------------------------------------------------------------------------------------
# page cache: drop a window, measure how much of it is resident
# --------------------------------------------------------------------------------------------
def drop_cache(fd: int, offset: int, nbytes: int) -> None:
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


_libc = None


def _mincore_fraction(fd: int, offset: int, nbytes: int) -> float:
    """Fraction of the range's pages in the page cache: mmap + mincore through ctypes."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    page = mmap.PAGESIZE
    start = offset // page * page
    length = offset + nbytes - start
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap for mincore failed: {os.strerror(err)}")
    try:
        pages = (length + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(addr), length, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        return float(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / pages
    finally:
        _libc.munmap(ctypes.c_void_p(addr), length)


class Residency:
    """How much of a range is in the page cache: kvikio.get_page_cache_info where kvikio imports,
    else mincore through ctypes, else unknown (None)."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd
        self.method, self.problems = None, []
        try:
            import kvikio

            kvikio.get_page_cache_info(path, 0, PAGE)
            self._fn = lambda off, n: (lambda c, t: c / t if t else 0.0)(*kvikio.get_page_cache_info(path, off, n))
            self.method = "kvikio.get_page_cache_info"
            return
        except Exception as exc:
            self.problems.append(f"kvikio.get_page_cache_info: {error_text(exc)}")
        try:
            _mincore_fraction(fd, 0, PAGE)
            self._fn = lambda off, n: _mincore_fraction(fd, off, n)
            self.method = "mincore (ctypes)"
        except Exception as exc:
            self.problems.append(f"mincore: {error_text(exc)}")
            self._fn = None

    def fraction(self, offset: int, nbytes: int) -> float | None:
        if self._fn is None:
            return None
        try:
            return float(self._fn(offset, nbytes))
        except Exception:
            return None


# --------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------
def link_baseline(device: torch.device, nbytes: int, reps: int) -> dict:
    """Raw pinned -> device copy (fresh ``torch.empty(pin_memory=True)``), CUDA events, median of
    ``reps``: the link's ceiling. On the CPU smoke: a host memcpy instead."""
    if device.type != "cuda":
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(gbps(nbytes, time.perf_counter() - t0))
        return {
            "what": "host memcpy (cpu smoke: no GPU)",
            "bytes": nbytes,
            "gbps": statistics.median(samples),
            "samples_gbps": samples,
        }
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    samples = [gbps(nbytes, seconds) for seconds in h2d_copy_seconds(src, dst, reps)]
    ok = int(dst[0].item()) == 1 and int(dst[-1].item()) == 1
    del src, dst
    return {
        "what": "pinned (torch.empty(pin_memory=True)) -> cuda copy_(non_blocking=True), CUDA events",
        "bytes": nbytes,
        "gbps": statistics.median(samples),
        "best_gbps": max(samples),
        "samples_gbps": samples,
        "bytes_verified": ok,
    }


def disk_baseline(
    path: str, fd: int, offset: int, nbytes: int, residency: Residency, threads: int = 16, block: int = 4 * MiB
) -> dict:
    """The disk's parallel O_DIRECT read rate, no engine code: ``threads`` Python threads, each
    ``os.preadv`` of ``block`` bytes from an O_DIRECT fd into its own page-aligned anonymous
    mmap (the GIL is released in the syscall), over a window dropped from the page cache."""
    blocks = [(off, min(block, offset + nbytes - off)) for off in range(offset, offset + nbytes, block)]
    threads = max(1, min(threads, len(blocks)))
    drop_cache(fd, offset, nbytes)
    resident = residency.fraction(offset, nbytes)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    counter = itertools.count()
    errors: list = []
    done = [0] * threads

    def worker(k: int) -> None:
        buf = mmap.mmap(-1, block)
        view = memoryview(buf)
        try:
            while True:
                i = next(counter)
                if i >= len(blocks):
                    return
                off, n = blocks[i]
                got = os.preadv(dfd, [view[:n]], off)
                if got != n:
                    raise EOFError(f"O_DIRECT preadv at {off} returned {got} of {n} bytes")
                done[k] += got
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    try:
        workers = [threading.Thread(target=worker, args=(k,), name=f"disk-baseline-{k}") for k in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
    finally:
        os.close(dfd)
    if errors:
        raise errors[0]
    return {
        "what": f"{threads} Python thread{'s' if threads != 1 else ''}, os.preadv of {fmt_size(block)} blocks, O_DIRECT fd, "
        f"page-aligned mmap buffers, window dropped with posix_fadvise first",
        "offset": offset,
        "bytes": sum(done),
        "threads": threads,
        "block": block,
        "seconds": seconds,
        "gbps": gbps(sum(done), seconds),
        "resident_before": resident,
    }


def hot_buffered_baseline(fd: int, offsets: list, nbytes: int, block: int = 64 * MiB) -> dict:
    """One thread, ``os.preadv`` into a reused bytearray of ``block`` bytes, over hot windows."""
    block = min(block, nbytes)
    buf = bytearray(block)
    view = memoryview(buf)
    samples = []
    for offset in offsets:
        t0 = time.perf_counter()
        for off in range(offset, offset + nbytes, block):
            n = min(block, offset + nbytes - off)
            got = os.preadv(fd, [view[:n]], off)
            if got != n:
                raise EOFError(f"preadv at {off} returned {got} of {n} bytes")
        samples.append(gbps(nbytes, time.perf_counter() - t0))
    view.release()
    return {
        "what": f"1 thread, os.preadv of {fmt_size(block)} into a bytearray, page cache hot",
        "bytes": nbytes,
        "block": block,
        "gbps": statistics.median(samples),
        "samples_gbps": samples,
    }


def warm_file(path: str, fd: int, size: int, residency: Residency) -> dict:
    """Read the whole file once (engine, 16 threads x 4 MiB, into a 256 MiB host buffer; os.preadv
    when the engine is not built) so every window is in the page cache for the hot cells."""
    block = min(256 * MiB, size)
    buf = aligned_host(block)
    t0 = time.perf_counter()
    how = "engine 16 threads x 4 MiB"
    for off in range(0, size, block):
        n = min(block, size - off)
        if engine.available():
            engine.read_ranges(path, None, [off], [n], buf, num_threads=16, task_size=4 * MiB)
        else:
            how = "os.preadv, 1 thread"
            if os.preadv(fd, [memoryview(buf)[:n]], off) != n:
                raise EOFError(f"short read at {off} while warming {path}")
    seconds = time.perf_counter() - t0
    return {"how": how, "seconds": seconds, "gbps": gbps(size, seconds), "resident_after": residency.fraction(0, size)}


# --------------------------------------------------------------------------------------------
# backends: (path, offset, nbytes, dst, threads, task_size, cold) -> seconds
#   dst: the device buffer (a host numpy array on the CPU smoke); cold: None (hot), 'buffered',
#   'odirect' or 'default'. Dropping the page cache is the caller's job, outside the timing.
# --------------------------------------------------------------------------------------------
class EngineBackend:
    """The C++ engine's device path, as the loader runs it: ``engine.DeviceStager`` preads each
    task into a chunk of its pinned ring and enqueues the chunk's H2D copy on a stream."""

    name = "engine"
    RING_BYTES_CAP = 1 << 30  # 64 threads x 64 MiB tasks would otherwise pin 5 GiB

    def __init__(self, device: torch.device, min_chunk: int):
        self.device, self.min_chunk = device, min_chunk
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._stager = None
        self._stager_key = None

    def chunk_bytes(self, task_size: int, nbytes: int) -> int:
        """Bytes per engine call: the whole window on the GPU path, chunks on the CPU smoke."""
        return nbytes if self.cuda else min(nbytes, max(self.min_chunk, task_size))

    def describe(self) -> str:
        if not self.cuda:
            return (
                "engine.read_ranges straight into a page-aligned host numpy buffer, chunk by chunk (cpu smoke: no H2D)"
            )
        return (
            "engine.DeviceStager.read of the whole window: each task preads into a chunk of a pinned ring "
            "(threads + threads/4 chunks of the task size, capped at 1 GiB), its H2D copy enqueued on a "
            "stream, a chunk reused after its event; timed to the last copy's completion"
        )

    def stager(self, threads: int, task_size: int):
        chunks = max(2, min(fio.ring_chunks(threads), self.RING_BYTES_CAP // task_size))
        if self._stager_key != (task_size, chunks):
            if self._stager is not None:
                self._stager.close()
            self._stager = engine.DeviceStager(task_size, chunks)
            self._stager_key = (task_size, chunks)
        return self._stager

    def __call__(self, path, offset, nbytes, dst, threads, task_size, cold) -> float:
        o_direct = cold == "odirect"
        if not self.cuda:
            chunk = self.chunk_bytes(task_size, nbytes)
            t0 = time.perf_counter()
            for start in range(0, nbytes, chunk):
                n = min(chunk, nbytes - start)
                engine.read_ranges(
                    path,
                    None,
                    [offset + start],
                    [n],
                    dst[start : start + n],
                    num_threads=threads,
                    task_size=task_size,
                    o_direct=o_direct,
                )
            return time.perf_counter() - t0
        stager = self.stager(threads, task_size)
        sync(self.device)
        t0 = time.perf_counter()
        stager.read(
            path,
            None,
            [offset],
            [nbytes],
            dst,
            stream=self.stream.cuda_stream,
            num_threads=threads,
            task_size=task_size,
            o_direct=o_direct,
        )
        self.stream.synchronize()
        return time.perf_counter() - t0


class KvikioBackend:
    """kvikio.CuFile(path, 'r').pread(device buffer, ...) with kvikio's thread pool resized per cell."""

    name = "kvikio"

    def __init__(self):
        self.kvikio = None
        self.reason: str | None = None
        self.view_kind = None
        self.info: dict = {}

    def setup(self, smoke: bool, path: str, dst) -> None:
        try:
            import kvikio
            import kvikio.defaults  # noqa: F401
        except Exception as exc:
            self.reason = f"kvikio not importable ({error_text(exc)})"
            return
        self.kvikio = kvikio
        self.info["version"] = getattr(kvikio, "__version__", "?")
        for key in (
            "compat_mode",
            "num_threads",
            "task_size",
            "bounce_buffer_size",
            "gds_threshold",
            "auto_direct_io_read",
        ):
            try:
                value = kvikio.defaults.get(key)
                self.info[key] = getattr(value, "name", value)  # CompatMode is an IntEnum: keep its name
            except Exception as exc:
                self.info[key] = f"unknown ({type(exc).__name__})"
        try:
            self.info["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
        except Exception as exc:
            self.info["compat_mode_preferred"] = f"unknown ({type(exc).__name__})"
        try:
            from torch_fastload.io import gds_status

            self.info["gds_status"] = str(gds_status())
        except Exception as exc:
            self.info["gds_status"] = f"unknown ({error_text(exc)})"
        if smoke:
            self.reason = (
                f"--cpu-smoke: kvikio {self.info['version']} reads into GPU memory and this run has no GPU "
                "(its CuFile needs libcuda)"
            )
            return
        # probe: one 4 KiB read into the device buffer, checked against the file
        try:
            self.view_kind = "torch"
            try:
                self._probe(path, dst)
            except (TypeError, ValueError) as exc:  # this kvikio does not take torch tensors: try cupy
                try:
                    import cupy  # noqa: F401
                except Exception:
                    raise exc from None
                self.view_kind = "cupy"
                self._probe(path, dst)
        except Exception as exc:
            self.reason = f"kvikio unusable here: {error_text(exc)}"
            self.view_kind = None

    def view(self, dst):
        if self.view_kind == "cupy":
            import cupy

            return cupy.asarray(dst)  # zero-copy through __cuda_array_interface__
        return dst

    def _probe(self, path: str, dst) -> None:
        expect = np.fromfile(path, dtype=np.uint8, count=PAGE)
        dst[:PAGE].fill_(SENTINEL)
        sync(dst.device)
        with self.kvikio.CuFile(path, "r") as f:
            got = f.pread(self.view(dst[:PAGE]), PAGE, 0).get()
        sync(dst.device)
        if got != PAGE:
            raise EOFError(f"kvikio probe read {got} of {PAGE} bytes")
        if not np.array_equal(dst[:PAGE].cpu().numpy(), expect):
            raise ValueError("kvikio probe read wrong bytes")

    def set_threads(self, threads: int) -> None:
        defaults = self.kvikio.defaults
        if hasattr(defaults, "set"):
            defaults.set("num_threads", threads)  # process-wide; re-creates kvikio's pool
        else:  # older kvikio
            defaults.num_threads_reset(threads)

    def describe(self) -> str:
        return (
            f"kvikio {self.info.get('version')} CuFile.pread into a device tensor ({self.view_kind or '-'} view), "
            f"compat_mode={self.info.get('compat_mode')}; {self.info.get('gds_status')}"
        )

    def __call__(self, path, offset, nbytes, dst, threads, task_size, cold) -> float:
        self.set_threads(threads)
        view = self.view(dst[:nbytes])
        with self.kvikio.CuFile(path, "r") as f:
            sync(dst.device)
            t0 = time.perf_counter()
            got = f.pread(view, nbytes, offset, task_size=task_size).get()
            sync(dst.device)
            seconds = time.perf_counter() - t0
        if got != nbytes:
            raise EOFError(f"kvikio pread returned {got} of {nbytes} bytes at offset {offset}")
        return seconds


# --------------------------------------------------------------------------------------------
# correctness: sampled 4 KiB pieces of the destination against the file
# --------------------------------------------------------------------------------------------
def verify(dst, fd: int, offset: int, nbytes: int, rng: np.random.Generator, every: int = 64 * MiB) -> str | None:
    """None when every sampled 4 KiB piece (first, last, one per ``every`` bytes) matches the file."""
    starts = {0, max(0, nbytes - PAGE)}
    for base in range(0, nbytes, every):
        span = min(every, nbytes - base) - PAGE
        starts.add(base + (int(rng.integers(0, span // PAGE + 1)) * PAGE if span > 0 else 0))
    for s in sorted(starts):
        n = min(PAGE, nbytes - s)
        piece = dst[s : s + n]
        got = piece.cpu().numpy() if isinstance(piece, torch.Tensor) else np.asarray(piece)
        want = np.frombuffer(os.pread(fd, n, offset + s), dtype=np.uint8)
        if len(want) != n or not np.array_equal(got, want):
            bad = int(np.argmax(got != want)) if len(want) == n else 0
            return (
                f"wrong bytes at window byte {s + bad} (file offset {offset + s + bad}): "
                f"got {int(got[bad])}, file has {int(want[bad]) if len(want) > bad else 'EOF'}"
            )
    return None


def fill(dst, value: int) -> None:
    if isinstance(dst, torch.Tensor):
        dst.fill_(value)
        sync(dst.device)
    else:
        dst.fill(value)


# --------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------
class Sweep:
    def __init__(
        self, args, path: str, fd: int, dst, backends: dict, skip: dict, residency: Residency, results: dict, save
    ):
        self.args, self.path, self.fd, self.dst = args, path, fd, dst
        self.backends, self.skip, self.residency = backends, skip, residency
        self.results, self.save = results, save
        self.windows = [i * args.read_bytes for i in range(args.size // args.read_bytes)]
        self.next_window = 0
        self.verified: set = set()
        self.failures: dict = {}
        self.rng = np.random.default_rng(args.seed + 1)

    def window(self) -> int:
        offset = self.windows[self.next_window % len(self.windows)]
        self.next_window += 1
        return offset

    def call_bytes(self, backend: str, task: int) -> int:
        if backend == "engine" and self.backends.get("engine") is not None:
            return self.backends["engine"].chunk_bytes(task, self.args.read_bytes)
        return self.args.read_bytes

    def cell(self, backend: str, mode: str, threads: int, task: int, reps: int) -> dict:
        nbytes = self.args.read_bytes
        calls = self.call_bytes(backend, task)
        tasks_per_call = math.ceil(calls / task)
        entry = {
            "backend": backend,
            "mode": mode,
            "temperature": "hot" if mode == "hot" else "cold",
            "threads": threads,
            "task_size": task,
            "read_bytes": nbytes,
            "bytes_per_call": calls,
            "tasks_per_call": tasks_per_call,
            "idle_threads": threads > tasks_per_call,
            "status": "ok",
            "gbps": None,
            "reps": [],
        }
        key = (backend, mode)
        reason = self.skip.get(key)
        if reason is None and self.failures.get(key, 0) >= 2:
            reason = f"{backend} {mode}: stopped after 2 failed cells"
        if reason is not None:
            entry.update(status="skipped", reason=reason)
            return entry
        fn = self.backends[backend]
        cold = None if mode == "hot" else {"cold-buffered": "buffered", "cold-odirect": "odirect"}.get(mode, "default")
        check = key not in self.verified
        try:
            for rep in range(reps):
                offset = self.window()
                if cold is not None:
                    drop_cache(self.fd, offset, nbytes)
                if check and rep == 0:
                    fill(self.dst, SENTINEL)
                resident = self.residency.fraction(offset, nbytes)
                c0 = time.process_time()  # every thread of this process: the engine's and kvikio's too
                seconds = fn(self.path, offset, nbytes, self.dst, threads, task, cold)
                c1 = time.process_time()
                entry["reps"].append(
                    {
                        "offset": offset,
                        "seconds": seconds,
                        "gbps": gbps(nbytes, seconds),
                        "resident_before": resident,
                        "cpu_cores": (c1 - c0) / seconds if seconds else None,
                    }
                )
                if check and rep == 0:
                    problem = verify(self.dst, self.fd, offset, nbytes, self.rng)
                    entry["verified"] = problem is None
                    self.verified.add(key)
                    if problem is not None:
                        raise AssertionError(f"{backend} {mode} T{threads} x {fmt_size(task)}: {problem}")
        except Exception as exc:
            self.failures[key] = self.failures.get(key, 0) + 1
            entry.update(status="error", reason=error_text(exc), traceback=traceback.format_exc())
            self.results["errors"][f"{backend} {mode} T{threads} x {fmt_size(task)}"] = error_text(exc)
            log(f"{backend} {mode} T{threads} x {fmt_size(task)}: FAILED {error_text(exc)}")
            return entry
        rates = [r["gbps"] for r in entry["reps"]]
        residents = [r["resident_before"] for r in entry["reps"] if r["resident_before"] is not None]
        cores = [r["cpu_cores"] for r in entry["reps"] if r["cpu_cores"] is not None]
        entry.update(
            gbps=statistics.median(rates),
            best_gbps=max(rates),
            resident_before=max(residents) if residents else None,
            cpu_cores=statistics.median(cores) if cores else None,
        )
        entry["not_cold"] = bool(cold is not None and residents and max(residents) > NOT_COLD)
        return entry

    def run(self, phase: str, series: list, threads: list, tasks: list, reps: int) -> None:
        grid = [(t, s) for t in threads for s in tasks]
        bar = Progress(len(grid) * len(series), f"{phase} cells", self.args.progress)
        try:
            for t, s in grid:  # backends interleaved per cell, so drift hits them alike
                for backend, mode in series:
                    entry = self.cell(backend, mode, t, s, reps)
                    self.results["cells"].append(entry)
                    note = f"{backend} {mode} T{t} x {fmt_size(s)}: " + (
                        f"{entry['gbps']:.2f} GB/s" if entry["gbps"] is not None else entry["status"]
                    )
                    bar.update(1, note)
                    if self.args.verbose:
                        log(note)
                self.save()
        finally:
            bar.close()


# --------------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------------
def series_list(results: dict) -> list:
    return results["series"]


def cells_of(results: dict, backend: str, mode: str) -> list:
    return [c for c in results["cells"] if c["backend"] == backend and c["mode"] == mode]


def best_cell(results: dict, backend: str, mode: str) -> dict | None:
    ok = [c for c in cells_of(results, backend, mode) if c["gbps"] is not None]
    return max(ok, key=lambda c: c["gbps"]) if ok else None


def cell_text(c: dict | None) -> str:
    if c is None:
        return ""
    if c["status"] == "skipped":
        return "skip"
    if c["status"] == "error":
        return "err"
    return f"{c['gbps']:.2f}" + ("*" if c["idle_threads"] else "") + ("!" if c.get("not_cold") else "")


def grid_tables(results: dict) -> str:
    out = []
    for s in series_list(results):
        cells = cells_of(results, s["backend"], s["mode"])
        if not cells:
            continue
        threads = sorted({c["threads"] for c in cells})
        tasks = sorted({c["task_size"] for c in cells})
        by = {(c["threads"], c["task_size"]): c for c in cells}
        rows = [[t] + [cell_text(by.get((t, k))) for k in tasks] for t in threads]
        reps = max((len(c["reps"]) for c in cells), default=0)
        title = (
            f"{s['backend']} {s['mode']}: GB/s file -> {'host' if results['cpu_smoke'] else 'GPU'}, "
            f"{fmt_size(results['args']['read_bytes'])} per read" + (f", median of {reps}" if reps else "")
        )
        out.append("")
        out.append(table(["threads \\ task"] + [fmt_size(k) for k in tasks], rows, title=title))
        reasons = sorted({c["reason"] for c in cells if c["status"] == "skipped"})
        for r in reasons:
            out.append(f"  skipped: {r}")
        for c in cells:
            if c["status"] == "error":
                out.append(f"  err T{c['threads']} x {fmt_size(c['task_size'])}: {c['reason']}")
    if out:
        out.append("")
        out.append(
            "'*' more threads than tasks per call (the engine's chunk, or kvikio's whole read) / task: some "
            f"idle; '!' cold cell with > {NOT_COLD:.0%} of its window resident before the read"
        )
    return "\n".join(out)


def summarize(results: dict) -> None:
    b = results["baselines"]
    link = (b.get("link") or {}).get("gbps")
    disk = (b.get("disk_odirect") or {}).get("gbps")
    hot1 = (b.get("hot_buffered_1_thread") or {}).get("gbps")
    best = {}
    for s in series_list(results):
        c = best_cell(results, s["backend"], s["mode"])
        key = f"{s['backend']} {s['mode']}"
        if c is None:
            cells = cells_of(results, s["backend"], s["mode"])
            why = next((x.get("reason") for x in cells if x.get("reason")), None) or s.get("reason") or "no cell ran"
            best[key] = {"backend": s["backend"], "mode": s["mode"], "gbps": None, "reason": why}
            continue
        best[key] = {
            "backend": s["backend"],
            "mode": s["mode"],
            "gbps": c["gbps"],
            "threads": c["threads"],
            "task_size": c["task_size"],
            "cpu_cores": c.get("cpu_cores"),
            "of_link": ratio(c["gbps"], link),
            "over_disk": ratio(c["gbps"], disk) if s["mode"] != "hot" else None,
            "over_hot_1_thread": ratio(c["gbps"], hot1) if s["mode"] == "hot" else None,
        }
    results["best"] = best

    def g(key):
        return (best.get(key) or {}).get("gbps")

    cold_engine = max([v for v in (g("engine cold-buffered"), g("engine cold-odirect")) if v is not None], default=None)
    results["ratios"] = {
        "engine_over_kvikio_hot": ratio(g("engine hot"), g("kvikio hot")),
        "engine_over_kvikio_cold": ratio(cold_engine, g("kvikio cold")),
        "engine_buffered_over_kvikio_cold": ratio(g("engine cold-buffered"), g("kvikio cold")),
        "engine_odirect_over_kvikio_cold": ratio(g("engine cold-odirect"), g("kvikio cold")),
    }


def summary_text(results: dict) -> str:
    b = results["baselines"]
    lines = [
        "SUMMARY: read sweep ("
        + (
            "CPU smoke: numbers are meaningless"
            if results["cpu_smoke"]
            else (results["machine"].get("gpu") or {}).get("name", "GPU")
        )
        + ")"
    ]
    names = [
        ("link", "link ceiling"),
        ("disk_odirect", "disk O_DIRECT baseline"),
        ("hot_buffered_1_thread", "hot 1-thread buffered"),
        ("warm", "warm-up read of the file"),
    ]
    for key, label in names:
        v = b.get(key) or {}
        if v.get("gbps") is not None:
            extra = f"  [{v.get('what') or v.get('how')}]"
            if key == "disk_odirect" and v.get("resident_before") is not None:
                extra += f" resident before {v['resident_before']:.0%}"
            lines.append(f"  {label:<26} {v['gbps']:7.2f} GB/s{extra}")
        else:
            lines.append(f"  {label:<26}     -   ({v.get('error') or v.get('reason') or 'not measured'})")
    rows, notes = [], []
    for key, v in results["best"].items():
        if v["gbps"] is None:
            rows.append([key, "skipped", "-", "-", "-", "-", "-", "-"])
            notes.append(f"  {key}: {v['reason']}")
            continue
        rows.append(
            [
                key,
                f"{v['gbps']:.2f}",
                v["threads"],
                fmt_size(v["task_size"]),
                fmt(100 * v["of_link"] if v["of_link"] else None, ".0f"),
                fmt(v["over_disk"], ".2f"),
                fmt(v["over_hot_1_thread"], ".2f"),
                fmt(v["cpu_cores"], ".2f"),
            ]
        )
    lines.append("")
    lines.append(
        table(
            ["backend mode", "best GB/s", "threads", "task", "% link", "x disk", "x hot-1T", "CPU cores"],
            rows,
            title="best cell of each backend x temperature (% link: of the link ceiling; x disk: "
            "over the O_DIRECT disk baseline)",
        )
    )
    if notes:
        lines.append("skipped or failed:")
        lines.extend(notes)
    r = results["ratios"]
    lines.append("")
    lines.append(
        f"engine best / kvikio best: hot {fmt(r['engine_over_kvikio_hot'], '.2f')}x; cold "
        f"{fmt(r['engine_over_kvikio_cold'], '.2f')}x (engine's better of buffered "
        f"{fmt(r['engine_buffered_over_kvikio_cold'], '.2f')}x / O_DIRECT "
        f"{fmt(r['engine_odirect_over_kvikio_cold'], '.2f')}x)"
    )
    return "\n".join(lines)


def plot_notes(results: dict) -> str:
    """The free panel's text: best cell of each series and the engine / kvikio ratios."""
    lines = ["best cell (GB/s, threads x task, % link):"]
    for key, v in results["best"].items():
        if v["gbps"] is None:
            lines.append(f"  {key:<21} skipped")
        else:
            lines.append(
                f"  {key:<21} {v['gbps']:6.2f}  T{v['threads']} x {fmt_size(v['task_size'])}  "
                f"{fmt(100 * v['of_link'] if v['of_link'] else None, '.0f')}%"
            )
    r = results["ratios"]
    lines += [
        "",
        "engine best / kvikio best:",
        f"  hot  {fmt(r['engine_over_kvikio_hot'], '.2f')}x",
        f"  cold {fmt(r['engine_over_kvikio_cold'], '.2f')}x",
        "",
        "* threads > tasks per call (some idle)",
        f"! cold cell > {NOT_COLD:.0%} resident",
    ]
    return "\n".join(lines)


def make_plot(results: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm, Normalize
        from matplotlib.ticker import ScalarFormatter
    except Exception as exc:
        return f"no plot: matplotlib unavailable ({error_text(exc)})"
    values = [c["gbps"] for c in results["cells"] if c["gbps"]]
    if not values:
        return "no plot: nothing measured"
    vmin, vmax = min(values), max(values)
    norm = LogNorm(vmin=vmin / 1.05, vmax=vmax * 1.05) if vmax / vmin > 4 else Normalize(0, vmax * 1.05)
    hot = [s for s in series_list(results) if s["mode"] == "hot"]
    cold = [s for s in series_list(results) if s["mode"] != "hot"]
    rows = [r for r in (hot, cold) if r]
    ncols = max(len(r) for r in rows)
    kwargs = {"figsize": (4.8 * ncols, 4.2 * len(rows)), "squeeze": False}
    try:
        fig, axes = plt.subplots(len(rows), ncols, layout="constrained", **kwargs)
    except TypeError:  # matplotlib < 3.5
        fig, axes = plt.subplots(len(rows), ncols, constrained_layout=True, **kwargs)
    cmap = plt.get_cmap("viridis")
    image, panel_used = None, False
    for r, row in enumerate(rows):
        for col in range(ncols):
            ax = axes[r][col]
            if col >= len(row):
                ax.axis("off")
                if not panel_used:
                    panel_used = True
                    ax.text(
                        0.0,
                        1.0,
                        plot_notes(results),
                        ha="left",
                        va="top",
                        fontsize=8,
                        family="monospace",
                        transform=ax.transAxes,
                    )
                continue
            s = row[col]
            cells = cells_of(results, s["backend"], s["mode"])
            title = f"{s['backend']} {s['mode']}"
            measured = [c for c in cells if c["gbps"] is not None]
            if not measured:
                why = next((c.get("reason") for c in cells if c.get("reason")), None) or s.get("reason") or "no cells"
                ax.text(
                    0.5,
                    0.5,
                    "skipped / failed:\n" + textwrap.fill(str(why), 42),
                    ha="center",
                    va="center",
                    fontsize=8,
                    transform=ax.transAxes,
                    wrap=True,
                )
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_title(title, fontsize=10)
                continue
            threads = sorted({c["threads"] for c in cells})
            tasks = sorted({c["task_size"] for c in cells})
            grid = np.full((len(threads), len(tasks)), np.nan)
            for c in cells:
                i, j = threads.index(c["threads"]), tasks.index(c["task_size"])
                if c["gbps"] is not None:
                    grid[i, j] = c["gbps"]
            image = ax.imshow(np.ma.masked_invalid(grid), norm=norm, cmap=cmap, aspect="auto")
            for c in cells:
                i, j = threads.index(c["threads"]), tasks.index(c["task_size"])
                text = cell_text(c)
                shade = norm(c["gbps"]) if c["gbps"] is not None else 1.0
                ax.text(j, i, text, ha="center", va="center", fontsize=7.5, color="white" if shade < 0.55 else "black")
            ax.set_xticks(range(len(tasks)), [fmt_size(k).replace(" ", "") for k in tasks], fontsize=8)
            ax.set_yticks(range(len(threads)), [str(t) for t in threads], fontsize=8)
            ax.set_xlabel("task size", fontsize=8)
            ax.set_ylabel("threads", fontsize=8)
            b = best_cell(results, s["backend"], s["mode"])
            ax.set_title(
                f"{title}: best {b['gbps']:.1f} GB/s (T{b['threads']} x {fmt_size(b['task_size'])})", fontsize=9
            )
    if image is not None:
        bar = fig.colorbar(
            image,
            ax=axes.ravel().tolist(),
            shrink=0.85,
            label="GB/s (1e9 B/s), " + ("log scale" if isinstance(norm, LogNorm) else "linear"),
        )
        bar.ax.yaxis.set_major_formatter(ScalarFormatter())
        bar.ax.yaxis.set_minor_formatter(ScalarFormatter())
    m, bl = results["machine"], results["baselines"]
    what = "CPU smoke (numbers meaningless)" if results["cpu_smoke"] else (m.get("gpu") or {}).get("name", "GPU")
    fig.suptitle(
        f"torch_fastload read sweep, file -> {'host' if results['cpu_smoke'] else 'GPU'}: {what}, "
        f"{fmt_size(results['args']['read_bytes'])} reads of a {fmt_size(results['args']['size'])} file, "
        f"{m['date']}\nlink {fmt((bl.get('link') or {}).get('gbps'), '.1f')} GB/s | disk O_DIRECT "
        f"{fmt((bl.get('disk_odirect') or {}).get('gbps'), '.2f')} GB/s | hot 1-thread buffered "
        f"{fmt((bl.get('hot_buffered_1_thread') or {}).get('gbps'), '.2f')} GB/s",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "out",
        help="directory for read_sweep.json and read_sweep.png",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory of the data file [benchmarks/out/data, else $TMPDIR]; not a tmpfs: cold cells need a disk",
    )
    p.add_argument("--quick", action="store_true", help="threads 1,4,16,64 x tasks 1,4,16 MiB, 512 MiB reads")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU: 16 MiB file, 4 MiB reads into host memory, kvikio skipped (numbers meaningless)",
    )
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--size", type=size_arg, default=None, help="data file size [4GiB; smoke 16MiB]")
    p.add_argument(
        "--read-bytes", type=size_arg, default=None, help="bytes per cell's read [1GiB, 512MiB quick; smoke 4MiB]"
    )
    p.add_argument(
        "--threads",
        type=positive_int_list,
        default=None,
        help="hot thread counts [1,2,4,8,16,32,64; quick 1,4,16,64; smoke 1,2]",
    )
    p.add_argument(
        "--task-sizes",
        type=size_list,
        default=None,
        help="hot task sizes [256KiB,1MiB,4MiB,16MiB,64MiB; quick 1MiB,4MiB,16MiB; smoke 1MiB]",
    )
    p.add_argument(
        "--cold-threads", type=positive_int_list, default=None, help="cold thread counts [1,4,16,64; smoke 1,2]"
    )
    p.add_argument(
        "--cold-task-sizes", type=size_list, default=None, help="cold task sizes [1MiB,4MiB,16MiB; smoke 1MiB]"
    )
    p.add_argument("--no-cold", dest="cold", action="store_false", help="hot cells only")
    p.add_argument("--backends", default="engine,kvikio", help="comma-separated subset of engine,kvikio")
    p.add_argument(
        "--chunk-bytes",
        type=size_arg,
        default=None,
        help="engine: minimum chunk per read_ranges call + H2D copy; a chunk is max(this, task) [64MiB; smoke 1MiB]",
    )
    p.add_argument("--reps", type=int, default=None, help="reads per hot cell, median reported [3; quick and smoke 2]")
    p.add_argument("--cold-reps", type=int, default=1, help="reads per cold cell (each dropped first)")
    p.add_argument("--link-reps", type=int, default=5, help="samples of the pinned H2D ceiling (256 MiB copies)")
    p.add_argument("--disk-threads", type=int, default=16, help="threads of the O_DIRECT disk baseline")
    p.add_argument("--seed", type=int, default=0, help="seed of the data file's bytes")
    p.add_argument("--delete-data", action="store_true", help="remove the data file at the end")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before a hung run dumps every stack and exits")
    p.add_argument("--verbose", action="store_true", help="one line per cell as well as the progress bar")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    return p


def finish_args(args) -> None:
    smoke, quick = args.cpu_smoke, args.quick

    def pick(name, full, quick_value, smoke_value):
        if getattr(args, name) is None:
            setattr(args, name, smoke_value if smoke else (quick_value if quick else full))

    pick("size", 4 * GiB, 4 * GiB, 16 * MiB)
    pick("read_bytes", GiB, 512 * MiB, 4 * MiB)
    pick("threads", FULL_THREADS, QUICK_THREADS, [1, 2])
    pick("task_sizes", FULL_TASKS, QUICK_TASKS, [MiB])
    pick("cold_threads", COLD_THREADS, COLD_THREADS, [1, 2])
    pick("cold_task_sizes", COLD_TASKS, COLD_TASKS, [MiB])
    pick("chunk_bytes", 64 * MiB, 64 * MiB, MiB)
    pick("reps", 3, 2, 2)
    if args.dir is None:
        args.dir = default_data_dir()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - {"engine", "kvikio"})
    if unknown or not backends:
        raise SystemExit(f"--backends takes engine and/or kvikio, got {args.backends!r}")
    args.backends = backends
    for name in ("size", "read_bytes"):
        if getattr(args, name) % PAGE:
            raise SystemExit(
                f"--{name.replace('_', '-')} must be a multiple of {PAGE} (O_DIRECT), got {getattr(args, name)}"
            )
    if args.read_bytes > args.size:
        raise SystemExit(f"--read-bytes {fmt_size(args.read_bytes)} > --size {fmt_size(args.size)}")
    for name in ("threads", "cold_threads"):
        if max(getattr(args, name)) > engine.MAX_THREADS:
            raise SystemExit(f"--{name.replace('_', '-')} must be <= {engine.MAX_THREADS}, got {getattr(args, name)}")
    for name in ("reps", "cold_reps", "link_reps", "disk_threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    finish_args(args)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.stderr.write(
            f"read_sweep.py: CUDA is not available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); this sweep reads into GPU memory.\n"
            "Use --cpu-smoke to exercise the code paths on the CPU with tiny sizes.\n"
        )
        return 2
    began = time.perf_counter()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    if args.cpu_smoke:
        device = torch.device("cpu")
    else:
        if args.device >= torch.cuda.device_count():
            sys.stderr.write(f"read_sweep.py: --device {args.device} but {torch.cuda.device_count()} CUDA device(s)\n")
            return 2
        torch.cuda.set_device(args.device)
        device = torch.device("cuda", args.device)

    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "read_sweep.json", args.out / "read_sweep.png"
    machine = machine_info(device.type == "cuda")
    results: dict = {
        "benchmark": "benchmarks/read_sweep.py",
        "cpu_smoke": args.cpu_smoke,
        "date": machine["date"],
        "command_line": machine["command_line"],
        "machine": machine,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "design_reference": DESIGN_REFERENCE,
        "units": "GB/s = 1e9 bytes per second",
        "definitions": {
            "gbps": "median over the cell's reads of read_bytes / wall seconds (engine: to the last H2D copy's "
            "completion; kvikio: pread(...).get() + device sync); best_gbps: the fastest read",
            "cpu_cores": "process CPU seconds (all threads, incl. any spin-waits) / wall seconds during the read",
            "resident_before": "fraction of the window in the page cache just before the read",
            "tasks_per_call": "ceil(bytes per read call / task): the engine's chunk, kvikio's whole read; "
            "idle_threads = threads > tasks_per_call",
            "verified": "first cell of each backend x mode: sampled 4 KiB pieces compared with the file",
        },
        "data": {},
        "baselines": {},
        "backends": {},
        "series": [],
        "cells": [],
        "errors": {},
    }

    def save():
        results["elapsed_s"] = time.perf_counter() - began
        write_json(json_path, results)

    where = (machine.get("gpu") or {}).get("name", "CPU (smoke: numbers are meaningless)")
    log(
        f"torch_fastload read sweep on {where}: "
        f"torch {machine['torch']}, {machine['cpu_affinity'] or machine['cpu_count']} CPUs, "
        f"{machine['mem_total_gib']} GiB RAM, {machine['date']}"
    )
    log(f"command: {machine['command_line']}")

    # ---- data file ------------------------------------------------------------------------
    data = prepare_file(args.dir, args.size, args.seed, args.progress)
    results["data"] = data
    path = data["path"]
    log(
        f"data file {path} ({fmt_size(args.size)}): "
        + ("reused" if data["reused"] else f"written in {data['write_s']:.1f} s ({data['write_gbps']:.2f} GB/s)")
    )
    mem = machine.get("mem_total_gib")
    if mem and args.size > 0.6 * mem * GiB:
        log(f"WARNING: the {fmt_size(args.size)} file is > 60 % of {mem} GiB RAM: hot cells may not be hot")
    fd = os.open(path, os.O_RDONLY)
    residency = Residency(path, fd)
    results["page_cache_check"] = {"method": residency.method, "problems": residency.problems}
    if residency.method is None:
        log("note: no way to check page-cache residency here (" + "; ".join(residency.problems) + ")")
    save()

    # ---- backends and what each can run ---------------------------------------------------
    skip: dict = {}
    if args.cpu_smoke:
        dst = aligned_host(args.read_bytes)
    else:
        dst = torch.empty(args.read_bytes, dtype=torch.uint8, device=device)
    backends: dict = {}
    if "engine" in args.backends:
        if engine.available():
            backends["engine"] = EngineBackend(device, args.chunk_bytes)
            results["backends"]["engine"] = {
                "how": backends["engine"].describe(),
                "pool_size_before": engine.pool_size(),
            }
            try:  # O_DIRECT probe: one aligned page
                probe = aligned_host(PAGE)
                engine.read_ranges(path, None, [0], [PAGE], probe, num_threads=1, task_size=PAGE, o_direct=True)
                results["backends"]["engine"]["o_direct"] = "ok"
            except OSError as exc:
                reason = f"the filesystem refuses O_DIRECT ({error_text(exc)})"
                skip[("engine", "cold-odirect")] = reason
                results["backends"]["engine"]["o_direct"] = reason
        else:
            reason = f"the C++ engine is not built ({error_text(engine._IMPORT_ERROR)})"
            results["backends"]["engine"] = {"skipped": reason}
            for s in HOT_SERIES + COLD_SERIES:
                if s[0] == "engine":
                    skip[s] = reason
    else:
        for s in HOT_SERIES + COLD_SERIES:
            if s[0] == "engine":
                skip[s] = "not in --backends"
    kv = KvikioBackend()
    if "kvikio" in args.backends:
        kv.setup(args.cpu_smoke, path, dst)
        results["backends"]["kvikio"] = {
            **kv.info,
            "how": kv.describe() if kv.reason is None else None,
            "skipped": kv.reason,
        }
        if kv.reason is None:
            backends["kvikio"] = kv
        else:
            log(f"kvikio skipped: {kv.reason}")
            for s in HOT_SERIES + COLD_SERIES:
                if s[0] == "kvikio":
                    skip[s] = kv.reason
    else:
        for s in HOT_SERIES + COLD_SERIES:
            if s[0] == "kvikio":
                skip[s] = "not in --backends"
    series = HOT_SERIES + (COLD_SERIES if args.cold else [])
    series = [s for s in series if s[0] in args.backends]
    results["series"] = [{"backend": b, "mode": m, "reason": skip.get((b, m))} for b, m in series]
    for name, info in results["backends"].items():
        if info.get("how"):
            log(f"{name}: {info['how']}")
    save()

    # ---- baselines --------------------------------------------------------------------------
    windows = [i * args.read_bytes for i in range(args.size // args.read_bytes)]
    base = results["baselines"]
    link_bytes = 256 * MiB if not args.cpu_smoke else 16 * MiB
    for name, fn in (
        ("link", lambda: link_baseline(device, link_bytes, args.link_reps)),
        (
            "disk_odirect",
            lambda: disk_baseline(path, fd, windows[-1], args.read_bytes, residency, threads=args.disk_threads),
        ),
        ("warm", lambda: warm_file(path, fd, args.size, residency)),
        (
            "hot_buffered_1_thread",
            lambda: hot_buffered_baseline(fd, [windows[i % len(windows)] for i in range(3)], args.read_bytes),
        ),
    ):
        try:
            base[name] = fn()
            v = base[name]
            log(
                f"baseline {name}: {fmt(v.get('gbps'), '.2f')} GB/s"
                + (f" (resident after: {v['resident_after']:.0%})" if v.get("resident_after") is not None else "")
                + (f" (resident before: {v['resident_before']:.0%})" if v.get("resident_before") is not None else "")
            )
        except Exception as exc:
            base[name] = {"gbps": None, "error": error_text(exc)}
            log(f"baseline {name}: FAILED {error_text(exc)}")
        save()
    warm = base.get("warm") or {}
    if warm.get("resident_after") is not None and warm["resident_after"] < 0.95:
        log(
            f"WARNING: only {warm['resident_after']:.0%} of the file is in the page cache after reading it: "
            "hot cells are partly cold"
        )

    # ---- the sweep --------------------------------------------------------------------------
    sweep = Sweep(args, path, fd, dst, backends, skip, residency, results, save)
    hot_series = [s for s in series if s[1] == "hot"]
    cold_series = [s for s in series if s[1] != "hot"]
    try:
        log(
            f"hot: {len(args.threads)} x {len(args.task_sizes)} cells x {len(hot_series)} backends, "
            f"{args.reps} reads of {fmt_size(args.read_bytes)} each"
        )
        sweep.run("hot", hot_series, args.threads, args.task_sizes, args.reps)
        if cold_series:
            log(
                f"cold: {len(args.cold_threads)} x {len(args.cold_task_sizes)} cells x {len(cold_series)} "
                f"(backend, mode), {args.cold_reps} read(s) of {fmt_size(args.read_bytes)} each"
            )
            sweep.run("cold", cold_series, args.cold_threads, args.cold_task_sizes, args.cold_reps)
    except KeyboardInterrupt:
        results["errors"]["sweep"] = "interrupted"
        save()
        raise
    finally:
        os.close(fd)
    if "engine" in backends:
        results["backends"]["engine"]["pool_size_after"] = engine.pool_size()

    summarize(results)
    if args.plot:
        problem = make_plot(results, png_path)
        results["plot"] = problem or str(png_path)
        if problem:
            log(f"note: {problem}")
    if args.delete_data:
        os.unlink(path)
        results["data"]["deleted"] = True
    save()
    faulthandler.cancel_dump_traceback_later()

    log(grid_tables(results))
    if results["errors"]:
        log("\nERRORS: " + "; ".join(f"{k}: {v}" for k, v in results["errors"].items()))
    log(f"\nwrote {json_path}" + (f" and {png_path}" if results.get("plot") == str(png_path) else ""))
    log("")
    log(summary_text(results))
    log(f"\ntotal time {time.perf_counter() - began:.1f} s")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
