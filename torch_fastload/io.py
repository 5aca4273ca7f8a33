"""Read backends: which code moves file bytes into a batch, and which one is in effect.

A batch's file-backed fields are ``staging.PendingRead`` ranges. One ``Reader`` per loader
(``readers.py``) executes them, into the pinned slot or straight into GPU memory:

    mode in effect    reads with                          into
    gds               kvikio CuFile (cuFile, GPUDirect)    device memory (no pinned hop)
    kvikio-compat     kvikio CuFile, GDS unavailable       the pinned slot (or device memory
                      (POSIX reads on kvikio's threads)    when io_mode='gds' was forced)
    engine-posix      the C++ engine, pread                device memory (CUDA): files resident
                                                           in the page cache are mapped and a
                                                           GPU kernel gathers from them (no CPU
                                                           copy); the rest goes through a pinned
                                                           ring of cache-sized chunks. The slot
                                                           with io_mode='pinned' or on the CPU
    engine-odirect    the C++ engine, O_DIRECT             the ring (never mapped)
    python-posix      os.pread (engine not built)          the pinned slot

Ranges of ``s3://`` and ``http(s)://`` objects go, whatever the mode, to the reader's
``remote.RemoteReader`` (``remote-http``: concurrent range requests, or ``remote-kvikio``;
objects in the shard cache are read by the mode above and counted as ``remote-cache``).

``select(io_mode, device, ...)`` turns the requested ``io_mode`` (auto | gds | pinned | posix)
into an ``IoPath`` saying which mode runs and why; the loader reports it in its stats (with
the bytes each path moved: ``mapped``, ``engine-posix``, ...) and logs it, never silently.
``pinned`` stages whole batches in the pinned pool (one H2D copy per batch). Every backend
checks every range against its file's size before reading, reads whole ranges or raises
(``RangeError`` / ``ShortReadError`` / ``OSError`` naming the file, offset and length), and
never returns a partly filled batch.

NOTE [kvikio and streams]: kvikio's device reads in compat mode copy bounce buffers on
per-thread streams created with ``CU_STREAM_DEFAULT``, which synchronize with the legacy
default stream that training usually runs on (measured: a GEMM step fed this way took 8.9x
the device-resident step). So ``auto`` only reads into device memory through kvikio when real
GDS is there (cuFile DMA, no stream); otherwise the engine's work goes on the loader's own
non-blocking copy stream (1.15x). ``benchmarks/file_loader.py`` times both.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from dataclasses import dataclass

import torch

from . import config, engine

__all__ = [
    "IoPath",
    "GdsStatus",
    "select",
    "gds_status",
    "ring_chunks",
]

log = logging.getLogger("torch_fastload")

MODES = ("gds", "kvikio-compat", "engine-posix", "engine-odirect", "python-posix")


@dataclass(frozen=True)
class GdsStatus:
    """Whether cuFile can DMA from storage into GPU memory here, and if not, why not."""

    available: bool
    kvikio_version: str | None
    compat_mode: str | None  # kvikio's setting: ON, OFF or AUTO
    reasons: tuple  # why GDS is not usable (empty when it is)

    def __str__(self) -> str:
        if self.kvikio_version is None:
            return "kvikio not installed: " + "; ".join(self.reasons)
        state = "GDS available" if self.available else "GDS unavailable (" + "; ".join(self.reasons) + ")"
        return f"kvikio {self.kvikio_version}, compat_mode={self.compat_mode}: {state}"


def _kvikio():
    """kvikio, or None where it is not installed (or cannot load its libraries)."""
    try:
        import kvikio
        import kvikio.cufile_driver  # noqa: F401
        import kvikio.defaults  # noqa: F401
    except Exception:  # ImportError, or an OSError from a missing libcufile
        return None
    return kvikio


@functools.lru_cache(maxsize=1)
def gds_status() -> GdsStatus:
    """Probe kvikio, the cuFile driver and the nvidia-fs kernel module (cached)."""
    kvikio = _kvikio()
    if kvikio is None:
        return GdsStatus(False, None, None, ("pip install kvikio-cu12 or kvikio-cu13 for GDS and kvikio reads",))
    reasons = []
    try:
        with open("/proc/modules") as f:
            if not any(line.split(" ", 1)[0] == "nvidia_fs" for line in f):
                reasons.append("the nvidia-fs kernel module is not loaded")
    except OSError:
        reasons.append("/proc/modules is unreadable")
    if not os.path.isdir("/run/udev"):
        reasons.append("/run/udev is missing (cuFile cannot enumerate devices, as in most containers)")
    try:
        compat = kvikio.defaults.get("compat_mode")
        compat = getattr(compat, "name", str(compat))
    except Exception as exc:
        compat = f"unknown ({exc})"
    available = False
    try:
        available = bool(kvikio.cufile_driver.get("is_gds_available"))
        if not available:
            reasons.append("cuFile reports GDS unavailable")
    except Exception as exc:
        reasons.append(f"the cuFile driver did not load ({str(exc).splitlines()[0]})")
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            reasons.append("kvikio prefers compat mode (KVIKIO_COMPAT_MODE or no cuFile)")
            available = False
    except Exception:
        pass
    return GdsStatus(available and not reasons, getattr(kvikio, "__version__", "?"), compat, tuple(reasons))


@dataclass(frozen=True)
class IoPath:
    """The read path in effect for a loader: what was asked for, what runs, and why."""

    requested: str
    mode: str  # one of MODES
    to_device: bool  # reads land in GPU memory (no whole-batch pinned slot)
    threads: int
    task_size: int
    why: str
    ring_chunks: int = 0  # engine on CUDA: pinned chunks of task_size between the file and the GPU
    map_budget: int = 0  # engine on CUDA: page cache it may pin to DMA resident files directly
    remote: str = ""  # how s3:// and http(s):// objects are read, where the source has any
    extension: str = ""  # what of the C++ extension is missing and what that costs ('' where complete)

    def __str__(self) -> str:
        if self.ring_chunks:
            where = f"GPU memory via a pinned ring of {self.ring_chunks} chunks"
            if self.map_budget:
                where += f"; page-cache-resident files (<= {self.map_budget / 2**30:.1f} GiB) DMA'd directly"
        else:
            where = "GPU memory" if self.to_device else "pinned slot"
        return (
            f"{self.mode} -> {where} ({self.threads} threads x {self.task_size / 2**20:g} MiB tasks; "
            f"io_mode={self.requested}: {self.why})"
            + (f"; remote objects: {self.remote}" if self.remote else "")
            + (f"; {self.extension}" if self.extension else "")
        )


def ring_chunks(threads: int) -> int:
    """Chunks in the engine's pinned ring: one per thread reading plus slack for chunks whose
    copies are still queued, few enough that the ring stays in the CPU's last-level cache."""
    return threads + max(2, threads // 4)


def select(
    io_mode: str | None = None,
    device: torch.device | str = "cpu",
    o_direct: bool | None = None,
    threads: int | None = None,
    task_size: int | None = None,
    map_budget: int | str | None = None,
    remote: bool = False,
) -> IoPath:
    """The read path for ``io_mode`` (None: configured) on ``device``; raises where it cannot run.
    ``remote``: the source reads URLs too (``IoPath.remote`` then says how)."""
    from .extension import status

    path = _select_local(io_mode, device, o_direct, threads, task_size, map_budget)
    missing = status().missing()
    if missing:
        path = dataclasses.replace(path, extension=" ".join(missing))
    if not remote:
        return path
    from .remote import describe_settings

    return dataclasses.replace(path, remote=describe_settings())


def _select_local(io_mode, device, o_direct, threads, task_size, map_budget) -> IoPath:
    requested = config.resolve("io_mode", io_mode)
    o_direct = config.resolve("o_direct", o_direct)
    threads = config.resolve("io_threads", threads)
    task_size = config.resolve("io_task_size", task_size)
    map_budget = config.resolve("map_budget", map_budget)
    device = torch.device(device)
    cuda = device.type == "cuda"
    has_engine = engine.available()

    def engine_path(why: str, ring: bool = True) -> IoPath:
        if has_engine:
            mode = "engine-odirect" if o_direct else "engine-posix"
            if cuda and ring:
                budget = 0 if o_direct else map_budget  # O_DIRECT asks to leave the page cache alone
                return IoPath(requested, mode, True, threads, task_size, why, ring_chunks(threads), budget)
            return IoPath(requested, mode, False, threads, task_size, why)
        if o_direct:
            raise ValueError(
                "o_direct=True needs the C++ engine (torch_fastload._C), which is not built: "
                "run `pip install -e .` or pass o_direct=False"
            )
        return IoPath(
            requested,
            "python-posix",
            False,
            threads,
            task_size,
            why + "; the C++ engine is not built, so plain os.pread reads one range at a time",
        )

    if requested == "posix":
        return engine_path("the C++ engine was asked for")
    if o_direct and requested == "gds":
        raise ValueError(
            "o_direct=True applies to the C++ engine (io_mode='posix' or 'auto'); "
            "cuFile chooses direct I/O itself under io_mode='gds'"
        )
    status = gds_status() if requested != "posix" else None
    if requested == "gds":
        if not cuda:
            raise ValueError(f"io_mode='gds' reads into GPU memory, but the loader's device is {device}")
        if status.kvikio_version is None:
            raise ValueError(f"io_mode='gds' needs kvikio: {status}")
        if status.available:
            return IoPath(requested, "gds", True, threads, task_size, "cuFile DMA from storage into GPU memory")
        why = "GDS unavailable: " + "; ".join(status.reasons)
        warnings.warn(
            f"torch_fastload: io_mode='gds' runs in kvikio compat mode ({why}); kvikio's "
            "device reads then synchronize with the default stream (a training step beside them "
            "slows down). io_mode='auto' reads through the engine instead.",
            RuntimeWarning,
            stacklevel=3,
        )
        return IoPath(requested, "kvikio-compat", True, threads, task_size, why)
    if requested == "pinned":
        if o_direct or status.kvikio_version is None or not cuda:
            reason = (
                "o_direct asked for"
                if o_direct
                else "kvikio is not installed"
                if status.kvikio_version is None
                else "kvikio needs a CUDA device"
            )
            return engine_path(f"pinned slots through the C++ engine ({reason})", ring=False)
        return IoPath(
            requested,
            "kvikio-compat",
            False,
            threads,
            task_size,
            "kvikio's thread pool reads into the pinned slot; the H2D copy runs on the loader's stream",
        )
    # auto
    if cuda and not o_direct and status.available:
        return IoPath(requested, "gds", True, threads, task_size, "GDS is available")
    why = (
        "o_direct asked for"
        if o_direct
        else f"device is {device}"
        if not cuda
        else "GDS unavailable: " + "; ".join(status.reasons)
    )
    return engine_path(why)


# ------------------------------------------------------------------------------------------
# the ranges of a batch
# ------------------------------------------------------------------------------------------


_READER_NAMES = {"Reader", "EngineReader", "PythonReader", "KvikioReader", "make_reader", "batch_ranges", "coalesce"}


def __getattr__(name: str):
    """The readers live in ``readers.py`` (they import this module's ``IoPath``)."""
    if name in _READER_NAMES:
        from . import readers

        return getattr(readers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
