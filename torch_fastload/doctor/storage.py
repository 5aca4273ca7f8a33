"""The storage under ``--dir``: its filesystem and block device (``filesystem_of``), and a test
file written, then read cold (O_DIRECT, buffered) and hot (``measure_storage``).

The test file lives in a ``scratch_file``: on Linux it is unlinked as soon as it is created and
read through ``/proc/self/fd``, so no exit (an exception, Ctrl-C, SIGTERM, even SIGKILL) leaves
its gigabyte behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from .common import CHUNK, STORAGE_TASK, STORAGE_THREADS, GiB, gbps, read_file, size_text

__all__ = ["filesystem_of", "write_test_file", "measure_storage", "scratch_file", "drop_page_cache", "SCRATCH_PREFIX"]

SCRATCH_PREFIX = ".torch_fastload_doctor-"


@contextlib.contextmanager
def scratch_file(directory: str) -> Iterator[str]:
    """A path for the test file in ``directory`` that nothing outlives. Where ``/proc/self/fd``
    reaches open files (Linux), the file is unlinked at once and the path is its descriptor's:
    the kernel frees it when the process ends, however it ends. Elsewhere it is removed on the
    way out of the ``with``."""
    fd, path = tempfile.mkstemp(prefix=SCRATCH_PREFIX, suffix=".bin", dir=directory)
    try:
        through_fd = f"/proc/self/fd/{fd}"
        if os.path.exists(through_fd):
            os.unlink(path)
            yield through_fd
        else:
            yield path
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def drop_page_cache(path: str) -> None:
    """Evict the file's pages from the page cache, so the next read comes from storage. fsync
    first: posix_fadvise(DONTNEED) drops clean pages only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _unescape_mount(text: str) -> str:
    r"""/proc/mounts writes ' ' as \040, tab as \011, ..."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def filesystem_of(path: str) -> dict:
    """The mount holding ``path`` (longest mount-point prefix in /proc/mounts; the last of equal
    ones, which shadows the others) and the block device under it from /sys."""
    real = os.path.realpath(path)
    best = None
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            source, point, fstype = (_unescape_mount(p) for p in parts[:3])
            inside = point == "/" or real == point or real.startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) >= len(best[1])):
                best = (source, point, fstype)
    info: dict = {
        "dir": real,
        "mount_source": best and best[0],
        "mount_point": best and best[1],
        "fstype": best and best[2],
        "block_device": None,
    }
    st = os.stat(path)
    link = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if os.path.exists(link):  # absent for tmpfs, overlay, NFS, ...: no block device of their own
        node = os.path.realpath(link)
        disk = os.path.dirname(node) if os.path.exists(os.path.join(node, "partition")) else node
        info["block_device"] = "/dev/" + os.path.basename(node)

        def sysfs(rel: str) -> str | None:
            try:
                with open(os.path.join(disk, rel)) as f:
                    return f.read().strip() or None
            except OSError:
                return None

        rotational = sysfs("queue/rotational")
        info["disk"] = {
            "name": os.path.basename(disk),
            "model": sysfs("device/model"),
            "rotational": None if rotational is None else rotational == "1",
        }
    return info


def write_test_file(path: str, size: int, seed: int = 0) -> dict:
    """Random bytes (incompressible, no zero-page shortcuts), written in 64 MiB chunks and fsynced
    so every page is clean: POSIX_FADV_DONTNEED only drops clean pages."""
    rng = np.random.default_rng(seed)
    seconds = 0.0
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = rng.bytes(min(CHUNK, left))
            start = time.perf_counter()
            f.write(chunk)
            seconds += time.perf_counter() - start
            left -= len(chunk)
        start = time.perf_counter()
        f.flush()
        os.fsync(f.fileno())
        seconds += time.perf_counter() - start
    return {"gbps": gbps(size, seconds), "seconds": seconds}


def measure_storage(path: str, size: int, directory: str | None = None) -> dict:
    """Write the test file ``path``, then cold (O_DIRECT, buffered) and hot (page cache) reads
    of it: what an epoch costs the first time and when the data set fits in memory.
    ``directory``: where the file is (default: ``path``'s; a ``scratch_file`` path is not)."""
    directory = directory or os.path.dirname(path)
    free = shutil.disk_usage(directory).free
    if free < size:
        raise OSError(errno.ENOSPC, f"{size_text(size)} test file does not fit: {free / GiB:.1f} GiB free", directory)
    result: dict = {
        "filesystem": filesystem_of(directory),
        "size": size,
        "threads": STORAGE_THREADS,
        "task_size": STORAGE_TASK,
    }
    result["write"] = write_test_file(path, size)
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(0)  # touch every page now, so no read below times page faults
    read = lambda **kw: read_file(path, size, dst, STORAGE_THREADS, STORAGE_TASK, **kw)  # noqa: E731

    drop_page_cache(path)
    try:
        result["cold_odirect"] = {"gbps": gbps(size, read(o_direct=True))}
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        result["cold_odirect"] = {
            "skipped": f"the filesystem refuses O_DIRECT (EINVAL) ({result['filesystem']['fstype']})"
        }
    drop_page_cache(path)
    result["cold_buffered"] = {"gbps": gbps(size, read())}
    read()  # the file is in the page cache now; time the next read
    result["hot"] = {"gbps": gbps(size, read())}
    return result
