"""The Parquet decode arena: row groups decoded by pyarrow's C++ straight into pinned memory.

Decoding is the Parquet source's one unavoidable pass over the bytes; the copy of the decoded
columns into a pinned slot was another, and on the H100 machine it and the DMA reading it held
the loader to 0.72-0.85x of pyarrow's own decode rate (benchmarks/JOURNAL.md). With the
extension ``torch_fastload._arrow`` (csrc/arrow/, built where pyarrow's headers are found),
row groups decode into one arena the loader maps once, registers with CUDA once, and declares a
direct region (``staging.add_direct_region``): the batch's columns then go to the GPU from
where they were decoded. Offsets (rebased per batch), masks and widened columns still pass
through the slot; allocations the arena cannot hold fall back to Arrow's default pool and go
the same way.

The arena is one per process, sized by the first dataset that asks (later ones share it).
"""

from __future__ import annotations

import functools
import threading

import pyarrow as pa
import torch

from .. import config, engine
from ..staging import add_direct_region

__all__ = ["decoder", "page_decoder", "arena_stats", "unavailable_reason", "gather_region"]

try:
    from .. import _arrow
except ImportError as exc:  # not built (no pyarrow at build time), or built for another pyarrow
    _arrow, _IMPORT_ERROR = None, exc
else:
    _IMPORT_ERROR = None
    if _arrow.ARROW_VERSION != pa.__version__:
        _arrow, _IMPORT_ERROR = (
            None,
            ImportError(
                f"torch_fastload._arrow was built for pyarrow {_arrow.ARROW_VERSION}, pyarrow {pa.__version__} is "
                "installed: rebuild torch_fastload (pip install --no-build-isolation .)"
            ),
        )

_LOCK = threading.Lock()
_ARENA: tuple | None = None  # (address, bytes)
_REGISTRATION: int | None = None  # its cuMemHostRegister result (0: done; portable: every device)
# The pinned region shuffled batches are gathered into (``_C.gathered_region``, sized by the
# config's ``parquet_gather_pinned``): a batch's buffers are held from its gather until its
# copy to the device is done, a few batches at once; what does not fit is malloc'd and staged
# through the slot as before.
_GATHER_REGISTRATION: int | None = None


def _pin_direct(base: int, size: int, device: torch.device) -> int:
    """Register ``[base, base + size)`` with CUDA and, where that worked, declare it a direct
    region (batch fields lying there go to ``device`` from where they lie); the CUDA result."""
    code = engine.host_register(base, size, device.index)  # index None: the current device
    if code == 0:
        add_direct_region(base, size)
    return code


def unavailable_reason() -> str | None:
    """Why the arena cannot be used in this process (None: it can)."""
    return None if _arrow is not None else str(_IMPORT_ERROR)


def page_decoder():
    """``_arrow.read_row_group`` with the page decoder, into Arrow's default pool (CPU batches,
    or the arena off); None without the extension."""
    if _arrow is None:
        return None
    return functools.partial(_arrow.read_row_group, by_pages=True, into_arena=False)


def decoder(device: torch.device, nbytes: int, by_pages: bool = True):
    """``_arrow.read_row_group`` (``by_pages``: with the page decoder) once the arena (``nbytes``,
    the first caller's size) is mapped, registered with CUDA and declared a direct region for
    ``device``; None where it cannot be (extension missing, not a CUDA device, registration
    refused: rows are then decoded into pageable memory and staged through the slot)."""
    global _ARENA, _REGISTRATION
    if _arrow is None or device.type != "cuda" or nbytes <= 0:
        return None
    with _LOCK:
        if _ARENA is None:
            _ARENA = _arrow.make_arena(int(nbytes))
        base, size = _ARENA
        if _REGISTRATION is None:
            _REGISTRATION = _pin_direct(base, size, device)
    return functools.partial(_arrow.read_row_group, by_pages=by_pages) if _REGISTRATION == 0 else None


def gather_region(device: torch.device) -> bool:
    """Whether shuffled batches' gathered columns (``_C.gather_rows``) now lie in pinned memory
    declared a direct region, so they go to ``device`` from where they were gathered: one host
    copy of the batch fewer (into the slot). The region is mapped, registered with CUDA and
    declared once a process (``parquet_gather_pinned`` bytes, read then); False where it cannot
    be (no extension, not CUDA, refused, or 0 bytes asked for)."""
    global _GATHER_REGISTRATION
    if device.type != "cuda" or not hasattr(engine._C, "gathered_region"):
        return False
    with _LOCK:
        if _GATHER_REGISTRATION is None:
            nbytes = config.get("parquet_gather_pinned")
            if not nbytes:
                return False  # asked again at the next bind: the setting may change
            base, size = engine._C.gathered_region(nbytes)
            _GATHER_REGISTRATION = _pin_direct(base, size, device) if size else -1
    return _GATHER_REGISTRATION == 0


def arena_stats() -> dict | None:
    """The arena's bytes carved and live, its allocations and those that fell back to Arrow's
    default pool; None before it is made."""
    return _arrow.arena_stats() if _arrow is not None and _ARENA is not None else None
