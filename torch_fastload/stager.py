"""Staging one batch: plan -> slot -> read/copy -> host fields -> the device copy, started.

``BatchStager.stage(number, batch)`` runs on a stage thread. It lays the batch out
(``staging.plan_batch``), takes a pinned slot, reads the batch's file fields (into the slot,
or straight into device memory when the read path goes there), copies its pageable fields into
the slot, and enqueues the slot -> device copy on the loader's stream, returning without
waiting for it. A source with ``__fastload_finish__`` builds its device batch from the slot
itself instead (image decode). Either way the slot goes back to the pool with the event after
its last copy: it is reused only once that event completed (rule of the pool).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import PoolError
from .remote.url import is_url
from .resources import LoaderResources
from .staging import ALIGN, PendingRead, PlannedBatch, pending_reads, plan_batch
from .transfer import InFlightCopy

__all__ = ["BatchStager", "StagedBatch"]

#: Fields copied to the device from where they lie are held with the slot until its copy ran
#: (tests set False: the negative control shows the arena reused under a pending copy).
KEEP_DIRECT_SOURCES = True
#: Bytes of one copy task of a planned batch's host copies (``copy_ranges``' task size).
PLANNED_TASK_BYTES = 2 << 20


@dataclass
class StagedBatch:
    """A batch whose device copy is in flight; ``next()`` hands ``copy.batch`` over."""

    copy: InFlightCopy
    samples: int
    nbytes: int


class BatchStager:
    """Stages batches of one iterator into the loader's shared resources."""

    def __init__(
        self,
        resources: LoaderResources,
        *,
        collated: bool,
        stop,
        poll: float,
        finish: Callable[[Any, torch.device, dict], Any] | None = None,
        slot_bytes_bound: Callable[[], int] | None = None,
        consumer=None,
        copy_threads: int | None = None,
        direct_cpu: bool = False,
        samples: Callable[[Any], int] | None = None,
    ):
        self.resources = resources
        self.collated = collated
        self.stop = stop
        self.poll = poll
        self.finish = finish
        self.slot_bytes_bound = slot_bytes_bound
        self.consumer = consumer  # the training loop's stream: batches are handed to it
        self.copy_threads = copy_threads  # memcpy threads per batch (None: the copier's own)
        self.direct_cpu = direct_cpu and not resources.engine.is_cuda  # the source's __fastload_direct_cpu__
        self.samples_of = samples  # the source's __fastload_samples__ (None: the first field's rows)
        self.engine = resources.engine
        self.copier = resources.copier
        self.stats = resources.stats

    def stage(self, number: int, batch: Any) -> StagedBatch:
        """Stage batch ``number`` and start its copy to the device (see the module docstring)."""
        if isinstance(batch, PlannedBatch):
            samples = batch.samples
        else:
            samples = int(self.samples_of(batch)) if self.samples_of is not None else None
        staged = self._stage(number, batch)
        if samples is not None:
            staged.samples = samples
        return staged

    def _stage(self, number: int, batch: Any) -> StagedBatch:
        if isinstance(batch, PlannedBatch):
            if self.finish is None and self.engine.plans_in_one_call:
                return self._stage_planned(number, batch)
            if self.finish is None and self.direct_cpu:
                return self._stage_planned_cpu(batch)
            batch = batch.materialize()  # an engine without the one-call stage: the generic route
        if self.finish is not None:
            return self._stage_and_finish(number, batch)
        return self._stage_and_copy(number, batch)

    def read_ahead(self, batch: Any) -> tuple[int, int]:
        """Request a fetched batch's remote ranges now, before its turn to be staged (the
        fetch thread, ``remote/ahead.py``); only for a dataset that reads URLs.
        Returns ``(bytes started, the read-ahead budget)``."""
        if not self.resources.settings.remote:  # the dataset names no URL: nothing to walk
            return 0, 0
        reads = [read for read in pending_reads(batch) if read.lengths.any()]
        if not reads or not any(is_url(p) for read in reads for p in read.paths):
            return 0, 0
        reader = self.resources.slot_reader() if self.finish is not None else self.resources.file_reader()
        path = reader.path
        started = reader.read_ahead(reads, owner=self)
        if reader.path is not path:  # the first remote object: the path now says how they are read
            self.stats.set_io(str(reader.path))
        return started

    def cancel_read_ahead(self) -> None:
        """Drop this iterator's read-ahead not taken by a stage (it is shutting down)."""
        for reader in self.resources.readers():
            reader.cancel_read_ahead(self)

    def _slot_hint(self) -> int:
        """A source's bound of a batch's slot bytes, where file fields land in the slot."""
        if self.slot_bytes_bound is None or (self.finish is None and self.resources.reads_to_device):
            return 0
        return int(self.slot_bytes_bound())

    def _acquire_slot(self, nbytes: int, number: int):
        while True:
            pool = self.resources.pool_for(nbytes, number, self._slot_hint())
            try:
                return pool, pool.acquire(self.stop, poll=self.poll)
            except PoolError:
                if pool.closed and not self.stop.is_set():
                    continue  # another iterator re-sized the shared pool meanwhile
                raise

    def _read(self, reader, buffer: torch.Tensor, reads: list) -> None:
        started = time.perf_counter()
        path = reader.path
        by_path = reader.read(buffer, reads)
        self.stats.add_stage("read", time.perf_counter() - started, sum(by_path.values()))
        self.stats.add_io(by_path)
        if reader.path is not path:  # the first remote object: the path now says how they are read
            self.stats.set_io(str(reader.path))

    def _stage_and_finish(self, number: int, batch) -> StagedBatch:
        """Read the batch's files into a slot, then let the source build the device batch from
        it (``__fastload_finish__``: decode + augment) on the copy stream. The slot returns to
        the pool once everything enqueued on the stream so far has completed."""
        plan = plan_batch(batch, collated=True)
        items = plan.copy_list()
        reads = [(offset, src) for offset, src in items if isinstance(src, PendingRead)]
        reader = self.resources.slot_reader()
        pool, slot = self._acquire_slot(plan.total_bytes, number)
        copy = None
        try:
            self._read(reader, slot.buffer, reads)
            self.copier.copy_into(slot.buffer, [item for item in items if not isinstance(item[1], PendingRead)])
            host = plan.unpack(slot.buffer[: plan.total_bytes], lambda tensor: tensor)
            counts: dict = {}
            started = time.perf_counter()
            copy = self.engine.run(lambda: self.finish(host, self.resources.device, counts))
            self.stats.add_stage("decode", time.perf_counter() - started)
            self.stats.add_decoded(counts)
        finally:
            pool.release(slot, copy.done if copy is not None else self.engine.fence())
        return StagedBatch(copy, _leading_dim(copy.batch), plan.payload_bytes)

    def _stage_and_copy(self, number: int, batch) -> StagedBatch:
        """File fields read and pageable fields copied into a slot, one H2D copy of the slot;
        or, where the read path goes to the device, file fields read there directly and only
        the other fields staged (packed into the slot)."""
        plan = plan_batch(batch, collated=self.collated)
        items = plan.copy_list()
        # zero-byte reads (rows of shape (0,): an (N, 0) .npy) have nothing to read and need no slot
        reads = [(offset, src) for offset, src in items if isinstance(src, PendingRead) and src.lengths.any()]
        items = [(offset, src) for offset, src in items if not isinstance(src, PendingRead) or src.lengths.any()]
        if self.direct_cpu and not reads:
            return self._stage_direct(plan, items)
        reader = self.resources.file_reader() if reads else None
        to_device = reader is not None and reader.path.to_device
        if to_device:  # file fields go straight to the device; the slot holds the rest, packed
            host, copies, host_bytes = _pack_host_fields(items)
        else:
            host, copies, host_bytes = items, None, plan.total_bytes
        moved: list = []

        def unpack(flat: torch.Tensor):
            return plan.unpack(flat, lambda tensor: self.engine.move_passthrough(tensor, moved))

        def read_into_device(buffer: torch.Tensor) -> None:
            self._read(reader, buffer, reads)

        reserved = self.engine.reserve(plan.total_bytes, self.consumer)
        pool = slot = copy = host_plan = None
        if host_bytes:
            acquiring = time.perf_counter()
            pool, slot = self._acquire_slot(host_bytes, number)
            self.stats.mark("stage:slot", number, acquiring)
        try:
            if reads and not to_device:
                self._read(reader, slot.buffer, reads)
            span = slot.buffer[:host_bytes] if slot is not None else None
            if slot is not None and not to_device and self.engine.stages_in_one_call and all(plan.leaves):
                host_plan = self.copier.plan_copy(slot.buffer, host, self.copy_threads, direct=True)
                if host_plan.native is None:
                    host_plan = None
            if host_plan is not None:  # the copies, the rebase and the device copy in one call
                started = time.perf_counter()
                self.copier.copy_fallback(slot.buffer, host_plan)
                copy = self.engine.start_staged(
                    span,
                    unpack,
                    host_plan,
                    nontemporal=self.copier.nontemporal,
                    consumer=self.consumer,
                    reserved=reserved,
                )
                self.stats.add_stage("stage", time.perf_counter() - started, host_plan.total)
                self.stats.mark("stage:start-copy", number, started)
            else:
                if slot is not None:
                    started = time.perf_counter()
                    staged = self.copier.copy_into(slot.buffer, host, self.copy_threads)
                    self.stats.add_stage("stage", time.perf_counter() - started, staged)
                fill = read_into_device if to_device else None
                starting = time.perf_counter()
                copy = self.engine.start(
                    span,
                    unpack,
                    nbytes=plan.total_bytes,
                    copies=copies,
                    fill=fill,
                    consumer=self.consumer,
                    reserved=reserved,
                )
                self.stats.mark("stage:start-copy", number, starting)
        finally:
            if slot is not None:
                # a one-call stage that failed may have enqueued its device copy: the slot then
                # waits for everything on the copy stream (a fence) before its reuse
                one_call_failed = copy is None and host_plan is not None
                in_place = host_plan.direct if host_plan is not None else None
                pool.release(
                    slot,
                    copy.done if copy is not None else (self.engine.fence() if one_call_failed else None),
                    # fields copied from where they lie stay alive as long as the slot's wait
                    keep=[src for _, src, _ in in_place] if in_place and KEEP_DIRECT_SOURCES else None,
                )
        copy.moved = moved
        on_stream = plan.payload_bytes if not to_device or reader.copies_on_stream else sum(n for _, _, n in copies)
        self.resources.copy_timer.add(copy, on_stream)
        return StagedBatch(copy, plan.samples, plan.payload_bytes)

    def _stage_planned(self, number: int, batch: PlannedBatch) -> StagedBatch:
        """A batch planned in C++ (``PlannedBatch``): a slot, then one call copies its pageable
        fields and rebased offsets into the slot and the slot and its fields lying in direct
        regions to the device. No per-field Python on this thread."""
        plan = batch.plan
        reserved = self.engine.reserve(plan.total, self.consumer)
        acquiring = time.perf_counter()
        pool, slot = self._acquire_slot(plan.total, number)
        self.stats.mark("stage:slot", number, acquiring)
        copy = None
        try:
            started = time.perf_counter()
            copy = self.engine.start_planned(
                slot.buffer,
                batch,
                threads=min(self.copy_threads or self.copier.num_threads, self.copier.num_threads),
                task_bytes=PLANNED_TASK_BYTES,
                nontemporal=self.copier.nontemporal,
                consumer=self.consumer,
                reserved=reserved,
            )
            self.stats.add_stage("stage", time.perf_counter() - started, plan.total - plan.direct_bytes)
            self.stats.mark("stage:start-copy", number, started)
        finally:
            # a failed call may have enqueued its device copy: the slot then waits for the stream;
            # the memory its direct fields lie in stays alive until its copy ran
            pool.release(
                slot,
                copy.done if copy is not None else self.engine.fence(),
                keep=[batch.keep] if plan.direct_bytes and KEEP_DIRECT_SOURCES else None,
            )
        self.resources.copy_timer.add(copy, plan.payload)
        return StagedBatch(copy, batch.samples, plan.payload)

    def _stage_planned_cpu(self, batch: PlannedBatch) -> StagedBatch:
        """A planned batch for the CPU device: written once, straight into its own memory."""
        started = time.perf_counter()
        flat = torch.empty(batch.plan.total, dtype=torch.uint8, pin_memory=self.engine.pin_cpu_output)
        written = batch.plan.write_host(flat.data_ptr(), self.copy_threads or self.copier.num_threads)
        self.stats.add_stage("stage", time.perf_counter() - started, written)
        copy = InFlightCopy(flat, batch.unpack(flat), None, None)
        self.resources.copy_timer.add(copy, 0)
        return StagedBatch(copy, batch.samples, batch.plan.payload)

    def _stage_direct(self, plan, items: list) -> StagedBatch:
        """The CPU device, a source with ``__fastload_direct_cpu__``: its in-memory fields are
        copied once, straight into the batch's own memory. Through a slot they were copied
        twice (into the slot, then out of it into fresh memory): the slot is there for the
        pinned device copy, and a CPU batch has none."""
        started = time.perf_counter()
        flat = torch.empty(plan.total_bytes, dtype=torch.uint8, pin_memory=self.engine.pin_cpu_output)
        staged = self.copier.copy_into(flat, items, self.copy_threads)
        self.stats.add_stage("stage", time.perf_counter() - started, staged)
        copy = InFlightCopy(flat, plan.unpack(flat, lambda tensor: tensor), None, None)
        self.resources.copy_timer.add(copy, 0)
        return StagedBatch(copy, plan.samples, plan.payload_bytes)


def _pack_host_fields(items: list) -> tuple[list, list, int]:
    """The non-file fields of a batch packed into a slot: ``(slot items, (slot offset, batch
    offset, bytes) copies, slot bytes)``; file fields are read straight into the device."""
    host, copies, cursor = [], [], 0
    for offset, src in items:
        if isinstance(src, PendingRead):
            continue
        nbytes = math.prod(src.shape) * src.dtype.itemsize
        cursor = -(-cursor // ALIGN) * ALIGN
        host.append((cursor, src))
        copies.append((cursor, offset, nbytes))
        cursor += nbytes
    return host, copies, cursor


def _leading_dim(batch) -> int:
    """Samples in a finished batch: the first tensor's (or list's) length."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return len(first) if isinstance(first, (torch.Tensor, list)) else 1
