"""The steady state in C++: indices in, staged batches out, no pipeline thread holding the GIL.

The Python pipeline (``pipeline.py``) spends a few hundred microseconds of Python per batch on
its fetch and stage threads. Beside a training thread that is bound by its own kernel launches,
every one of those GIL holds delays the step. Where a loader's batches are planned (a
``TensorDataset`` with the default collate, or a source with ``__fastload_native__``:
``ArrayDataset``, ``RecordDataset``), an iterator runs on ``_C.NativeLoop`` instead:

- ``next()`` on the training thread takes the oldest batch (the consumer's stream waits on its
  copies' event; its output tensors, one per field, become the batch). About one call in
  ``allocate_ahead`` (8) then pulls the next group's indices (int64 slices of the epoch's order
  where torch's sampler is drawn in bulk, ``sampling.py``), allocates their outputs on the copy
  stream (one block a field with ``output_blocks='group'``) and submits the group in one call:
  p50 ~45 us of host time a batch inside a real training loop on the H200 host;
- the loop's C++ workers validate the indices, gather in-memory rows into a pinned slot, read
  file rows and records through the pinned ring or straight out of registered page cache, enqueue
  the H2D copies and record the batch's event, all without the GIL.

An epoch that runs to its end leaves its loop to the loader's next epoch (``keep_loop``,
``_ParkedLoop``). Batches, errors (the k-th ``next()`` raises batch k's, later batches still
arrive), exact resume and shutdown behave as on the Python pipeline; ``config.native = 'off'``
selects that instead.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from . import config, engine, fileio, uva
from .errors import LoaderShutdownError, capture, wrap
from .fetch import InThreadSource
from .pipeline import LIVE_PIPELINES, STAGE_THREADS
from .remote.epoch import CACHE_PATH_NOTE, local_paths
from .remote.url import is_url
from .resources import LoaderResources
from .resume import EpochProgress
from .sampling import OrderPass
from .sources.protocol import FileRows, MemoryRows, NativeLayout, Records, SourceHooks
from .transfer import raw_current_stream

__all__ = ["native_layout", "NativePipeline"]

_MEMORY_ROWS, _FILE_ROWS, _RECORDS = 0, 1, 2


class _PoolBusy(Exception):
    """Another iterator of the loader holds pinned slots: this one runs on the Python pipeline."""


_LEAKED_LOOPS: list = []  # loops whose copies outlived stop(): kept so the memory they read stays valid
#: Tests only: slots are rewritten without waiting for their last copy (proves the wait matters).
UNSAFE_SLOT_REUSE = False
#: Tests only: the copies skip their wait for the output's stream to be done with the memory the
#: caching allocator recycled for the batch (proves the wait matters).
UNSAFE_SKIP_ALLOCATION_WAIT = False
#: Tests only: next() hands copy-stream outputs over without record_stream (the allocator may then
#: give their memory to the next batch's copies while the training stream still reads it).
UNSAFE_SKIP_HANDOVER = False
#: Tests only: each batch first sleeps a random 0..N microseconds (batches finish out of order).
DEBUG_JITTER_US = 0
#: Tests only: no started batch notifies an idle worker (each is found by the workers' periodic
#: look at the queue; the control of that look runs on a loop of its own, tests/test_native.py).
DEBUG_LOSE_WAKEUPS = False
#: Benchmarks only (the before of an A/B): a group's submit wakes every idle worker of the loop
#: itself, instead of one that wakes the next as it takes its batch.
WAKE_ALL = False
#: Benchmarks' and tests' control (the before of an A/B): the loop's workers enqueue each batch's
#: copies as soon as they are ready, not in the batches' order (an epoch's second batch was then
#: queued behind later ones on the H200: the GPU idle ~1-1.8 ms an epoch, benchmarks/gpu/edge_gpu_gap.py).
ORDERED_COPIES = True
#: The turn thread (config ``turn_thread``) sleeps this long after the batches in flight ran low,
#: before it asks for the GIL: the training thread's take() has just let go of it and is taking
#: it back, and the turn should wait for the step's own release (its backward()).
TURN_SETTLE_US = 50
#: The turn thread's longest wait for the next group (it is woken by take() and by the loop's stop).
TURN_WAIT_S = 1.0
#: In-memory rows at least this long are copied by the copy engines out of the dataset's own
#: (registered) pages; shorter ones are gathered by the CPU into a pinned slot, where one DMA per
#: row would cost more than it saves.
DMA_MIN_ROW_BYTES = 16 << 10
#: An epoch shorter than the route trial's batches (``CopyRouteChoice``) hands its count on to the
#: loader's next epoch; off (tests' control), each epoch starts the trial over and a loader whose
#: epochs hold fewer than ~32 batches never leaves the copy engines.
ROUTE_TRIAL_ACROSS_EPOCHS = True
#: Where the route is left to 'auto', rows and records shorter than this (on average) go by the
#: gather kernel from the first batch: one DMA copy each never reaches the link's rate on short
#: ranges (hot .npy, 48 MiB batches, the loader alone, H100, benchmarks/gpu/mapped_routes.py:
#: 4 KiB rows 4.0 GB/s by DMA against 14.6 by the kernel, 16 KiB 12.1 against 35.6; 64 KiB 49.5
#: against 47.1, 192 KiB 50.8 against 48.1).
KERNEL_BELOW_BYTES = 64 << 10
#: The most device memory a group of planned batches (``allocate_ahead``) holds.
GROUP_BYTES = 256 << 20
#: A loop whose pinned slots are at most this large (the gather kernel's range tables, record
#: offsets, small gathered rows) gets one slot per batch in flight, not ``pool_slots``: with three,
#: its workers polled the copy stream's events ~10 times a batch to reuse them
#: (benchmarks/gpu/launch_cpu_probe.py COUNT=1), and with copy_enqueue='next' a batch next() waits
#: for could find every slot held by later batches whose copies next() had not yet enqueued.
SMALL_SLOT_BYTES = 1 << 20


def native_layout(loader, source, hooks: SourceHooks, resources: LoaderResources) -> NativeLayout | None:
    """The layout the C++ loop can run this iterator on, or None (the Python pipeline runs it)."""
    if resources.settings.native == "off" or not engine.available() or not isinstance(source, InThreadSource):
        return None
    if hooks.batch is None or hooks.finish is not None or loader.batch_size is None:
        return None
    dataset = loader.dataset
    if isinstance(dataset, tud.TensorDataset):
        tensors = dataset.tensors
        if not all(t.is_contiguous() and not t.is_conj() and not t.is_neg() for t in tensors):
            return None
        return NativeLayout(tuple(MemoryRows(t) for t in tensors), list)
    layout = hooks.native() if hooks.native is not None else None
    if layout is None or (resources.settings.remote and _names_urls(layout)):
        return None  # uncached s3:// and http(s):// objects: the Python pipeline's remote reader
    if any(not isinstance(f, MemoryRows) for f in layout.fields):
        io = resources.io
        usable = io.mode in ("engine-posix", "engine-odirect") and (resources.device.type == "cpu" or io.ring_chunks)
        if not usable:
            return None  # kvikio / GDS / pinned modes: the Python pipeline's readers
    return layout


def _names_urls(layout: NativeLayout) -> bool:
    paths = [p for f in layout.fields for p in ([f.path] if isinstance(f, FileRows) else getattr(f, "paths", []))]
    return any(is_url(p) for p in paths)


def _cache_layout(layout: NativeLayout | None, cached: dict | None) -> NativeLayout | None:
    """``layout`` with its URLs replaced by their shard cache entries; None where one has none."""
    if layout is None:
        return None
    fields = []
    for f in layout.fields:
        if isinstance(f, FileRows):
            paths = local_paths([f.path], cached)
            f = dataclasses.replace(f, path=paths[0]) if paths else None
        elif isinstance(f, Records):
            paths = local_paths(f.paths, cached)
            f = dataclasses.replace(f, paths=paths) if paths else None
        if f is None:
            return None
        fields.append(f)
    return dataclasses.replace(layout, fields=tuple(fields))


@dataclass
class _Batch:
    """A submitted batch: its place, its epoch number, its output and layout."""

    position: int
    number: int
    samples: int
    layout: list
    out: list | None  # one tensor per output field
    home: int | None = None  # the stream ``out`` was allocated on
    indices: Any = None  # the samples (which of many pinned shards the batch read)
    shared: _SharedBlocks | None = None  # ``out`` are views of these blocks (``output_blocks='group'``)


#: Each batch's view in a group block starts on this boundary, as the caching allocator's own
#: blocks do (kernels that vectorise their loads keep their fast path).
BLOCK_ALIGN = 512


def _pitch(nbytes: int, dtype: torch.dtype) -> int:
    """Elements from one batch's view to the next in a group block: ``nbytes`` rounded up to
    ``BLOCK_ALIGN``."""
    return max(1, -(-nbytes // BLOCK_ALIGN)) * BLOCK_ALIGN // dtype.itemsize


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(1, size)
    return tuple(reversed(strides))


class _GroupRecipe:
    """How a group of ``count`` batches of one plan lies in its blocks, worked out once: each
    block's ``(shape, dtype)``, each field's ``as_strided`` arguments (batch k at k pitches)."""

    __slots__ = ("blocks", "views", "pitch_bytes")

    def __init__(self, shapes: tuple[list, list], count: int):
        pitches = [_pitch(nbytes, dtype) for (_, dtype), nbytes in zip(shapes[0], shapes[1])]
        self.blocks = [((count * pitch,), dtype) for (_, dtype), pitch in zip(shapes[0], pitches)]
        self.views = [
            ((count, *shape), (pitch, *_contiguous_strides(shape))) for (shape, _), pitch in zip(shapes[0], pitches)
        ]
        self.pitch_bytes = [pitch * dtype.itemsize for (_, dtype), pitch in zip(shapes[0], pitches)]


class _SharedBlocks:
    """One device block a field for a group of batches, and the consumer streams it was handed
    to (``record_stream`` once a stream: the allocator then records one event a block at its free)."""

    __slots__ = ("blocks", "pitch_bytes", "recorded")

    def __init__(self, blocks: list, pitch_bytes: list):
        self.blocks = blocks
        self.pitch_bytes = pitch_bytes
        self.recorded: set = set()


class NativePipeline:
    """One iterator on ``_C.NativeLoop`` (the same interface as ``pipeline.Pipeline``)."""

    def __init__(
        self,
        loader,
        source,
        progress: EpochProgress,
        resources: LoaderResources,
        layout: NativeLayout,
        hooks: SourceHooks,
    ):
        self.loader = loader  # kept alive while the loop runs: its close() frees the resources
        self.source = source
        self.progress = progress
        self.resources = resources
        self.device = resources.device
        self.cuda = self.device.type == "cuda"
        self.build = layout.build
        self.on_delivered = hooks.delivered
        self.on_requested = hooks.requested
        self.stats = resources.stats
        self.timeout = loader.timeout
        self.stop = threading.Event()
        self.poll = config.get("poll_interval")
        self.depth = loader.prefetch + STAGE_THREADS
        self.finished = False
        self._lock = threading.Lock()
        self._inflight: deque = deque()
        self._next_position = 0
        self._exhausted = False
        self._fatal = None
        self._synced: dict = {}
        self._plans: dict | None = None  # batch size -> (layout, output plan), where indices do not change it
        self._requested = False
        self._device_index = (
            (self.device.index if self.device.index is not None else torch.cuda.current_device()) if self.cuda else 0
        )
        self._pin_output = self.device.type == "cpu" and resources.settings.pin_cpu_output
        self.engine = resources.engine
        self._copy_stream = self.engine.stream.cuda_stream if self.cuda else 0
        self._ahead = config.get("allocate_ahead")
        self._group_blocks = config.get("output_blocks") == "group"
        self._recipes: dict = {}  # (plan's shapes, group size) -> _GroupRecipe; the plans live as long
        self._held = None  # indices drawn for a group but of another size: the next group's first
        self._order_pass: OrderPass | None = None  # the epoch's order drawn in bulk (_start)
        self._turn_lock = threading.Lock()  # a group's turn, on the turn thread or in next()
        self._turns: _TurnWorker | None = None  # config turn_thread: the loop's turn thread, bound by _start
        self._turns_over = False  # under _turn_lock: the turn thread takes no more turns
        self._orphaned: list = []  # outputs of a group whose submit failed midway: kept until stop()
        # registered in-memory rows moved by the gather kernel (a few SMs) instead of the copy
        # engines, whose per-row DMA submissions hold the driver beside a launch-bound step
        self._memory_rows_kernel = (
            self.cuda and resources.settings.memory_rows in ("kernel", "auto") and uva.available()
        )
        # bytes of the shortest registered rows / file rows or mean record (None: no such field)
        self._shortest = {"rows": None, "files": None}
        self._rows_note = ""  # how they go, where chosen before this iterator
        tensor_dataset = isinstance(loader.dataset, tud.TensorDataset)
        fields, self._paths, self._specs, self._keep, host_row_bytes, records = self._describe(layout, tensor_dataset)
        self._pins = _FilePins(layout)
        io = resources.io if self._paths else None
        ring = resources.file_reader().stager if (io is not None and self.cuda) else None
        rows_kernel = self._memory_rows_kernel
        mapped_kernel = ring is not None and resources.settings.mapped_copy in ("kernel", "auto")
        gather = int(uva.kernel_handle(self.device)) if (rows_kernel or mapped_kernel) and uva.available() else 0
        if mapped_kernel and gather:  # the gather launch's table: a file range a sample takes 24 bytes of slot
            host_row_bytes += 24 * sum(1 for f in fields if f[0] in (_FILE_ROWS, _RECORDS))
        slot_bytes = self._slot_bytes(loader.batch_size, host_row_bytes, records)
        settings = (  # the loop's arguments but its slots (which slot_bytes sizes)
            STAGE_THREADS,
            resources.settings.stage_threads,
            io.threads if io is not None else 1,
            io.task_size if io is not None else 4 << 20,
            io is not None and io.mode == "engine-odirect",
            resources.settings.nontemporal,
            ring._stager if ring is not None else None,
            gather,
            uva.PIECE,
            uva.blocks(),
            UNSAFE_SLOT_REUSE,
            DEBUG_JITTER_US,
            rows_kernel and gather != 0,
            UNSAFE_SKIP_ALLOCATION_WAIT,
            DEBUG_LOSE_WAKEUPS,
        )
        timing_every = config.get("copy_timing_every")
        copies_on_consumer = config.get("copy_enqueue") == "next"
        controls = (WAKE_ALL, ORDERED_COPIES, copies_on_consumer)
        self._key = (tuple(fields), tuple(self._paths), self._copy_stream, slot_bytes, settings, timing_every, controls)
        self._keep_loop = config.get("keep_loop")
        parked = resources.adopt(self._key) if self._keep_loop else None
        if parked is not None:  # the loader's last epoch's loop: its workers, slots and plans
            self.loop, self._slots, self._next_position = parked.loop, parked.slots, parked.next_position
            self._plans, self._recipes, self._synced = parked.plans, parked.recipes, parked.synced
            self._turns = parked.turns  # its turn thread, waiting for this epoch (or None)
            self._loop_keep = parked.keep  # what its fields were made with (this epoch's: the same addresses)
        else:
            self._loop_keep = self._keep
            resources.close_parked()  # keep_loop off: its slots back to the pool before the lease
            self._slots = self._lease_slots(slot_bytes)
            pool, slots = self._slots if self._slots else (None, [])
            try:
                self.loop = engine._require().NativeLoop(
                    fields,
                    self._paths,
                    self.cuda,
                    self._copy_stream,
                    slots[0].buffer.data_ptr() if slots else 0,
                    pool.slot_bytes if slots else 0,
                    len(slots),
                    *settings,
                    copy_timing_every=timing_every,
                    wake_all=WAKE_ALL,
                    ordered_copies=ORDERED_COPIES,
                    copies_on_consumer=copies_on_consumer,
                )
            except BaseException:  # no copy ever read the slots
                _settle(None, True, None, self._slots, [], self.engine)
                raise
            if not records:
                self._plans = {}
        self._copy_route = None
        try:
            self._start(resources, source, io, rows_kernel and gather != 0, mapped_kernel, gather != 0)
        except BaseException:  # an iter() that raises leaves no loop running and no slot leased
            self.shutdown()
            raise

    def _start(self, resources: LoaderResources, source, io, rows_kernel: bool, mapped_kernel: bool, gather: bool):
        """The routes, the epoch's index arrays, the stats' path, and the first batches submitted."""
        mapped = self._map_files(resources) and mapped_kernel
        self._copy_route = self._choose_copy_route(rows_kernel, mapped and gather)
        self._order_pass = _order_pass(source)
        self._index_arrays = self._order_pass.arrays() if self._order_pass is not None else None
        self.stats.path = f"native loop -> {self.device}{self._rows_note}"
        if resources.registration_declined:
            self.stats.path += f" (a tensor not pinned in place: {resources.registration_declined})"
        if io is not None and resources.settings.remote:  # every URL is read from its cache entry
            self.stats.path += " (remote objects from the shard cache)"
            io = dataclasses.replace(io, remote=CACHE_PATH_NOTE)
        if self._paths:
            self.stats.set_io(str(io) if io is not None else "")
        LIVE_PIPELINES.add(self)
        self._fill(self._consumer_stream())
        if not self._wants_turn_thread():
            if self._turns is not None:  # adopted, but turns are off now
                self._turns.close(config.get("shutdown_timeout"))
                self._turns = None
        elif not self._exhausted:
            if self._turns is None:
                self._turns = _TurnWorker(self.loop)
            self._turns.bind(self, self.depth)

    def _wants_turn_thread(self) -> bool:
        """config turn_thread: 'auto' for CUDA outputs allocated on the copy stream (the turns need
        their own stream to run beside the training thread's), True for host outputs too."""
        mode = config.get("turn_thread")
        if self._plans is None or mode is False:
            return False
        if self.cuda:
            return self.engine.output_stream == "copy"
        return mode is True

    def _take_turn(self) -> bool:
        """The turn thread's group: allocate and submit until ``depth`` batches are in flight.
        False once the epoch has no more (or the pipeline stops): the thread then waits for the
        next epoch's pipeline."""
        with self._turn_lock:
            if self._turns_over or self.stop.is_set() or self._exhausted or self._fatal is not None:
                return False
            try:
                self._fill(self._copy_stream)  # home: the copy stream (or the host) wherever turns run here
            except BaseException:  # next() raises it once the batches already submitted are taken
                self._fatal = capture("turn thread (allocate and submit)")
                return False
            return not self._exhausted and self._fatal is None

    def _stop_turns(self) -> None:
        """No more turns of this epoch on the turn thread (the one in progress ends first); the
        thread itself stays with the loop (``_TurnWorker``)."""
        with self._turn_lock:
            self._turns_over = True
        if self._turns is not None:
            self._turns.unbind(self)

    # -- set-up ---------------------------------------------------------------------------
    def _describe(self, layout: NativeLayout, tensor_dataset: bool):
        """``(C fields, paths, output specs, objects to keep alive, in-memory bytes per sample,
        record fields)``; output specs are ``(dtype, row shape, rows beyond the batch's)``, None
        for a record slab."""
        fields, paths, specs, keep = [], [], [], []
        host_row_bytes, records = 0, 0
        for f in layout.fields:
            if isinstance(f, MemoryRows):
                t = f.tensor
                row_bytes = t[0].numel() * t.element_size() if len(t) else 0
                what = f"a TensorDataset of {len(t)} samples" if tensor_dataset else f"a tensor of {len(t)} rows"
                message = f"index {{}} is out of range for {what}"
                dma = (
                    self.cuda
                    and row_bytes >= DMA_MIN_ROW_BYTES
                    and self.resources.settings.memory_rows in ("auto", "dma", "kernel")
                    and self.resources.register_host(t)
                )
                if dma:
                    self._note_range("rows", row_bytes)
                fields.append((_MEMORY_ROWS, len(t), row_bytes, t.data_ptr(), -1, 0, 0, message, dma))
                specs.append((t.dtype, tuple(t.shape[1:]), 0))
                keep.append(t)
                # a row the gather kernel moves costs its (offset, length, destination) in the slot
                host_row_bytes += (24 if self._memory_rows_kernel else 0) if dma else row_bytes
            elif isinstance(f, FileRows):
                row_bytes = int(np.prod(f.row_shape, dtype=np.int64)) * f.dtype.itemsize
                paths.append(f.path)
                what = f"index {{}} is out of range for {f.path} ({f.rows} rows)"
                fields.append((_FILE_ROWS, f.rows, row_bytes, 0, len(paths) - 1, f.offset, 0, what, False))
                self._note_range("files", row_bytes)
                specs.append((f.dtype, tuple(f.row_shape), 0))
            elif isinstance(f, Records):
                index = np.ascontiguousarray(f.index, dtype=np.int64)
                base = len(paths)
                paths.extend(f.paths)
                if len(index) and base:  # shard numbers are relative to this field's paths
                    index = index.copy()
                    index[:, 0] += base
                what = f"record index {{}} is out of range for {f.name} ({len(index)} records)"
                fields.append((_RECORDS, len(index), 0, 0, -1, 0, index.ctypes.data, what, False))
                specs.extend([None, (torch.int64, (), 1)])  # the slab; n + 1 offsets
                keep.append(index)
                records += 1
                self._note_range("files", float(index[:, 2].mean()) if len(index) else 0)
            else:
                raise TypeError(f"not a native layout field: {f!r}")
        return fields, paths, specs, keep, host_row_bytes, records

    def _note_range(self, kind: str, nbytes: float) -> None:
        shortest = self._shortest[kind]
        self._shortest[kind] = nbytes if shortest is None else min(shortest, nbytes)

    def _slot_bytes(self, batch_size: int, host_row_bytes: int, records: int) -> int | None:
        """Bytes of the pinned slot the loop packs a batch's in-memory fields into (CUDA only;
        None where it needs none)."""
        if not self.cuda or not (host_row_bytes or records):
            return None
        return batch_size * host_row_bytes + records * (batch_size + 1) * 8 + 256 * (len(self._specs) + 1)

    def _lease_slots(self, nbytes: int | None):
        """All the pool's pinned slots of at least ``nbytes`` for this loop's life; given back
        with the event after their last copy."""
        if nbytes is None:
            return None
        small = max(nbytes, self.resources.settings.slot_bytes or 0) <= SMALL_SLOT_BYTES
        # one for each batch in flight: depth, and a group submitted when one fewer were
        pool = self.resources.pool_for(nbytes, 0, slots=self.depth + self._ahead if small else 0)
        slots = pool.lease_all(self.stop, poll=self.poll)
        if slots is None:
            raise _PoolBusy
        return pool, slots

    def _choose_copy_route(self, rows_capable: bool, mapped_capable: bool) -> CopyRouteChoice | None:
        """How registered in-memory rows and ranges of mapped files reach the GPU: by the gather
        kernel or the copy engines as ``memory_rows`` / ``mapped_copy`` say; for each left to
        'auto', the choice an earlier epoch of this loader made, else a ``CopyRouteChoice`` that
        makes it on this epoch's first batches (copy engines meanwhile)."""
        settings = self.resources.settings
        targets, notes = [], []
        rows_capable = rows_capable and self._shortest["rows"] is not None
        for what, kind, capable, mode, set_kernel in (
            ("registered rows", "rows", rows_capable, settings.memory_rows, self.loop.set_rows_kernel),
            ("mapped files", "files", mapped_capable, settings.mapped_copy, self.loop.set_mapped_kernel),
        ):
            if not capable or mode not in ("kernel", "auto"):
                continue
            short = mode == "auto" and (self._shortest[kind] or 0) < KERNEL_BELOW_BYTES
            chosen = "kernel" if mode == "kernel" or short else self.resources.copy_route
            if chosen is None:
                targets.append((what, set_kernel))
                continue
            set_kernel(chosen == "kernel")
            notes.append(f"{what}: {'gather kernel' if chosen == 'kernel' else 'copy engines'}")
        self._rows_note = f" ({', '.join(notes)})" if notes else ""
        if not targets:
            return None
        trial = self.resources.copy_route_trial if ROUTE_TRIAL_ACROSS_EPOCHS else None
        if trial is not None and trial.names == [what for what, _ in targets]:
            trial.rebind(self.loop, targets, self.stats)  # an earlier epoch ended before it chose
        else:
            trial = CopyRouteChoice(self.loop, targets, self.device, self.resources, self.stats)
            self.resources.copy_route_trial = trial
        return trial

    def _map_files(self, resources: LoaderResources) -> bool:
        """Files already resident in the page cache (within map_budget) are copied from it;
        True if any is."""
        reader = resources.file_reader() if (self._paths and self.cuda) else None
        mapped = getattr(reader, "mapped", None)
        if mapped is None:
            return False
        any_mapped = False
        for i, path in enumerate(self._paths):
            m = mapped.get(path)
            self.loop.set_mapped(i, m)  # None too: a kept loop may hold a mapping since dropped
            any_mapped = any_mapped or m is not None
        return any_mapped

    # -- the training thread's side -----------------------------------------------------------
    def _fill(self, stream: int = 0) -> None:
        """Submit batches until ``depth`` are in flight: indices from the sampler and one output
        tensor per field, allocated on the copy stream (config ``output_stream``; next() hands
        them to ``stream`` with record_stream) or on ``stream`` itself (the loop's copies then
        first wait for that stream's work up to the allocation). Batches of a planned size go
        ``allocate_ahead`` at a time (``_submit_group``): one allocation, one C++ call and one
        wake-up of the loop's workers for them all, on one next() in allocate_ahead or so."""
        home = self._copy_stream if (self.cuda and self.engine.output_stream == "copy") else stream
        while not self._exhausted and self._fatal is None and len(self._inflight) < self.depth:
            run, plan = self._full_batches()
            if run is not None:  # a group of full batches, one slice of the drawn order
                self._submit_group(run, plan, home)
                continue
            indices = self._next_indices()
            if indices is None:
                return
            n = len(indices)
            plan = self._plans.get(n) if self._plans is not None else None
            if plan is None and self._plans is not None:  # fixed-size rows: one plan per batch size
                layout = self.loop.row_layout(n)
                plan = self._plans[n] = (layout, self._output_plan(n, layout))
                self._submit_group([indices], plan, home)  # a size met once (a short last batch) goes alone
            elif plan is not None:
                self._submit_group(self._same_size(indices, self._group_size(plan)), plan, home)
            else:  # records: the sizes depend on the indices
                position, number = self._claim()
                layout = self.loop.submit(position, indices)
                outs = None
                if layout[0] >= 0:
                    shapes = self._output_plan(n, layout)
                    outs = self._allocate(shapes, home)
                    self.loop.start_fields(position, [t.data_ptr() for t in outs], shapes[1], home)
                self._inflight.append(_Batch(position, number, n, layout, outs, home, indices))

    def _next_indices(self):
        """The next batch's indices (None at the epoch's end, or with the sampler's error kept)."""
        if self._held is not None:
            indices, self._held = self._held, None
            return indices
        try:
            return next(self._index_arrays) if self._index_arrays is not None else self.source._next_index()
        except StopIteration:
            self._exhausted = True
        except Exception:
            self._fatal = capture("fetch (sampler)")
        return None

    def _full_batches(self) -> tuple:
        """``(rows, plan)``: the next group's indices as rows of one array, where the order was
        drawn in bulk and the batch size's plan is known (else ``(None, None)``: ``_next_indices``
        draws batch by batch)."""
        if self._order_pass is None or self._held is not None or not self._plans:
            return None, None
        plan = self._plans.get(self._order_pass.batch_size)
        if plan is None:
            return None, None
        return self._order_pass.full_batches(self._group_size(plan)), plan

    def _same_size(self, first, count: int) -> list:
        """``first`` and up to ``count - 1`` more batches of its size (one of another size, an
        epoch's last, is held back for the next group)."""
        group = [first]
        while len(group) < count and not self._exhausted and self._fatal is None:
            indices = self._next_indices()
            if indices is None:
                break
            if len(indices) != len(first):
                self._held = indices
                break
            group.append(indices)
        return group

    def _group_size(self, plan) -> int:
        """Batches of one size a group holds: ``allocate_ahead``, at most ``GROUP_BYTES`` of outputs."""
        return max(1, min(self._ahead, GROUP_BYTES // max(1, sum(plan[1][1]))))

    def _claim(self) -> tuple[int, int]:
        """The next batch's place in the loop and its number in the epoch."""
        position, self._next_position = self._next_position, self._next_position + 1
        return position, self.progress.next_number()

    def _claim_group(self, count: int) -> list:
        """``_claim()`` for the next ``count`` batches."""
        first, self._next_position = self._next_position, self._next_position + count
        return list(zip(range(first, first + count), self.progress.next_numbers(count)))

    def _submit_group(self, group: list, plan, home: int) -> None:
        """Allocate and submit ``group`` (index arrays of one planned size) in one C++ call."""
        layout, shapes = plan
        count, n = len(group), len(group[0])
        claimed = self._claim_group(count)
        outs, shared = self._allocate_group(shapes, home, count)
        if count == 1:
            got = self.loop.submit_fields(claimed[0][0], group[0], [t.data_ptr() for t in outs[0]], shapes[1], home)
            totals = [got[0]]
        else:
            if isinstance(group, np.ndarray):  # (count, n) rows of the drawn order
                indices = group.reshape(-1)
            else:
                indices = np.concatenate(group) if isinstance(group[0], np.ndarray) else [i for g in group for i in g]
            try:
                if shared is not None:  # each field's block and pitch: the loop works out the addresses
                    bases = [block.data_ptr() for block in shared.blocks]
                    totals = self.loop.submit_group(
                        claimed[0][0], indices, count, bases, shapes[1], home, pitches=shared.pitch_bytes
                    )
                else:
                    pointers = [t.data_ptr() for b in outs for t in b]
                    totals = self.loop.submit_group(claimed[0][0], indices, count, pointers, shapes[1], home)
            except BaseException:  # batches started before the failure write these until stop()
                self._orphaned.append(outs)
                raise
        for (position, number), indices, total, batch in zip(claimed, group, totals, outs):
            if total < 0:  # bad indices: take() raises this batch's error
                self._inflight.append(_Batch(position, number, n, [-1], None, home, indices))
            else:
                self._inflight.append(_Batch(position, number, n, layout, batch, home, indices, shared))

    def _allocate_group(self, shapes: tuple[list, list], home: int, count: int) -> tuple[list, Any]:
        """``count`` batches' output tensors (a list of one list per batch), in one call where
        they are allocated on the copy stream (each call is a stream switch and back, 25-40 us of
        the training thread's next() beside a launch-bound step, H100 and H200); with
        ``output_blocks='group'`` views of one block a field, and the blocks (else None)."""
        if not (self.cuda and home == self._copy_stream):
            return [self._allocate(shapes, home) for _ in range(count)], None
        if self._group_blocks and count > 1:  # a field of the whole group in one block: views of it
            return self._group_views(shapes, count, lambda blocks: self.engine.allocate_on(self.engine.stream, blocks))
        fields = len(shapes[0])
        tensors = self.engine.allocate_on(self.engine.stream, shapes[0] * count)
        return [tensors[k : k + fields] for k in range(0, len(tensors), fields)], None

    def _group_views(self, shapes: tuple[list, list], count: int, allocate: Callable[[list], list]) -> tuple:
        """``count`` batches' tensors as views of one block a field (``allocate``: a list of
        ``(shape, dtype)`` -> one tensor each), and the blocks."""
        recipe = self._recipes.get((id(shapes), count))
        if recipe is None:  # per plan and group size: the blocks' shapes, each field's view
            recipe = self._recipes[(id(shapes), count)] = _GroupRecipe(shapes, count)
        blocks = allocate(recipe.blocks)
        views = [block.as_strided(*view).unbind(0) for block, view in zip(blocks, recipe.views)]
        return [list(batch) for batch in zip(*views)], _SharedBlocks(blocks, recipe.pitch_bytes)

    def _output_plan(self, n: int, layout) -> tuple[list, list]:
        """``([(shape, dtype) per output field], [bytes per output field])`` of an n-sample batch."""
        fields, sizes = [], []
        for k, spec in enumerate(self._specs):
            nbytes = layout[2 + 2 * k]
            fields.append(((nbytes,), torch.uint8) if spec is None else ((n + spec[2], *spec[1]), spec[0]))
            sizes.append(nbytes)
        return fields, sizes

    def _allocate(self, shapes: tuple[list, list], home: int) -> list:
        """The batch's output tensors on stream ``home``: each field is its own tensor, as
        torch's collate makes them (keeping one field, say the labels, does not keep the others'
        memory alive)."""
        if not self.cuda:
            return [torch.empty(shape, dtype=dtype, pin_memory=self._pin_output) for shape, dtype in shapes[0]]
        if home == self._copy_stream:
            return self.engine.allocate_on(self.engine.stream, shapes[0])
        device = self.device
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes[0]]

    def next(self) -> Any:
        if self.finished:
            raise StopIteration
        stats = self.stats
        started = time.perf_counter()
        if not self._requested:
            self._requested = True
            stats.request_started()
        if self.on_requested is not None:
            self.on_requested(self.device)
        if self._copy_route is not None:
            self._copy_route.requested()
        if not self._inflight and self._turns is not None:
            with self._turn_lock:  # the turn thread is behind (or done): this group's turn here
                self._fill(self._copy_stream)
        if not self._inflight:
            if self._fatal is not None:
                self.shutdown()
                self._fatal.reraise()
            self.progress.finished = True
            self._end_epoch()
            raise StopIteration
        batch = self._inflight.popleft()
        stream = raw_current_stream(self._device_index) if self.cuda else 0
        try:
            try:
                if not self.loop.take(batch.position, stream, self.poll):  # not staged yet: wait
                    self._take(batch.position, stream)
            except Exception as exc:  # a file that changed explains a short or out-of-range read
                if self._pins.active:
                    self._pins.check(batch.indices, exc)
                raise
            if self._pins.active:
                self._pins.check(batch.indices)  # after the read: a file replaced before or during it
        except Exception as exc:
            self.progress.yielded(batch.number, 0)  # a failed batch is spent too: it is raised
            stats.add_error()
            if self._turns is None:
                self._fill(stream)
            wrap(exc, "native stage/copy", batch.number).reraise()
        tracing = stats.trace is not None
        if tracing:
            stats.mark("next:take", batch.number, started)
        if stream != batch.home and not UNSAFE_SKIP_HANDOVER:  # on the copy stream, or streams switched
            if batch.shared is None:
                current = self.engine.stream_of(stream)
                for t in batch.out:
                    t.record_stream(current)
            elif stream not in batch.shared.recorded:  # the group's blocks: once a consumer stream
                batch.shared.recorded.add(stream)
                current = self.engine.stream_of(stream)
                for t in batch.shared.blocks:
                    t.record_stream(current)
        result = self.build(batch.out)
        self.progress.yielded(batch.number, batch.samples)
        filling = time.perf_counter()
        if self._turns is None:
            self._fill(stream)
        if tracing:
            stats.mark("next:fill", batch.number, filling)
        stats.delivered(started, batch.samples, self._payload(batch), batch.number)
        if self.on_delivered is not None:
            self.on_delivered(self.device, time.perf_counter() - started)
        if self._copy_route is not None and self._copy_route.delivered():
            self._copy_route = None
        return result

    def _take(self, position: int, stream: int) -> None:
        deadline = time.monotonic() + self.timeout if self.timeout and self.timeout > 0 else None
        while not self.loop.take(position, stream, self.poll):
            if self.stop.is_set():
                raise LoaderShutdownError("this DataLoader iterator was shut down")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")

    def _consumer_stream(self) -> int:
        """The training thread's current stream as a raw handle (0 off CUDA). torch's raw getter
        costs a fraction of building a ``torch.cuda.Stream`` each batch (next() runs on the
        training thread, so every microsecond here delays a launch-bound step)."""
        if not self.cuda:
            return 0
        return raw_current_stream(self._device_index)

    @staticmethod
    def _payload(batch: _Batch) -> int:
        layout = batch.layout
        return int(sum(layout[2::2]))

    # -- statistics and shutdown ----------------------------------------------------------------
    def sync_stats(self) -> None:
        """Move the loop's counters (stage, read, copy seconds and bytes) into the loader's stats."""
        with self._lock:
            now = self.loop.stats()
            last, self._synced = self._synced, now
        delta = {k: v - last.get(k, 0) for k, v in now.items()}
        self.stats.add_stage("stage", delta["stage_s"], delta["staged_bytes"])
        moved = {"mapped": delta["mapped_bytes"], "engine-posix": delta["ring_bytes"] + delta["pread_bytes"]}
        self.stats.add_io({"registered-memory": delta["dma_bytes"]} if delta["dma_bytes"] else {})
        self.stats.add_stage("read", delta["read_s"], sum(moved.values()))
        self.stats.add_io({k: v for k, v in moved.items() if v})
        self.stats.add_stage("copy", _copy_seconds(last, now), delta["copied_bytes"])

    def _end_epoch(self) -> None:
        """Every batch was taken: leave the loop to the loader's next epoch (config ``keep_loop``)
        where nothing of this one is left in it, else stop it."""
        self._stop_turns()
        with self._lock:
            keep = self._keep_loop and not self.finished and self._fatal is None and not self._inflight
            keep = keep and self._held is None and not self._orphaned
            if keep:
                self.finished = True
        if not keep:
            self.shutdown(wait_for_copies=False)
            return
        self.stop.set()
        self.sync_stats()
        if self._copy_route is not None:
            self._copy_route.release(self.loop)
        parked = _ParkedLoop(
            self._key,
            self.loop,
            self._slots,
            self._loop_keep,
            self.engine,
            self._plans,
            self._recipes,
            self._next_position,
            self._synced,
            self._turns,
        )
        self._slots = None
        self._turns = None
        self.resources.park(parked)
        LIVE_PIPELINES.discard(self)

    def shutdown(self, wait_for_copies: bool = True) -> None:
        """Stop the loop's workers, wait for its copies, give the slots back. Idempotent."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        self.stop.set()
        self._stop_turns()  # a turn in progress submits its group first; none starts after
        timeout = config.get("shutdown_timeout")
        settled = self.loop.stop(timeout, wait_for_copies)  # wakes a turn thread in wait_below
        if self._turns is not None:  # and one parked on its condition (between this epoch's turns)
            self._turns.close(timeout)
        self.sync_stats()
        self._inflight.clear()
        if self._copy_route is not None:
            self._copy_route.release(self.loop)
        _settle(self.loop, settled, [self._loop_keep, self._keep], self._slots, self._orphaned, self.engine)
        if settled:
            self._orphaned = []
        self._slots = None
        LIVE_PIPELINES.discard(self)


@dataclass
class _ParkedLoop:
    """An ended epoch's C++ loop, kept by the loader's resources for its next epoch: its idle
    workers, the pinned slots it holds, what its fields point at, the batch plans and group
    recipes, its next position and the counters already counted (``sync_stats``). Starting a
    loop and stopping it cost the training thread ~0.3 ms an epoch on the H200 host, the first
    batch of a size then going alone ~0.2 ms more."""

    key: tuple
    loop: Any
    slots: Any  # (pool, slots) or None
    keep: list
    engine: Any
    plans: dict | None
    recipes: dict
    next_position: int
    synced: dict
    turns: _TurnWorker | None = None

    def close(self) -> None:
        timeout = config.get("shutdown_timeout")
        settled = self.loop.stop(timeout, True)
        if self.turns is not None:
            self.turns.close(timeout)
        _settle(self.loop, settled, self.keep, self.slots, [], self.engine)


def _settle(loop, settled: bool, keep, slots, orphaned: list, engine) -> None:
    """After ``loop.stop()``: the slots back to their pool, reused once every copy enqueued so
    far has completed; where a copy may still read them (``settled`` False), the loop, its
    slots and what its fields point at are kept for good."""
    if not settled:
        _LEAKED_LOOPS.append((loop, keep, slots, orphaned))
    elif slots:
        pool, leased = slots
        fence = engine.fence()
        for slot in leased:
            pool.release(slot, fence)


def _copy_seconds(last: dict, now: dict) -> float:
    """The copy seconds of the batches copied between two stats readings, estimated from the
    timed ones (``copy_timing_every``) by bytes: the timed batches' GB/s over all bytes copied."""

    def estimate(stats: dict) -> float:
        timed = stats.get("timed_bytes", 0)
        return stats.get("copy_s", 0.0) * stats.get("copied_bytes", 0) / timed if timed else 0.0

    return max(0.0, estimate(now) - estimate(last))


class _TurnWorker:
    """The turn thread (config ``turn_thread``) of one C++ loop: it waits without the GIL until
    fewer than ``depth`` batches are in flight, then takes the bound pipeline's next group's
    turn. It lives as long as the loop: parked with it between epochs (waiting on a condition,
    without the GIL) and bound to each later epoch's pipeline, so an epoch's edges pay no thread
    start and join (~0.3 ms of the training thread an epoch on the H200 host). It holds the
    pipeline only weakly between turns, so a dropped iterator is still freed (and stopped) at once."""

    def __init__(self, loop):
        self.loop = loop
        self._changed = threading.Condition()
        self._bound: tuple | None = None  # (weakref to the pipeline, depth)
        self._closed = False
        self.thread = threading.Thread(target=self._run, name="fastload-turn", daemon=True)
        self.thread.start()

    def bind(self, pipeline, depth: int) -> None:
        with self._changed:
            self._bound = (weakref.ref(pipeline), depth)
            self._changed.notify()

    def unbind(self, pipeline) -> None:
        with self._changed:
            if self._bound is not None and self._bound[0]() in (pipeline, None):
                self._bound = None

    def close(self, timeout: float | None) -> None:
        """End the thread (its loop is stopped or being parked for good)."""
        with self._changed:
            self._closed, self._bound = True, None
            self._changed.notify()
        if self.thread is not threading.current_thread():  # else a finalizer run on the turn thread itself
            self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._bound is None and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                bound = self._bound
            ref, depth = bound
            woken = self.loop.wait_below(depth, TURN_WAIT_S, TURN_SETTLE_US)
            if woken < 0:  # the loop stopped
                return
            pipeline = ref()
            more = pipeline is not None and not pipeline.finished and (not woken or pipeline._take_turn())
            del pipeline
            if not more:  # this epoch has no more turns: wait for the next one's pipeline
                with self._changed:
                    if self._bound is bound:
                        self._bound = None


def _order_pass(source) -> OrderPass | None:
    """The epoch's pass over an order drawn in bulk (``sampling.OrderPass``: its batches come as
    int64 arrays), or None where torch's sampler hands out lists."""
    indices = getattr(source, "_sampler_iter", None)
    return indices if isinstance(indices, OrderPass) else None


class CopyRouteChoice:
    """``memory_rows='auto'`` / ``mapped_copy='auto'``: whether registered in-memory rows and
    ranges of mapped files reach the GPU by the copy engines or by the gather kernel, from where
    the GPU is when the loop asks for a batch (``vision/step_probe.py``). A step that leaves its
    GPU waiting for the host (launch-bound: small models) loses more to the copy engines' per-row
    DMA submissions beside its launches than to a few SMs it does not use (H100 launch-bound
    thread: 0.80x alone with copy engines, 0.88x with the kernel, 0.90x beside a bare pinned
    copy); a step that keeps its GPU busy loses its SMs to the kernel (bf16 GEMM step as long as
    the transfer, H100: 1.01-1.03x with the copy engines, 1.23-1.27x with the kernel). The copy
    engines run while ``WINDOW`` batches after ``WARMUP`` are observed; the choice holds for the
    loader's later epochs; an epoch that ends sooner hands the count on to the next one (``rebind``).
    ``targets``: (what, the loop's setter) of each route left to 'auto'."""

    WARMUP, WINDOW, HOST_BOUND = 8, 24, 0.5

    def __init__(self, loop, targets, device, resources, stats):
        from .vision.step_probe import GpuStepProbe

        self.probe = GpuStepProbe(device)
        self.batches = 0
        self.resources = resources
        self.rebind(loop, targets, stats)

    def rebind(self, loop, targets, stats) -> None:
        """Go on watching with a later epoch's loop (copy engines until the choice)."""
        self.loop, self.targets, self.stats = loop, targets, stats
        self.names = [what for what, _ in targets]
        for _, set_kernel in targets:
            set_kernel(False)

    def release(self, loop) -> None:
        """``loop`` stopped: keep the count for the next epoch, not the loop (unless a later
        iterator's loop took the trial over meanwhile)."""
        if self.loop is loop:
            self.loop, self.targets, self.stats = None, [], None

    def _watching(self) -> bool:
        return self.WARMUP <= self.batches < self.WARMUP + self.WINDOW

    def requested(self) -> None:
        if self._watching():
            self.probe.mark("requested")

    def delivered(self) -> bool:
        """Count a batch handed over; True once the route is chosen (the caller drops this)."""
        if self._watching():
            self.probe.mark("delivered")
        self.batches += 1
        if self.batches < self.WARMUP + self.WINDOW:
            return False
        # None: the GPU had not even reached the window's marks, a queue of steps behind the
        # host (a GEMM-bound step on an H100 ran 70 batches so): its SMs are busy, the copy
        # engines stay
        reading = self.probe.take()
        kernel = reading is not None and reading.caught_up >= self.HOST_BOUND
        for _, set_kernel in self.targets:
            set_kernel(kernel)
        self.resources.copy_route = "kernel" if kernel else "dma"
        self.resources.copy_route_trial = None
        seen = f"the GPU had caught up {reading.caught_up:.0%} at next()" if reading else "the GPU a queue behind"
        what = " and ".join(name for name, _ in self.targets)
        self.stats.path += f" ({what}: {'gather kernel' if kernel else 'copy engines'}, {seen})"
        return True


class _FilePins:
    """The files of a layout as its source opened them (``fileio.FileIdentity``), checked after
    each batch's read: the row files and the shards the batch's records lie in."""

    def __init__(self, layout: NativeLayout):
        self.files: list = []  # (path, pin) of every FileRows field
        self.records: list = []  # (index, [(path, pin) per shard]) of every Records field
        for f in layout.fields:
            if isinstance(f, FileRows) and f.pin is not None:
                self.files.append((f.path, f.pin))
            elif isinstance(f, Records) and f.pins is not None:
                self.records.append((f.index, list(zip(f.paths, f.pins))))
        self.active = bool(self.files or self.records)

    def check(self, indices, cause: BaseException | None = None) -> None:
        if not (self.files or self.records):
            return
        try:
            fileio.check_pins(self.files)
            for index, shards in self.records:
                try:
                    used = np.unique(index[np.asarray(indices, dtype=np.int64), 0]).tolist()
                except (IndexError, ValueError, TypeError):  # indices the loop refused: every shard
                    used = range(len(shards))
                fileio.check_pins(shards[i] for i in used)
        except fileio.FileChangedError as changed:
            raise changed from cause


def run_native_or_none(loader, source, progress, resources, hooks, cached: dict | None = None):
    """A ``NativePipeline`` where the loop can run this iterator, else None. A source of remote
    objects runs here only on an epoch that reads them all from the shard cache: ``cached`` maps
    each URL to its entry (``remote/epoch.py``), and the layout names those instead."""
    if resources.settings.remote and hooks.native is not None:
        planned = hooks.native
        hooks = dataclasses.replace(hooks, native=lambda: _cache_layout(planned(), cached))
    layout = native_layout(loader, source, hooks, resources)
    if layout is None:
        resources.close_parked()  # the Python pipeline leases the pool's slots
        return None
    try:
        return NativePipeline(loader, source, progress, resources, layout, hooks)
    except _PoolBusy:
        return None
