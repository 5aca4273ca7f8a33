"""Thin Python wrapper over the C++ I/O engine (``torch_fastload._C``).

The engine reads many (file, offset, length) ranges into one caller-owned host buffer on a
persistent thread pool with the GIL released, after bounds-checking every range against its
file and the buffer (an index file is input, and input can be hostile). This module only turns
Python objects (tensors, arrays, paths) into what ``_C`` takes and fills in defaults:

    TORCH_FASTLOAD_NUM_THREADS   threads per call (default 16; config option ``io_threads``)
    TORCH_FASTLOAD_TASK_SIZE     bytes per task, e.g. 4194304, 4M or 4MiB (default 4 MiB; ``io_task_size``)

Errors: ``FileNotFoundError`` / ``IsADirectoryError`` / ``PermissionError`` / ``OSError`` for
files, :class:`RangeError` (a ``ValueError``) for a range outside its file or the buffer, and
:class:`ShortReadError` (a ``RangeError`` and an ``EOFError``) when a file ends early during the
read. Every message names the file, offset and length. A failed call may have written part of
the buffer, but never returns as if it had succeeded.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from . import config

try:
    from . import _C
except ImportError as exc:  # not built: keep the module importable so available() can say so
    _C = None
    _IMPORT_ERROR: ImportError | None = exc

    class RangeError(ValueError):
        """A range lies outside its file or the destination buffer (fallback: _C not built)."""

    class ShortReadError(RangeError, EOFError):
        """A file ended before a range that passed the size check (fallback: _C not built)."""

else:
    _IMPORT_ERROR = None
    RangeError = _C.RangeError
    ShortReadError = _C.ShortReadError

__all__ = [
    "available",
    "read_ranges",
    "DeviceStager",
    "MappedFiles",
    "page_cache_residency",
    "plan_ranges",
    "copy_ranges",
    "pool_size",
    "default_num_threads",
    "default_task_size",
    "RangeError",
    "ShortReadError",
    "DEFAULT_NUM_THREADS",
    "host_register",
    "host_unregister",
    "DEFAULT_TASK_SIZE",
]

DEFAULT_NUM_THREADS = config.OPTIONS["io_threads"].default
DEFAULT_TASK_SIZE = config.OPTIONS["io_task_size"].default
MAX_THREADS = 256  # mirrors tfl::kMaxThreads
_INT64_MAX = np.iinfo(np.int64).max

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def available() -> bool:
    """Whether the C++ extension was built and imports."""
    return _C is not None


def _require() -> Any:
    if _C is None:
        raise ImportError(
            "torch_fastload._C (the C++ I/O engine) is not built: run `pip install -e .` or "
            f"`python setup.py build_ext --inplace` in the torch_fastload checkout ({_IMPORT_ERROR})"
        ) from _IMPORT_ERROR
    return _C


#: CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP: pinned for every context, and
#: addressable from the GPU (the gather kernel reads registered rows where they lie)
_REGISTER_FLAGS = 0x01 | 0x02


def host_register(ptr: int, nbytes: int, device: int | None = None) -> int:
    """Page-lock host memory ``[ptr, ptr + nbytes)`` for the GPU; 0 when done, else the CUDA
    error code. Through the driver where the extension is built: a failed runtime
    ``cudaHostRegister`` stays in the thread's last-error slot, and torch's next kernel-launch
    check raises it as an error of its own (a loader that fell back to the CPU gather after a
    refused registration broke the user's next ``.cpu()``)."""
    import torch

    torch.cuda.init()
    device = torch.cuda.current_device() if device is None else device
    if _C is None:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS))
    return int(_C.host_register(ptr, nbytes, device, _REGISTER_FLAGS))


def host_unregister(ptr: int, device: int | None = None) -> int:
    """Undo ``host_register``; 0 when done, else the CUDA error code (the same last-error care)."""
    import torch

    device = torch.cuda.current_device() if device is None else device
    if _C is None:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))
    return int(_C.host_unregister(ptr, device))


def default_num_threads() -> int:
    """Threads per call: ``config.get("io_threads")`` (``TORCH_FASTLOAD_IO_THREADS``, the doctor's
    tuning file, or 16: reads are I/O bound, not core bound)."""
    return config.get("io_threads")


def default_task_size() -> int:
    """Bytes per task: ``config.get("io_task_size")`` (``TORCH_FASTLOAD_IO_TASK_SIZE``, accepts 4M /
    4MiB; the doctor's tuning file; or 4 MiB)."""
    return config.get("io_task_size")


def _check_threads(value: Any, name: str = "num_threads") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= int(value) <= MAX_THREADS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_THREADS}], got {value!r}")
    return int(value)


