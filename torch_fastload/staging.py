"""Host staging: lay a batch out in a slot and copy it there with several threads.

The pageable -> pinned memcpy is the CPU bottleneck of the sample path (~5-11 GB/s per thread
on the reference machine), so copies are split into chunks across a thread pool. Each chunk
is a ``numpy.copyto`` of two byte views, which releases the GIL and is a plain memcpy.

With the default collate function and in-thread fetching, samples are not stacked into a
fresh pageable tensor first: ``deferred_collate`` marks each tensor field as a
``PendingStack`` and the stager copies every sample straight into its row of the slot.
"""

from __future__ import annotations

import collections.abc
import copy as _copy
import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

__all__ = [
    "Pending",
    "PendingStack",
    "PendingGather",
    "PendingRead",
    "PendingConcat",
    "PendingOffsets",
    "PlannedBatch",
    "materialize",
    "gather_rows",
    "deferred_collate",
    "map_batch",
    "StagingPlan",
    "plan_batch",
    "ParallelCopier",
    "ALIGN",
    "add_direct_region",
    "remove_direct_region",
    "in_direct_region",
    "direct_regions_array",
]

#: Every leaf starts on this boundary inside a slot and inside the device buffer, so typed
#: views are aligned for vectorised kernels.
ALIGN = 256
_MIN_CHUNK = 1 << 20  # below this, splitting a copy costs more than it saves

#: (start, end) of host memory registered with CUDA whose contents never change while a batch
#: copies from it (the Parquet source's decode arena): a batch field lying there goes to the
#: device straight from it, not through the slot (``ParallelCopier.plan_copy(direct=True)``).
_DIRECT_REGIONS: list = []


_DIRECT_ARRAY: tuple = ((), np.zeros(0, dtype=np.int64))  # (the regions, as a flat int64 array)


def add_direct_region(start: int, nbytes: int) -> None:
    """Declare ``[start, start + nbytes)`` readable by the copy engines in place (see above)."""
    if nbytes > 0 and (start, start + nbytes) not in _DIRECT_REGIONS:
        _DIRECT_REGIONS.append((start, start + nbytes))


def remove_direct_region(start: int, nbytes: int) -> None:
    """Undo ``add_direct_region`` (tests; the Parquet arena lives as long as the process)."""
    if (start, start + nbytes) in _DIRECT_REGIONS:
        _DIRECT_REGIONS.remove((start, start + nbytes))


def direct_regions_array() -> np.ndarray:
    """The direct regions as (start, end) pairs, flattened (int64): what ``_C.plan_range`` takes."""
    global _DIRECT_ARRAY
    regions, array = _DIRECT_ARRAY
    if len(regions) != len(_DIRECT_REGIONS) or regions != tuple(_DIRECT_REGIONS):
        regions = tuple(_DIRECT_REGIONS)
        array = np.asarray(regions, dtype=np.int64).reshape(-1)
        _DIRECT_ARRAY = (regions, array)  # one swap: a thread reading it sees either pair whole
    return array


def in_direct_region(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor's memory lies in a direct region (registered with CUDA, reused by
    the loader once its copy ran): handed to user code, it must be copied out first, or a
    ``.to('cuda', non_blocking=True)`` of it would read memory the loader rewrites."""
    return (
        bool(_DIRECT_REGIONS)
        and isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and _in_direct_region(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    )


def _in_direct_region(ptr: int, nbytes: int) -> bool:
    for start, end in _DIRECT_REGIONS:  # a loop, not any(generator): once per field per batch
        if start <= ptr and ptr + nbytes <= end:
            return True
    return False


class Pending:
    """A batch field not materialised in pageable memory: the stager writes it into the slot."""

    __slots__ = ("shape", "dtype")


class PendingStack(Pending):
    """Samples of one field, to be stacked directly into a slot."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.shape = (len(tensors),) + tuple(tensors[0].shape)
        self.dtype = tensors[0].dtype


