"""The source protocol: how a dataset describes whole batches to torch_fastload's DataLoader.

A source is an ordinary map-style ``Dataset`` (``__len__`` and ``__getitem__`` work, so
torch's own DataLoader reads it per sample) that also implements some of these hooks. The
loader looks them up once per iterator (``hooks_of``); a dataset without
``__fastload_batch__`` takes the per-sample path (``__getitem__`` + collate), as with torch.

``__fastload_batch__(indices) -> batch`` (the batch path)
    Called on the loader's fetch thread with one batch's indices, in sampler order. Returns
    what the default collate would return (tuple, list, dict, ...), with each field left as a
    read plan from ``torch_fastload.staging``: ``PendingRead`` (byte ranges of files, read by an
    ``io.Reader`` straight into the pinned slot or GPU memory), ``PendingGather`` (rows of an
    in-memory tensor), ``PendingConcat`` (CPU tensors back to back), ``PendingOffsets`` (int32/
    int64 offsets rebased and widened to int64 as they are written), or a plain CPU tensor
    (copied into the slot). Validate the indices here
    and raise a typed error naming the file; the error reaches the batch's own ``next()``.
    Per-batch randomness comes from ``torch_fastload.resume.batch_key()``, never from a
    generator shared by threads, so a batch is the same whatever thread fetched it.

``__fastload_finish__(batch, device, counts) -> device batch`` (optional)
    With it, the loader reads the batch's ``PendingRead`` fields into a pinned host slot,
    replaces them by host uint8 views of that slot and calls this on a stage thread with the
    loader's copy stream current: the source builds the batch on ``device`` itself (image
    sources decode and augment there). The result must not alias the slot, which is reused once
    the copy stream passes this batch's event; host-to-device copies must be
    ``non_blocking`` from pinned memory. ``counts`` (a dict) gains per-route counters that
    ``loader.stats().decoded`` reports.

``__fastload_slot_bytes__(batch_size) -> int`` (optional)
    An upper bound of one batch's slot bytes, so a source of variable-size batches (packed
    records, images) sizes the pinned pool once instead of growing it batch by batch.

``__fastload_samples__(batch) -> int`` (optional)
    The samples in one of its batches, where the first field's leading dimension is not that
    count (a Parquet batch whose first column is a string: its values are bytes). Counted in
    ``loader.stats()`` and ``state_dict()``'s ``samples_yielded``; without it, that dimension.

``__fastload_direct_cpu__`` (optional attribute, True)
    On the CPU device, the batch's in-memory fields (plain tensors and ``Pending`` fields other
    than ``PendingRead``) are copied once, straight into the batch's own memory, with no
    pageable slot in between (a slot is the pinned side of a device copy; through one, a CPU
    batch is copied twice). No slot pool is made for such batches, so ``slot_bytes`` and
    ``oversize`` do not apply to them. Batches with file reads still go through a slot.

``__fastload_parallel_batches__`` (optional attribute, True)
    ``__fastload_batch__`` may run for several batches at once: with ``fetch_threads > 1`` the
    loader fetches that many batches concurrently on its sample threads (still delivered in
    order). For a source whose batch is mostly waits or GIL-free work (the Parquet source
    waits for row groups to decode); ``resume.batch_key()`` names the batch being fetched.

``__fastload_staged_at_once__`` (optional attribute, int)
    How many of its batches a source's ``__fastload_finish__`` wants staged at once: more than
    the loader's two stage threads where a batch passes serially through several resources on
    its stage thread (an image batch: its header probe, nvJPEG's host call, the CPU decoders,
    the transform kernel), so that each batch's idle phases are another's busy ones. Capped at
    the batches a loader has in flight (``prefetch + 1``); never fewer than two.

``__fastload_delivered__(device, waited_seconds)`` (optional)
    Called by ``next()`` after each batch is handed to the training loop, with how long the
    loop waited for it (the image decoders' route trial times the loop with it). It runs on the
    training thread: keep it to a few microseconds.

``__fastload_bind__(device) -> str | None`` (optional)
    Called once by each iterator before it fetches a batch, with the device its batches go to:
    a source that can produce its fields where the copy to that device reads them in place
    sets it up here (the Parquet source decodes into a pinned arena for a CUDA device). A
    string it returns is added to ``loader.stats().path`` (how it produces them, or why not).

``__fastload_unbind__(device)`` (optional)
    Called once when an iterator that called ``__fastload_bind__`` ends (exhausted, dropped,
    closed): what the source set up for its iterators' run only is undone once the last ends
    (the Parquet source gives pyarrow's CPU pool its size back).

``__fastload_requested__(device)`` (optional)
    Called by ``next()`` as it is entered, on the training thread (the image decoders' route
    trial records a CUDA event there, to see whether the GPU is still running the step). Keep
    it to a few microseconds.

``__fastload_native__() -> NativeLayout | None`` (optional)
    Where every batch is rows of fixed size (in memory or in files) or records listed in an
    in-memory table, the source can describe that layout once instead of per batch: the loader
    then runs the steady state in C++ (``torch_fastload/native.py``): indices in, staged device
    batches out, no Python per batch beyond ``next()``. ``NativeLayout.build`` turns the output
    fields (tensors on the device) into the same batch ``__fastload_batch__`` would give.

``__fastload_collate__(samples) -> batch`` (optional)
    The collate function of this source's samples (ragged records), which torch_fastload's
    DataLoader uses when no ``collate_fn`` is passed (with torch's DataLoader, pass it as
    ``collate_fn``). Only this explicit hook is adopted: an attribute merely named ``collate``
    (an IterDataPipe's functional ``.collate``) is never taken for one, as with torch.

``state_dict()`` / ``load_state_dict(state)`` (optional)
    A state the loader's checkpoint carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = [
    "BatchSource",
    "FinishingSource",
    "SourceHooks",
    "hooks_of",
    "MemoryRows",
    "FileRows",
    "Records",
    "NativeLayout",
]


@runtime_checkable
class BatchSource(Protocol):
    """A dataset whose batches the loader reads whole (see the module docstring)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    def __fastload_batch__(self, indices: Sequence[int]) -> Any: ...


