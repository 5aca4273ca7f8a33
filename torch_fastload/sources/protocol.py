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
    in-memory tensor), or a plain CPU tensor (copied into the slot). Validate the indices here
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

``__fastload_delivered__(device, waited_seconds)`` (optional)
    Called by ``next()`` after each batch is handed to the training loop, with how long the
    loop waited for it (the image decoders' route trial times the loop with it). It runs on the
    training thread: keep it to a few microseconds.

``collate(samples)`` and ``state_dict()`` / ``load_state_dict(state)`` (optional)
    torch's collate function for this source's samples (ragged records), used only for
    torch_fastload's own sources; and a state the loader's checkpoint carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = ["BatchSource", "FinishingSource", "SourceHooks", "hooks_of"]


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
class SourceHooks:
    """The protocol hooks a dataset implements (None where it does not)."""

    batch: Callable[[Sequence[int]], Any] | None = None
    finish: Callable[[Any, torch.device, dict], Any] | None = None
    slot_bytes: Callable[[int], int] | None = None
    delivered: Callable[[torch.device, float], None] | None = None


def hooks_of(dataset: Any) -> SourceHooks:
    """The hooks ``dataset`` implements, looked up once (never per batch)."""
    return SourceHooks(
        batch=getattr(dataset, "__fastload_batch__", None),
        finish=getattr(dataset, "__fastload_finish__", None),
        slot_bytes=getattr(dataset, "__fastload_slot_bytes__", None),
        delivered=getattr(dataset, "__fastload_delivered__", None),
    )