class PendingGather(Pending):
    """Rows ``index`` of an in-memory tensor, gathered straight into a slot (no per-sample Python)."""

    __slots__ = ("source", "index")

    def __init__(self, source: torch.Tensor, index: torch.Tensor):
        self.source = source
        self.index = index
        self.shape = (len(index),) + tuple(source.shape[1:])
        self.dtype = source.dtype


class PendingConcat(Pending):
    """CPU tensors written back to back into a slot, as ``torch.cat`` would join them: a field
    whose rows come from several in-memory chunks (Arrow row groups) is copied once, never
    joined in pageable memory first."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]):
        if not tensors:
            raise ValueError("a PendingConcat needs at least one tensor")
        first = tensors[0]
        if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or t.device.type != "cpu" for t in tensors):
            raise ValueError("the tensors of a PendingConcat differ in dtype, row shape or device")
        self.tensors = list(tensors)
        self.shape = (sum(len(t) for t in tensors),) + tuple(first.shape[1:])
        self.dtype = first.dtype


class PendingOffsets(Pending):
    """The int64 offsets of a ragged field (strings, lists) whose rows come from several Arrow
    arrays: piece ``i`` is ``sources[i][starts[i] : starts[i] + counts[i]] + shifts[i]``, its
    int32 or int64 values widened and rebased as they are written into the slot (by the
    engine, without the GIL), never joined in pageable memory first. ``sources``: 1-D numpy
    arrays (Arrow's offsets buffers, read only)."""

    __slots__ = ("sources", "starts", "counts", "shifts")

    def __init__(self, sources: list, starts: list, counts: list, shifts: list):
        if not (len(sources) == len(starts) == len(counts) == len(shifts)):
            raise ValueError("sources, starts, counts and shifts of a PendingOffsets differ in length")
        for source, start, count in zip(sources, starts, counts):
            if source.dtype not in (np.int32, np.int64) or source.ndim != 1 or not source.flags.c_contiguous:
                raise ValueError(
                    f"a PendingOffsets source must be a contiguous 1-D int32/int64 array, got {source.dtype}"
                )
            if start < 0 or count < 0 or start + count > len(source):
                raise ValueError(f"offsets [{start}, {start + count}) are outside a source of {len(source)}")
        self.sources, self.starts, self.counts, self.shifts = list(sources), list(starts), list(counts), list(shifts)
        self.shape = (sum(self.counts),)
        self.dtype = torch.int64

    def write_into(self, out: np.ndarray) -> None:
        """The offsets into ``out`` (int64, ``shape``), in numpy."""
        at = 0
        for source, start, count, shift in zip(self.sources, self.starts, self.counts, self.shifts):
            np.add(source[start : start + count], shift, out=out[at : at + count], dtype=np.int64)
            at += count

    def join(self) -> torch.Tensor:
        out = np.empty(self.shape, dtype=np.int64)
        self.write_into(out)
        return torch.from_numpy(out)


class PlannedBatch:
    """A batch whose layout and copies were planned in C++ (``_C.RangePlan``: a Parquet batch of
    consecutive rows): the stager stages it in one call (``CopyEngine.start_planned``) with no
    per-field Python. ``keys``/``dtypes``/``tails``: the batch dict's fields in the plan's order,
    each ``(leading dimension,) + tail`` of ``dtype``; ``keep``: what the plan's source addresses
    point into (held until the batch's copies ran)."""

    __slots__ = ("plan", "keys", "dtypes", "tails", "keep")

    def __init__(self, plan, keys: list, dtypes: list, tails: list, keep: list):
        self.plan, self.keys, self.dtypes, self.tails, self.keep = plan, keys, dtypes, tails, keep

    @property
    def samples(self) -> int:
        return self.plan.rows

    def unpack(self, flat: torch.Tensor) -> dict:
        """The batch dict over ``flat`` (the plan's layout): a slice of one typed view a dtype
        per field, a ``view`` only for fields of 2+ dimensions (NOTE [GIL-free views])."""
        typed: dict = {}
        out = {}
        for key, dtype, tail, (offset, nbytes, rows) in zip(self.keys, self.dtypes, self.tails, self.plan.fields):
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = _typed_view(flat, dtype)
            size = dtype.itemsize
            if base is False or offset % size:
                out[key] = flat[offset : offset + nbytes].view(dtype).view((rows, *tail))
            elif tail:
                start = offset // size
                out[key] = base[start : start + nbytes // size].view((rows, *tail))
            else:
                start = offset // size
                out[key] = base[start : start + rows]
        return out

    def materialize(self, pin_memory: bool = False) -> dict:
        """The batch as CPU tensors: every field written into one new buffer, then viewed."""
        flat = torch.empty(self.plan.total, dtype=torch.uint8, pin_memory=pin_memory)
        self.plan.write_host(flat.data_ptr())
        return self.unpack(flat)


def _joined(field):
    if isinstance(field, PendingConcat):
        return torch.cat(field.tensors)
    return field.join() if isinstance(field, PendingOffsets) else field


def materialize(batch: Any) -> Any:
    """``batch`` with its ``PendingConcat`` and ``PendingOffsets`` fields joined into plain
    tensors (outside the loader); a ``PlannedBatch`` written out as its dict."""
    if isinstance(batch, PlannedBatch):
        return batch.materialize()
    return map_batch(_joined, batch)


class PendingRead(Pending):
    """Byte ranges of files, read by an I/O backend (``io.py``) back to back into the slot.

    Range ``i`` is ``lengths[i]`` bytes at ``offsets[i]`` of ``paths[file_index[i]]``; together
    they fill ``shape`` of ``dtype`` exactly (fixed-size rows, or one ragged uint8 slab).
    ``pins`` (one ``fileio.FileIdentity`` or None per path): the files as the source opened
    them; the reader refuses the batch (``FileChangedError``) where one has changed since.
    """

    __slots__ = ("paths", "file_index", "offsets", "lengths", "pins")

    def __init__(self, paths, offsets, lengths, shape: tuple, dtype: torch.dtype, file_index=None, pins=None):
        self.paths = [paths] if isinstance(paths, (str, bytes, os.PathLike)) else list(paths)
        self.pins = None if pins is None else list(pins)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.lengths = (
            np.full(len(self.offsets), lengths, dtype=np.int64)
            if np.isscalar(lengths)
            else np.ascontiguousarray(lengths, dtype=np.int64)
        )
        self.file_index = (
            np.zeros(len(self.offsets), dtype=np.int64)
            if file_index is None
            else np.ascontiguousarray(file_index, dtype=np.int64)
        )
        self.shape = tuple(shape)
        self.dtype = dtype
        if not (len(self.lengths) == len(self.offsets) == len(self.file_index)):
            raise ValueError("offsets, lengths and file_index of a PendingRead differ in length")
        if self.pins is not None and len(self.pins) != len(self.paths):
            raise ValueError("a PendingRead needs one pin (or None) per path")
        if int(self.lengths.sum()) != _nbytes(self.shape, dtype):
            raise ValueError(f"ranges of {int(self.lengths.sum())} bytes cannot fill shape {self.shape} of {dtype}")


def gather_rows(tensors: tuple, indices) -> list:
    """A TensorDataset batch as PendingGathers; indices checked like ``tensor[i]`` would."""
    length = len(tensors[0])
    index = torch.as_tensor(indices, dtype=torch.int64)
    index = torch.where(index < 0, index + length, index)
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= length):
        bad = [i for i in indices if not -length <= i < length]
        raise IndexError(f"index {bad[0]} is out of range for a TensorDataset of {length} samples")
    return [PendingGather(tensor, index) for tensor in tensors]  # a list, as default_collate gives


def _stackable(batch: list[torch.Tensor]) -> bool:
    first = batch[0]
    if first.layout != torch.strided or first.is_nested or first.device.type != "cpu":
        return False
    return all(
        t.shape == first.shape and t.dtype == first.dtype and t.device == first.device and t.layout == torch.strided
        for t in batch
    )


def _defer_tensors(batch, *, collate_fn_map=None):
    if _stackable(batch):
        return PendingStack(list(batch))
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's result or error


_DEFERRED_MAP = dict(default_collate_fn_map)
_DEFERRED_MAP[torch.Tensor] = _defer_tensors


def deferred_collate(batch):
    """``default_collate`` with tensor fields left as ``PendingStack`` for the stager."""
    return collate(batch, collate_fn_map=_DEFERRED_MAP)


def pending_reads(data: Any) -> list:
    """Every ``PendingRead`` field of a nested batch, in ``map_batch``'s order (nothing rebuilt)."""
    found: list = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, PendingRead):
            found.append(item)
        elif isinstance(item, collections.abc.Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, collections.abc.Sequence) and not isinstance(item, (str, bytes)):
            stack.extend(reversed(list(item)))
    return found