@runtime_checkable
class FinishingSource(BatchSource, Protocol):
    """A batch source that builds its device batch from the slot itself (decode, augment)."""

    def __fastload_finish__(self, batch: Any, device: torch.device, counts: dict) -> Any: ...


@dataclass(frozen=True)
class MemoryRows:
    """Sample ``i`` is row ``i`` of a contiguous CPU tensor."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class FileRows:
    """Sample ``i`` is ``row_shape`` of ``dtype`` at ``offset + i * row bytes`` of ``path``."""

    path: str
    offset: int
    rows: int
    dtype: torch.dtype
    row_shape: tuple
    pin: Any = None  # fileio.FileIdentity as opened: the loop refuses a batch once it changed


@dataclass(frozen=True)
class Records:
    """Sample ``i`` is the bytes ``index[i] = (shard, offset, length)`` of ``paths[shard]``; a
    batch of them is one uint8 slab plus ``n + 1`` int64 offsets (two output fields)."""

    paths: list
    index: Any  # numpy int64 (N, 3), C-contiguous, already checked against the shards
    name: str = "the records"  # what an out-of-range index error names
    pins: Any = None  # per path, fileio.FileIdentity as opened (or None)


@dataclass(frozen=True)
class NativeLayout:
    """What ``__fastload_native__`` returns: the fields of every sample, and how the output
    fields (device tensors, in order; ``Records`` give two) become the batch."""

    fields: tuple
    build: Callable[[list], Any]


@dataclass(frozen=True)
class SourceHooks:
    """The protocol hooks a dataset implements (None where it does not)."""

    batch: Callable[[Sequence[int]], Any] | None = None
    finish: Callable[[Any, torch.device, dict], Any] | None = None
    slot_bytes: Callable[[int], int] | None = None
    delivered: Callable[[torch.device, float], None] | None = None
    requested: Callable[[torch.device], None] | None = None
    native: Callable[[], NativeLayout | None] | None = None
    collate: Callable[[list], Any] | None = None
    direct_cpu: bool = False
    parallel: bool = False  # __fastload_parallel_batches__
    staged_at_once: int = 0  # __fastload_staged_at_once__ (0: the loader's default)
    bind: Callable[[torch.device], str | None] | None = None
    unbind: Callable[[torch.device], None] | None = None
    samples: Callable[[Any], int] | None = None  # __fastload_samples__


def hooks_of(dataset: Any) -> SourceHooks:
    """The hooks ``dataset`` implements, looked up once (never per batch)."""
    return SourceHooks(
        batch=getattr(dataset, "__fastload_batch__", None),
        finish=getattr(dataset, "__fastload_finish__", None),
        slot_bytes=getattr(dataset, "__fastload_slot_bytes__", None),
        delivered=getattr(dataset, "__fastload_delivered__", None),
        requested=getattr(dataset, "__fastload_requested__", None),
        bind=getattr(dataset, "__fastload_bind__", None),
        unbind=getattr(dataset, "__fastload_unbind__", None),
        samples=getattr(dataset, "__fastload_samples__", None),
        native=getattr(dataset, "__fastload_native__", None),
        collate=getattr(dataset, "__fastload_collate__", None),
        direct_cpu=getattr(dataset, "__fastload_direct_cpu__", False) is True,
        parallel=getattr(dataset, "__fastload_parallel_batches__", False) is True,
        staged_at_once=_count(getattr(dataset, "__fastload_staged_at_once__", 0)),
    )


def _count(value) -> int:
    """A source's count attribute: a positive int, or 0 for anything else (ignored)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