def _check_task_size(value: Any, name: str = "task_size") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= int(value) <= _INT64_MAX:
        raise ValueError(f"{name} must be a positive integer byte count, got {value!r}")
    return int(value)


def _int64_array(name: str, values: Any) -> np.ndarray:
    """A 1-D int64 array from a list, numpy array or CPU integer tensor; floats and bools refused."""
    if type(values).__module__.startswith("torch"):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got a tensor on {values.device}")
        values = values.detach().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.max() > _INT64_MAX:
        raise RangeError(f"{name} holds {int(array.max())}, which does not fit in int64")
    return np.ascontiguousarray(array, dtype=np.int64)


def _destination(dst: Any) -> tuple[int, int]:
    """(address, size in bytes) of a writable, contiguous host buffer."""
    if type(dst).__module__.startswith("torch"):
        import torch

        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"dst must be a tensor, ndarray or writable buffer, got {type(dst).__name__}")
        if dst.device.type != "cpu":
            raise ValueError(
                f"dst is on {dst.device}; the engine writes host memory: pass a (pinned) CPU tensor "
                "and copy it to the device, or use kvikio for device memory"
            )
        if dst.layout != torch.strided or not dst.is_contiguous():
            raise ValueError("dst must be a contiguous strided tensor")
        return dst.data_ptr(), dst.numel() * dst.element_size()
    if isinstance(dst, np.ndarray):
        array = dst
    else:
        try:
            view = memoryview(dst)
        except TypeError:
            raise TypeError(f"dst must be a CPU tensor, ndarray or writable buffer, got {type(dst).__name__}") from None
        if view.readonly:
            raise ValueError("dst buffer is read-only")
        if not view.contiguous:
            raise ValueError("dst buffer must be contiguous")
        array = np.frombuffer(view, dtype=np.uint8)
    if not array.flags.writeable:
        raise ValueError("dst array is read-only")
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise ValueError("dst array must be contiguous")
    return array.__array_interface__["data"][0], array.nbytes


def read_ranges(
    paths: PathLike | Sequence[PathLike],
    file_index: Any,
    offsets: Any,
    lengths: Any,
    dst: Any,
    dst_offsets: Any = None,
    *,
    num_threads: int | None = None,
    task_size: int | None = None,
    o_direct: bool = False,
) -> int:
    """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``paths[file_index[i]]`` into ``dst`` at
    ``dst_offsets[i]`` (default: ranges packed back to back), returning the bytes read.

    ``dst`` is a contiguous CPU tensor (pinned or not), ndarray or writable buffer; it must stay
    alive and unresized for the call (the call blocks, so it does). ``file_index=None`` means
    every range is in the one path given. Nothing is read unless every range is in bounds.
    ``o_direct=True`` bypasses the page cache (an ``OSError`` with ``errno.EINVAL`` if the
    filesystem refuses it). Overlapping destination ranges: which write wins is unspecified.
    """
    engine = _require()
    encoded, file_index, offsets, lengths, dst_offsets = _prepare(paths, file_index, offsets, lengths, dst_offsets)
    ptr, size = _destination(dst)
    return engine.read_ranges(
        encoded,
        file_index,
        offsets,
        lengths,
        ptr,
        size,
        dst_offsets,
        num_threads=default_num_threads() if num_threads is None else _check_threads(num_threads),
        task_size=default_task_size() if task_size is None else _check_task_size(task_size),
        o_direct=bool(o_direct),
    )


def plan_ranges(
    paths: PathLike | Sequence[PathLike],
    file_index: Any,
    offsets: Any,
    lengths: Any,
    dst_size: int,
    dst_offsets: Any = None,
    *,
    task_size: int | None = None,
    o_direct: bool = False,
    dst_breaks: Sequence[int] = (),
) -> list:
    """The tasks :func:`read_ranges` would run, as lists of ``(file_index, offset, length,
    dst_offset)`` reads after coalescing and slicing. Same checks (files are opened), no reads.
    ``dst_breaks``: destination offsets where a separate allocation starts (the C++ loop's output
    fields): no read is coalesced across one."""
    engine = _require()
    encoded, file_index, offsets, lengths, dst_offsets = _prepare(paths, file_index, offsets, lengths, dst_offsets)
    return engine.plan_ranges(
        encoded,
        file_index,
        offsets,
        lengths,
        int(dst_size),
        dst_offsets,
        task_size=default_task_size() if task_size is None else _check_task_size(task_size),
        o_direct=bool(o_direct),
        dst_breaks=[int(b) for b in dst_breaks],
    )