def map_batch(fn: Callable[[Any], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor / Pending field in a nested batch, keeping container types.

    Mirrors ``torch.utils.data._utils.pin_memory.pin_memory`` so batches come out shaped
    exactly as torch's DataLoader would hand them over.
    """
    if isinstance(data, (torch.Tensor, Pending)):
        return fn(data)
    kind = type(data)
    if kind is dict:  # the usual batch: the same result as below, without the ABC checks and copy
        return {k: map_batch(fn, v) for k, v in data.items()}
    if kind is list or kind is tuple:
        return kind([map_batch(fn, v) for v in data])
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = _copy.copy(data)
                clone.update({k: map_batch(fn, v) for k, v in data.items()})
                return clone
            return type(data)({k: map_batch(fn, v) for k, v in data.items()})
        except TypeError:
            return {k: map_batch(fn, v) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_batch(fn, v) for v in data))
    if isinstance(data, tuple):
        return tuple(map_batch(fn, v) for v in data)
    if isinstance(data, collections.abc.Sequence):
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone = _copy.copy(data)
                for i, item in enumerate(data):
                    clone[i] = map_batch(fn, item)
                return clone
            return type(data)([map_batch(fn, v) for v in data])
        except TypeError:
            return [map_batch(fn, v) for v in data]
    return data


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass
class _Leaf:
    shape: tuple
    dtype: torch.dtype
    offset: int
    nbytes: int
    source: Any  # a CPU tensor or a Pending field


@dataclass
class StagingPlan:
    """Where each tensor of a batch goes inside a slot; the batch itself keeps its structure."""

    batch: Any
    leaves: list  # _Leaf for staged tensors, None for tensors passed through as they are
    total_bytes: int  # span of the slot used, alignment padding included
    samples: int

    @property
    def payload_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves if leaf is not None)

    def copy_list(self) -> list[tuple[int, Any]]:
        """(byte offset in the slot, source tensor or PendingGather) for every staged field or row."""
        items = []
        for leaf in self.leaves:
            if leaf is None:
                continue
            if isinstance(leaf.source, PendingStack):
                row = leaf.nbytes // max(1, len(leaf.source.tensors))
                items.extend((leaf.offset + i * row, sample) for i, sample in enumerate(leaf.source.tensors))
            elif isinstance(leaf.source, PendingConcat):
                offset = leaf.offset
                for piece in leaf.source.tensors:
                    items.append((offset, piece))
                    offset += _nbytes(piece.shape, piece.dtype)
            else:
                items.append((leaf.offset, leaf.source))
        return items

    def unpack(self, flat: torch.Tensor, passthrough: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """The batch with staged tensors replaced by typed views of ``flat`` (slot layout).

        NOTE [GIL-free views]: torch's ``view``/``narrow`` release the GIL and queue for it
        again; beside a thread running Python (the training loop) each such call waits up to
        the 5 ms switch interval, so 30 fields x 2 views cost a stage thread ~0.5 s on the GPU
        machine. Slicing (``t[a:b]``, ``t[i]``) keeps the GIL: each field is a slice of one
        typed view of ``flat`` per dtype, and only fields of 2+ dimensions take a ``view``."""
        leaves = iter(self.leaves)
        typed: dict = {}  # dtype -> flat as that dtype (one view per dtype of the batch)

        def rebuild(item):
            leaf = next(leaves)
            if leaf is None:
                return passthrough(item)
            base = typed.get(leaf.dtype)
            if base is None:
                base = typed[leaf.dtype] = _typed_view(flat, leaf.dtype)
            size = leaf.dtype.itemsize
            if base is False or leaf.offset % size:
                view = flat[leaf.offset : leaf.offset + leaf.nbytes]
                return view.view(leaf.dtype).view(leaf.shape)
            start = leaf.offset // size
            if len(leaf.shape) == 1:
                return base[start : start + leaf.shape[0]]
            if not leaf.shape:
                return base[start]
            return base[start : start + leaf.nbytes // size].view(leaf.shape)

        return map_batch(rebuild, self.batch)


def _typed_view(flat: torch.Tensor, dtype: torch.dtype):
    """``flat`` (uint8, 1-D) as ``dtype`` over its whole length rounded down to the item size,
    or False where torch cannot view it so (a storage offset not aligned to the item size)."""
    if dtype == flat.dtype:
        return flat
    usable = flat.numel() - flat.numel() % dtype.itemsize
    try:
        return flat[:usable].view(dtype)
    except RuntimeError:
        return False


def plan_batch(batch: Any, collated: bool = True) -> StagingPlan:
    """Lay out every CPU tensor of ``batch`` at ALIGN-ed offsets of one contiguous buffer.

    ``samples`` is the first tensor's leading dimension for collated batches; for items
    passed through as they are (``batch_size=None``) only when that tensor has rows (>= 2-D).
    """
    leaves: list = []
    cursor = 0
    samples = -1

    def visit(item):
        nonlocal cursor, samples
        if isinstance(item, Pending):
            shape, dtype = item.shape, item.dtype
            nbytes = _nbytes(shape, dtype)
        elif item.is_cpu and item.layout is torch.strided and not item.is_nested:  # the cheapest checks
            shape, dtype, nbytes = item.shape, item.dtype, item.nbytes
        else:
            leaves.append(None)
            return item
        if samples < 0:
            samples = shape[0] if len(shape) >= (1 if collated else 2) else 1
        cursor = -(-cursor // ALIGN) * ALIGN
        leaves.append(_Leaf(shape, dtype, cursor, nbytes, item))
        cursor += nbytes
        return item

    map_batch(visit, batch)
    return StagingPlan(batch, leaves, cursor, max(samples, 0))


def _byte_view(tensor: torch.Tensor) -> np.ndarray | None:
    """A flat uint8 numpy view of a contiguous CPU tensor, or None where none exists."""
    if not _plain_contiguous(tensor):
        return None
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def _plain_contiguous(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


@dataclass
class CopyPlan:
    """A batch's copies into a slot, sorted by how they run (``ParallelCopier.plan_copy``)."""

    total: int  # bytes the copies write
    threads: int
    contiguous: list  # (offset, tensor, bytes): pointer copies
    offsets: list  # (offset, PendingOffsets): rebased into the slot
    fallback: list  # (offset, source): copied by torch
    native: tuple | None = None  # (copy arrays, rebase arrays, direct arrays or None) for the C++ engine
    direct: list = dataclasses.field(default_factory=list)  # (offset, tensor, bytes): to the device from where they lie
    task_bytes: int = 2 * _MIN_CHUNK  # the C++ copies' task size


class ParallelCopier:
    """Copies tensors into byte offsets of a CPU buffer with ``num_threads`` threads, GIL released.

    Uses the C++ engine's ``copy_ranges`` (one call per batch, raw pointers) where it is built,
    else a thread pool of ``numpy.copyto`` calls. Strided sources go through ``Tensor.copy_``.
    """

    def __init__(self, num_threads: int, nontemporal: bool = True):
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self.nontemporal = nontemporal
        self.native = _native_copy is not None
        self._executor = None
        if not self.native and num_threads > 1:
            self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="fastload-copy")

    def copy_into(self, dst: torch.Tensor, items: list[tuple[int, Any]], threads: int | None = None) -> int:
        """Copy each source (tensor or PendingGather) to ``dst[offset:]``; returns the bytes copied.

        ``PendingRead`` fields are not copied here: an I/O backend (``io.Reader``) reads them."""
        plan = self.plan_copy(dst, items, threads)
        if plan.native is not None:
            copies, rebase, _ = plan.native  # (no direct fields: plan_copy's default)
            if len(copies[0]):
                _native_copy(*copies, plan.threads, plan.task_bytes, self.nontemporal)
            if rebase[0]:
                _native_rebase(*rebase, plan.threads)
        else:
            self._numpy_copy(dst, plan.contiguous, plan.total, plan.threads)
            if plan.offsets:
                self._rebase(dst, plan.offsets)
        self.copy_fallback(dst, plan)
        return plan.total

    def plan_copy(
        self, dst: torch.Tensor, items: list[tuple[int, Any]], threads: int | None = None, direct: bool = False
    ) -> CopyPlan:
        """What ``copy_into`` does, checked and laid out: with the C++ engine, pointer arrays for
        one ``copy_ranges`` and one ``rebase_offsets`` call (``CopyPlan.native``), which the
        copy engine may also run in one call with the device copy (``stage_host_batch``).
        ``direct``: fields lying in a direct region (``add_direct_region``) are left out of
        the slot and listed in ``CopyPlan.direct``, for that call to copy to the device from
        where they lie (only that call can: nothing else reads ``direct``)."""
        capacity = dst.numel()
        total = 0
        contiguous, gathers, fallback, offsets, in_place = [], [], [], [], []
        direct = direct and self.native and bool(_DIRECT_REGIONS)
        for offset, src in items:
            nbytes = src.nbytes if isinstance(src, torch.Tensor) else _nbytes(src.shape, src.dtype)
            if offset < 0 or offset + nbytes > capacity:
                raise ValueError(
                    f"staging range [{offset}, {offset + nbytes}) is outside the {capacity}-byte destination"
                )
            if not nbytes or isinstance(src, PendingRead):
                continue
            total += nbytes
            if isinstance(src, PendingOffsets):
                offsets.append((offset, src))
            elif isinstance(src, PendingGather):
                (
                    gathers
                    if self.native and _plain_contiguous(src.source) and src.source.device.type == "cpu"
                    else fallback
                ).append((offset, src))
            elif not src.is_cpu or not _plain_contiguous(src):
                fallback.append((offset, src))
            elif direct and _in_direct_region(src.data_ptr(), nbytes):
                in_place.append((offset, src, nbytes))
                total -= nbytes
            else:
                contiguous.append((offset, src, nbytes))
        threads = min(threads or self.num_threads, self.num_threads)
        plan = CopyPlan(total, threads, contiguous, offsets, fallback, direct=in_place)
        if self.native and (_native_rebase is not None or not offsets):
            plan.native = (
                self._copy_arrays(dst.data_ptr(), contiguous, gathers),
                self._rebase_arrays(dst.data_ptr(), offsets),
                self._direct_arrays(in_place) if in_place else None,
            )
        else:
            if in_place:  # no one-call stage to take them: into the slot like the rest
                plan.contiguous.extend(in_place)
                plan.total += sum(n for _, _, n in in_place)
                plan.direct = []
            if gathers:  # no engine (or no rebase in it): gathered rows go through torch
                plan.fallback.extend(gathers)
        return plan

    def copy_fallback(self, dst: torch.Tensor, plan: CopyPlan) -> None:
        """The sources no pointer copy can take (strided, on another device): torch copies them."""
        for offset, src in plan.fallback:
            view = dst[offset : offset + _nbytes(src.shape, src.dtype)]
            view = view.view(src.dtype).view(src.shape)
            if isinstance(src, PendingGather):
                torch.index_select(src.source, 0, src.index, out=view)
            else:
                view.copy_(src)

    @staticmethod
    def _copy_arrays(base: int, contiguous: list, gathers: list) -> tuple:
        """(dst, src, sizes) int64 arrays of one ``copy_ranges`` call for the whole batch;
        gathered rows become pointer arrays, not Python."""
        dst_parts, src_parts, size_parts = [], [], []
        if contiguous:
            dst_parts.append(np.fromiter((base + off for off, _, _ in contiguous), np.int64, len(contiguous)))
            src_parts.append(np.fromiter((src.data_ptr() for _, src, _ in contiguous), np.int64, len(contiguous)))
            size_parts.append(np.fromiter((n for _, _, n in contiguous), np.int64, len(contiguous)))
        for offset, gather in gathers:
            rows = len(gather.index)
            row_bytes = _nbytes(gather.shape[1:], gather.dtype)
            src_parts.append(gather.source.data_ptr() + gather.index.numpy() * row_bytes)
            dst_parts.append(base + offset + np.arange(rows, dtype=np.int64) * row_bytes)
            size_parts.append(np.full(rows, row_bytes, dtype=np.int64))
        if not dst_parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(dst_parts), np.concatenate(src_parts), np.concatenate(size_parts)

    @staticmethod
    def _direct_arrays(fields: list) -> tuple:
        """(batch offsets, source pointers, sizes) int64 arrays of the fields copied in place."""
        count = len(fields)
        return (
            np.fromiter((off for off, _, _ in fields), np.int64, count),
            np.fromiter((src.data_ptr() for _, src, _ in fields), np.int64, count),
            np.fromiter((n for _, _, n in fields), np.int64, count),
        )

    @staticmethod
    def _rebase_arrays(base: int, fields: list) -> tuple:
        """(dst, src, counts, shifts, widths) of one ``rebase_offsets`` call: every
        ``PendingOffsets`` field widened and rebased into the slot."""
        dsts, srcs, counts, shifts, widths = [], [], [], [], []
        for offset, field in fields:
            at = base + offset
            for source, start, count, shift in zip(field.sources, field.starts, field.counts, field.shifts):
                dsts.append(at)
                srcs.append(source.ctypes.data + start * source.itemsize)
                counts.append(count)
                shifts.append(shift)
                widths.append(source.itemsize)
                at += 8 * count
        return dsts, srcs, counts, shifts, widths

    def _rebase(self, dst: torch.Tensor, fields: list) -> None:
        """Every ``PendingOffsets`` field widened and rebased into ``dst`` with numpy (no engine)."""
        flat = dst.numpy()
        for offset, field in fields:
            field.write_into(flat[offset : offset + 8 * field.shape[0]].view(np.int64))

    def _numpy_copy(self, dst: torch.Tensor, contiguous: list, total: int, threads: int) -> None:
        dst_np = dst.numpy()
        pieces = []
        per_thread = max(_MIN_CHUNK, -(-total // threads))
        for offset, src, nbytes in contiguous:
            src_np = _byte_view(src)
            for start in range(0, nbytes, per_thread):
                end = min(start + per_thread, nbytes)
                pieces.append((dst_np[offset + start : offset + end], src_np[start:end]))
        if self._executor is None or total < 2 * _MIN_CHUNK:
            _copy_list(pieces)
            return
        work: list[list] = [[] for _ in range(threads)]
        loads = [0] * threads
        for piece in pieces:
            lightest = loads.index(min(loads))
            work[lightest].append(piece)
            loads[lightest] += len(piece[1])
        for future in [self._executor.submit(_copy_list, items) for items in work if items]:
            future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _copy_list(items: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst_np, src_np in items:
        np.copyto(dst_np, src_np)


try:
    from ._C import copy_ranges as _native_copy
except ImportError:  # running from a source tree without the built extension
    _native_copy = None
try:
    from ._C import rebase_offsets as _native_rebase
except ImportError:  # an extension built before rebase_offsets, or none
    _native_rebase = None