class DeviceStager:
    """Reads file ranges into GPU memory through a ring of ``chunks`` pinned chunks that it owns.

    Each engine task preads into a chunk; the copies of ``group_chunks`` chunks read are enqueued
    on the caller's stream together (one ``cuMemcpyBatchAsync``, one event), so a batch costs
    few driver calls, which the training thread's kernel launches would queue behind. A chunk is
    rewritten only once its group's copies have completed. The ring stays small enough to live
    in the CPU's last-level cache, which is what makes this faster than reading a whole batch
    into a pinned slot first (csrc/device_stager.h). ``group_chunks`` None: 4, or
    ``TORCH_FASTLOAD_RING_GROUP``.
    """

    def __init__(self, chunk_bytes: int, chunks: int, group_chunks: int | None = None):
        import torch

        engine = _require()
        chunk_bytes = -(-int(chunk_bytes) // engine.DIRECT_ALIGNMENT) * engine.DIRECT_ALIGNMENT
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if group_chunks is not None and group_chunks < 1:
            raise ValueError(f"group_chunks must be >= 1, got {group_chunks}")
        self.chunk_bytes, self.chunks = chunk_bytes, int(chunks)
        # Page-aligned chunks: O_DIRECT reads land in them without a bounce where ranges align.
        self._ring = torch.empty(chunk_bytes * chunks + engine.DIRECT_ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        start = -self._ring.data_ptr() % engine.DIRECT_ALIGNMENT
        self._stager = engine.DeviceStager(
            self._ring.data_ptr() + start, chunk_bytes * chunks, chunk_bytes, int(group_chunks or 0)
        )
        self.group_chunks = self._stager.group_chunks

    def read(
        self,
        paths,
        file_index,
        offsets,
        lengths,
        dst,
        dst_offsets=None,
        *,
        stream: int,
        num_threads: int | None = None,
        task_size: int | None = None,
        o_direct: bool = False,
        wait_for_chunks: bool = True,
    ) -> int:
        """Like :func:`read_ranges` into ``dst`` (a contiguous CUDA tensor), the copies enqueued on
        ``stream`` (a raw CUDA stream handle); returns once they are enqueued, not finished."""
        if self._stager is None:
            raise ValueError("this DeviceStager is closed")
        if dst.device.type != "cuda" or not dst.is_contiguous():
            raise ValueError(f"dst must be a contiguous CUDA tensor, got one on {dst.device}")
        encoded, file_index, offsets, lengths, dst_offsets = _prepare(paths, file_index, offsets, lengths, dst_offsets)
        return self._stager.read(
            encoded,
            file_index,
            offsets,
            lengths,
            dst.data_ptr(),
            dst.numel() * dst.element_size(),
            dst_offsets,
            int(stream),
            num_threads=default_num_threads() if num_threads is None else _check_threads(num_threads),
            task_size=default_task_size() if task_size is None else _check_task_size(task_size),
            o_direct=bool(o_direct),
            wait_for_chunks=bool(wait_for_chunks),
        )

    @property
    def free_chunks(self) -> int:
        """Chunks no read holds now (copies of theirs may still be in flight)."""
        if self._stager is None:
            raise ValueError("this DeviceStager is closed")
        return self._stager.free_chunks

    def gather_mapped(
        self,
        files: list,
        file_index,
        offsets,
        lengths,
        dst,
        dst_offsets,
        *,
        stream: int,
        function: int,
        piece_bytes: int,
        blocks: int,
    ) -> int:
        """Ranges of registered mappings (``_C.MappedFile``, one per file index) into ``dst``
        (CUDA) by the gather kernel ``function`` launched on ``stream``; returns the bytes."""
        if self._stager is None:
            raise ValueError("this DeviceStager is closed")
        if dst.device.type != "cuda" or not dst.is_contiguous():
            raise ValueError(f"dst must be a contiguous CUDA tensor, got one on {dst.device}")
        _, file_index, offsets, lengths, dst_offsets = _prepare(
            [f.path for f in files] or ["-"], file_index, offsets, lengths, dst_offsets
        )
        return self._stager.gather_mapped(
            files,
            file_index,
            offsets,
            lengths,
            dst.data_ptr(),
            dst.numel() * dst.element_size(),
            dst_offsets,
            int(stream),
            int(function),
            int(piece_bytes),
            int(blocks),
        )

    def close(self, timeout: float = 10.0) -> bool:
        """Wait for copies reading the ring, then free it; False (ring kept alive) on timeout."""
        if self._stager is None:
            return True
        if not self._stager.idle(timeout):
            _LEAKED_RINGS.append((self._stager, self._ring))  # the DMA may still read it
            self._stager = self._ring = None
            return False
        self._stager = self._ring = None
        return True


_LEAKED_RINGS: list = []


def page_cache_residency(path) -> float:
    """Share of ``path``'s pages in the page cache now (1.0 for an empty file)."""
    cached, total = _require().page_cache_residency(os.fsdecode(path))
    return cached / total if total else 1.0


class MappedFiles:
    """Files the GPU copies from directly: mapped read-only and registered with CUDA, so a
    batch's ranges are DMA copies out of the page cache, with no CPU copy at all.

    Registering pins a file's pages in RAM until ``close()``, so a file is mapped only when it
    is already (almost) all resident and fits what is left of ``budget`` bytes; other files
    are read as usual. A file refused for being cold is looked at again after ``recheck_s``.
    """

    def __init__(self, budget: int, min_resident: float = 0.9, recheck_s: float = 10.0):
        self.budget = int(budget)
        self.min_resident = min_resident
        self.recheck_s = recheck_s
        self.pinned_bytes = 0
        self._mapped: dict = {}  # path -> _C.MappedFile
        self._refused: dict = {}  # path -> (monotonic time, reason)
        self._lock = threading.Lock()  # the loader's stage workers read at the same time

    def get(self, path: str):
        """The registered mapping of ``path``, or None where it is not (yet) worth mapping."""
        with self._lock:
            return self._get(path)

    def _get(self, path: str):
        mapped = self._mapped.get(path)
        if mapped is not None:
            return mapped
        refused = self._refused.get(path)
        if refused is not None and (refused[1] == "final" or time.monotonic() - refused[0] < self.recheck_s):
            return None
        reason = self._refusal(path)
        if reason is not None:
            self._refused[path] = (time.monotonic(), reason)
            return None
        try:
            mapped = _require().MappedFile(path)
        except (OSError, ValueError) as exc:  # e.g. read-only registration unsupported: read instead
            warnings.warn(
                f"torch_fastload: could not map {path!r} for direct GPU copies ({exc}); "
                "reading it through the engine instead",
                RuntimeWarning,
                stacklevel=2,
            )
            self._refused[path] = (time.monotonic(), "final")
            return None
        self._mapped[path] = mapped
        self.pinned_bytes += mapped.size
        return mapped

    def _refusal(self, path: str) -> str | None:
        size = os.path.getsize(path)
        if size > self.budget - self.pinned_bytes:
            return "final" if size > self.budget else "over the budget left"
        if page_cache_residency(path) < self.min_resident:
            return "not resident"
        return None

    def close(self) -> None:
        """Unmap and unpin every file; the caller makes sure no copy still reads them."""
        with self._lock:
            self._mapped.clear()
            self.pinned_bytes = 0


def _prepare(paths, file_index, offsets, lengths, dst_offsets):
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    encoded = [os.fsencode(p) for p in paths]
    lengths = _int64_array("lengths", lengths)
    offsets = _int64_array("offsets", offsets)
    if file_index is None:
        if len(encoded) != 1:
            raise ValueError(f"file_index is required with {len(encoded)} paths")
        file_index = np.zeros(len(offsets), dtype=np.int64)
    else:
        file_index = _int64_array("file_index", file_index)
    if dst_offsets is None:
        if len(lengths) and (lengths < 0).any():
            raise RangeError("lengths must be >= 0 to pack ranges back to back (dst_offsets=None)")
        if float(lengths.sum(dtype=np.float64)) >= 2.0**62:  # no buffer is that big; keeps cumsum exact
            raise RangeError(f"lengths add up to {int(lengths.sum(dtype=object))} bytes, more than any buffer")
        dst_offsets = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=dst_offsets[1:])
    else:
        dst_offsets = _int64_array("dst_offsets", dst_offsets)
    return encoded, file_index, offsets, lengths, dst_offsets


def copy_ranges(
    dst_ptrs: Any,
    src_ptrs: Any,
    sizes: Any,
    *,
    num_threads: int | None = None,
    task_size: int | None = None,
) -> int:
    """Parallel ``memcpy(dst_ptrs[i], src_ptrs[i], sizes[i])`` between caller-owned host buffers.

    Addresses are raw (e.g. ``tensor.data_ptr()``): the caller guarantees each range is valid
    and that ranges do not overlap. Returns the bytes copied.
    """
    engine = _require()
    return engine.copy_ranges(
        _int64_array("dst_ptrs", dst_ptrs),
        _int64_array("src_ptrs", src_ptrs),
        _int64_array("sizes", sizes),
        num_threads=default_num_threads() if num_threads is None else _check_threads(num_threads),
        task_size=default_task_size() if task_size is None else _check_task_size(task_size),
    )


def pool_size() -> int:
    """Worker threads in the engine's persistent pool (grows to the largest num_threads - 1)."""
    return int(_require().pool_size())
