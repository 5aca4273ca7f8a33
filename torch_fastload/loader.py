"""``torch_fastload.DataLoader``: torch's DataLoader, with batches arriving on the GPU.

Pipeline of one iterator (each arrow a bounded queue; every wait polls a stop flag):

    fetch thread  --fetched-->  stage threads  --ready-->  consumer's next()
    (torch workers or           (2 batches at once:       (back in order; consumer
     in-thread per-sample        plan, file reads or       stream waits on the batch's
     Python, in order)           pinned slot + memcpy,     event, record_stream)
                                 H2D on the copy stream)

Batches keep their order; an exception fetching or staging batch k is raised by the k-th
``next()`` and later batches still arrive, as with torch. The pinned pool, the copy stream
and the staging threads belong to the loader and are reused across epochs.

NOTE [shutdown]: the pipeline threads never reference the user-facing iterator object, only
the ``_Pipeline``; so dropping the iterator (break, del, an exception unwinding the training
loop) runs ``__del__``, which stops the threads, waits for copies in flight and hands the
slots back. ``DataLoader.close()`` (or garbage collection, or interpreter exit) frees the pool.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import itertools
import math
import queue
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind, _SingleProcessDataLoaderIter

from . import config
from . import io as fio
from . import resume as _resume
from .distributed import exact_sampler_batches
from .errors import BatchTooLargeError, LoaderShutdownError, PoolError, capture, wrap
from .pool import PinnedPool
from .staging import ALIGN, ParallelCopier, PendingRead, deferred_collate, gather_rows, plan_batch
from .stats import CopyTimer, LoaderStats, StatsSnapshot
from .transfer import CopyEngine, InFlightCopy

__all__ = ["DataLoader"]

_TORCH_INIT_PARAMS = set(inspect.signature(tud.DataLoader.__init__).parameters)
_END = object()
#: Batches staged at once: while one's read or copy runs in C++ without the GIL, the other's
#: per-batch Python (plan, slot, stream calls) runs; the consumer restores the order.
STAGE_WORKERS = 2


@dataclass
class _Failure:
    """A batch that could not be produced; ``next()`` re-raises it in its turn."""

    index: int
    error: Any  # errors.CapturedError
    samples = 0


@dataclass
class _Fatal:
    """The pipeline itself broke: raised once, then the iterator is shut down."""

    error: Any


@dataclass
class _Ready:
    index: int
    copy: InFlightCopy  # .batch is what next() returns
    samples: int
    nbytes: int


def _resolve_device(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} was asked for but CUDA is not available; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: torch_fastload supports 'cuda' and 'cpu' devices")
    return dev


class DataLoader(tud.DataLoader):
    """A drop-in for ``torch.utils.data.DataLoader`` whose batches arrive on ``device``.

    Every torch argument keeps its meaning, and with the same seed and generator the batches
    come in the same order. On a CUDA device ``pin_memory`` is implied (batches are staged
    through the pinned pool and arrive as GPU tensors). The extra keyword arguments default
    to ``None``, meaning the value in ``torch_fastload.config`` (env ``TORCH_FASTLOAD_*``):

    device: where batches arrive; default the current CUDA device, else ``'cpu'``.
    prefetch: batches kept ready on the device ahead of the consumer.
    stage_threads: threads copying a batch from pageable memory into its pinned slot.
    fetch_threads: threads running per-sample Python when ``num_workers == 0``.
    pool_slots, slot_bytes: the pinned pool (``slot_bytes=0``: sized by the first batch).
    oversize: a batch larger than a slot: ``'grow'`` the pool, or ``'error'``.
    io_mode, o_direct, io_threads, io_task_size, map_budget: how file-backed sources
        (``sources/``) are read: ``'auto'`` (GDS where usable, else the C++ engine: files
        resident in the page cache within ``map_budget`` are DMA'd straight from it, the rest
        streams through a pinned ring), ``'gds'``, ``'pinned'`` (whole batches through the
        pinned pool) or ``'posix'``; ``loader.io`` says which path is in effect.

    ``in_order=False`` (torch's argument) hands out whichever batch is ready first; each
    sample still arrives exactly once per epoch. ``state_dict()`` / ``load_state_dict()``
    checkpoint an epoch part-way (batches yielded, not prefetched) and resume it exactly, for
    every source, with other thread counts, and for a ``DistributedSampler`` at another world
    size (see ``torch_fastload.resume``).
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        device=None,
        prefetch: int | None = None,
        stage_threads: int | None = None,
        fetch_threads: int | None = None,
        pool_slots: int | None = None,
        slot_bytes: int | None = None,
        oversize: str | None = None,
        io_mode: str | None = None,
        o_direct: bool | None = None,
        io_threads: int | None = None,
        io_task_size: int | None = None,
        map_budget: int | str | None = None,
        **torch_kwargs,
    ):
        unknown = set(torch_kwargs) - _TORCH_INIT_PARAMS
        if unknown:
            raise TypeError(
                f"DataLoader got unexpected keyword argument(s) {sorted(unknown)} "
                f"(torch {torch.__version__} does not know them either)"
            )
        if collate_fn is None and callable(getattr(dataset, "collate", None)):
            collate_fn = dataset.collate  # sources collate their own samples (ragged records)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            False,  # torch never pins: the loader stages into its own pinned pool
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            **torch_kwargs,
        )
        self.device = _resolve_device(device)
        self.pin_memory_requested = bool(pin_memory)
        self.prefetch = config.resolve("prefetch", prefetch)
        self.stage_threads = config.resolve("stage_threads", stage_threads)
        self.fetch_threads = config.resolve("fetch_threads", fetch_threads)
        self.pool_slots = config.resolve("pool_slots", pool_slots)
        self.slot_bytes = config.resolve("slot_bytes", slot_bytes)
        self.oversize = config.resolve("oversize", oversize)
        self.io_mode = config.resolve("io_mode", io_mode)
        self.o_direct = config.resolve("o_direct", o_direct)
        self.io_threads = config.resolve("io_threads", io_threads)
        self.io_task_size = config.resolve("io_task_size", io_task_size)
        self.map_budget = config.resolve("map_budget", map_budget)
        self._io_path: fio.IoPath | None = None
        self._reader: fio.Reader | None = None
        self._host_reader: fio.Reader | None = None
        self._user_collate = collate_fn
        self._stats = LoaderStats()
        self._copy_timer = CopyTimer(self._stats)
        self._resources_lock = threading.Lock()
        self._pool: PinnedPool | None = None
        self._engine: CopyEngine | None = None
        self._copier: ParallelCopier | None = None
        self._pipelines: weakref.WeakSet = weakref.WeakSet()
        self._progress: _resume.EpochProgress | None = None  # of the latest iterator
        self._pending_resume: dict | None = None
        # the epoch's index batches where the loader draws them itself (a resumed epoch; a
        # DistributedSampler's, sliced lazily): set only while __iter__ builds the iterator
        self._epoch_index_sampler = None
        _LIVE_LOADERS.add(self)
        if self.device.type == "cpu" and self.pin_memory_requested and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no CUDA device is available: batches will not be pinned", stacklevel=2)

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> _FastloadIter:
        if self.persistent_workers and self.num_workers > 0:
            for pipeline in list(self._pipelines):  # the torch iterator is shared: stop its reader
                pipeline.shutdown()
        state, self._pending_resume = self._pending_resume, None
        generators = _resume.generators_of(self)
        user_rng = None
        if state is not None and state["epoch_in_progress"]:
            user_rng = torch.default_generator.get_state()  # put back once the epoch's draws are redone
            _resume.restore(generators, state["rng"])
            rng_at_start = dict(state["rng"])
        else:
            if state is not None:
                _resume.restore(generators, state["rng"])
            rng_at_start = _resume.capture(generators)
        progress = _resume.EpochProgress(rng=rng_at_start, sampler=_resume.describe_sampler(self))
        # NOTE [determinism] in resume.py: every draw that decides the epoch happens here.
        try:
            self._epoch_index_sampler = self._resumed_batches(state, progress)
            if self._epoch_index_sampler is None and progress.discard_prefix == 0:
                self._epoch_index_sampler = exact_sampler_batches(self)
            if self.num_workers > 0:
                in_order, self.in_order = getattr(self, "in_order", True), True
                try:  # torch's workers keep their order: batch numbers follow the sampler
                    source = super().__iter__()
                finally:
                    self.in_order = in_order
            else:
                collate = deferred_collate if (self._user_collate is None and self._auto_collation) else self.collate_fn
                source = _InThreadSource(self, collate)
                source._sampler_iter = _first_pulled(source._sampler_iter)
        finally:
            self._epoch_index_sampler = None
            if user_rng is not None:
                torch.default_generator.set_state(user_rng)
        progress.base_seed = int(source._base_seed) & (2**63 - 1)
        self._progress = progress
        pipeline = _Pipeline(self, source, progress)
        self._pipelines.add(pipeline)
        return _FastloadIter(pipeline)

    @property
    def _index_sampler(self):
        drawn = self._epoch_index_sampler if "_epoch_index_sampler" in self.__dict__ else None
        return drawn if drawn is not None else tud.DataLoader._index_sampler.fget(self)

    def _resumed_batches(self, state, progress: _resume.EpochProgress):
        """The index batches left in a checkpointed epoch, numbered as in the epoch; None when
        the epoch starts from its beginning."""
        if state is None or not state["epoch_in_progress"]:
            return None
        progress.samples = state["samples_yielded"]
        prefix, extra = state["batches_yielded"], set(state["yielded_out_of_order"])
        kind = state["sampler"]["kind"]
        if kind == "iterable":  # no indices to skip: the batches are fetched again and dropped
            progress.prefix = progress.discard_prefix = prefix
            progress.extra, progress.discard = set(extra), set(extra)
            return None
        numbers: deque = deque()
        progress.numbers = numbers
        if kind == "distributed":
            start, prefix, extra = _resume.distributed_plan(self, state)
            progress.sampler["start"] = start
            batches = _resume.distributed_batches(self, start)
            total = len(batches)
        else:
            batches = tud.DataLoader._index_sampler.fget(self)
            try:
                total = len(batches)
            except TypeError:
                total = None
            if total is not None and prefix + len(extra) > total:
                raise _resume.ResumeError(f"the state has {prefix + len(extra)} batches yielded, the epoch has {total}")
        progress.prefix, progress.extra = prefix, set(extra)
        return _resume.NumberedBatches(batches, prefix, extra, numbers, total)

    def state_dict(self) -> dict:
        """Where the current epoch stands, as a JSON-serializable dict: the batches yielded to
        the user so far (not those prefetched), how the epoch's indices were drawn and the random
        generators' states at its start. Between epochs (no iterator yet, or the last one
        exhausted): the generators' states for the next epoch."""
        return _resume.state_of(self, self._progress)

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter(loader)`` yield exactly the batches the checkpointed epoch had
        left (for a ``DistributedSampler``: call ``set_epoch`` with the checkpoint's epoch first,
        at this or another world size). Raises ``ResumeError`` (why, and the values) where this
        loader cannot continue that epoch."""
        state = _resume.check_state(self, state)
        if "dataset" in state and callable(getattr(self.dataset, "load_state_dict", None)):
            self.dataset.load_state_dict(state["dataset"])
        self._pending_resume = state

    def stats(self, reset: bool = False) -> StatsSnapshot:
        """Input-wait time, per-stage times, bytes and GB/s since creation (or the last reset)."""
        self._copy_timer.count()
        snapshot = self._stats.snapshot()
        if reset:
            self._stats.reset()
        return snapshot

    @property
    def io(self) -> fio.IoPath:
        """The file-read path in effect (gds, kvikio-compat, engine-posix, ...) and why."""
        with self._resources_lock:
            if self._io_path is None:
                self._io_path = fio.select(
                    self.io_mode, self.device, self.o_direct, self.io_threads, self.io_task_size, self.map_budget
                )
            return self._io_path

    def _file_reader(self) -> fio.Reader:
        path = self.io
        with self._resources_lock:
            if self._reader is None:
                self._reader = fio.make_reader(path)
                self._stats.set_io(str(path))
            return self._reader

    def _slot_reader(self) -> fio.Reader:
        """A reader into host slots, for sources that finish batches themselves (image decode
        reads the encoded bytes on the host: nvJPEG takes host bitstreams)."""
        with self._resources_lock:
            if self._host_reader is None:
                mode = "pinned" if self.io_mode == "pinned" else "posix"
                path = fio.select(mode, "cpu", self.o_direct, self.io_threads, self.io_task_size, 0)
                path = dataclasses.replace(
                    path, why=f"{path.why}; the source decodes from host memory (nvJPEG takes host bitstreams)"
                )
                self._host_reader = fio.make_reader(path)
                self._stats.set_io(str(path))
            return self._host_reader

    # -- resources shared by this loader's iterators --------------------------------------
    def _resources(self) -> tuple[CopyEngine, ParallelCopier]:
        with self._resources_lock:
            if self._engine is None:
                pin_cpu = self.device.type == "cpu" and self.pin_memory_requested and torch.cuda.is_available()
                self._engine = CopyEngine(self.device, pin_cpu_output=pin_cpu)
            if self._copier is None:
                self._copier = ParallelCopier(self.stage_threads, config.get("nontemporal"))
            return self._engine, self._copier

    def _pool_for(self, nbytes: int, batch_index: int) -> PinnedPool:
        """The pool, created on first use with exact slots, re-sized when a batch outgrows it."""
        with self._resources_lock:
            pool = self._pool
            if pool is not None and not pool.closed and nbytes <= pool.slot_bytes:
                return pool
            regrow = pool is not None and not pool.closed
            if regrow and self.oversize == "error":
                raise BatchTooLargeError(batch_index, nbytes, pool.slot_bytes)
            if regrow:
                pool.close(timeout=config.get("shutdown_timeout"))
                if not pool.closed:
                    raise PoolError("could not retire the old pool to grow it")
                slot_bytes = max(nbytes, int(pool.slot_bytes * 1.25))
            else:
                slot_bytes = max(nbytes, self.slot_bytes or self._slot_bytes_hint())
            self._pool = PinnedPool(self.pool_slots, slot_bytes, pin=self.device.type == "cuda")
            self._stats.set_pool(self._pool.num_slots, self._pool.slot_bytes, regrew=regrow)
            return self._pool

    def _slot_bytes_hint(self) -> int:
        """Sources of variable-size batches (packed records) bound a batch's bytes up front, so
        the pool is sized once instead of growing batch by batch."""
        hint = getattr(self.dataset, "__fastload_slot_bytes__", None)
        if hint is None or not self._auto_collation or self.batch_size is None:
            return 0
        if self._reader is not None and self._reader.path.to_device and _finisher(self) is None:
            return 0  # file bytes go straight to the device: slots hold only the small host fields
        return int(hint(self.batch_size))

    def close(self) -> None:
        """Stop every iterator, wait for copies in flight, free the pinned pool and threads."""
        for pipeline in list(self._pipelines):
            pipeline.shutdown()
        timeout = config.get("shutdown_timeout")
        with self._resources_lock:
            if self._engine is not None:
                self._engine.synchronize(timeout)
            for reader in (self._reader, self._host_reader):
                if reader is not None:
                    reader.close(timeout)
            self._reader = self._host_reader = None
            if self._pool is not None:
                self._pool.close(timeout=timeout)
                self._pool = None
            if self._copier is not None:
                self._copier.close()
                self._copier = None
        iterator = getattr(self, "_iterator", None)  # persistent workers
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self._iterator = None

    @property
    def pool(self) -> PinnedPool | None:
        """The pinned pool, once the first batch has sized it."""
        return self._pool

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _batch_reader(loader: DataLoader):
    """``indices -> batch of Pending fields`` where the dataset can describe a whole batch as
    reads (``__fastload_batch__``) or as row gathers (a TensorDataset); None otherwise. Only
    with the default collate or the source's own ``collate``, whose result these reproduce."""
    dataset = loader.dataset
    if not loader._auto_collation or loader._user_collate not in (None, getattr(dataset, "collate", None)):
        return None
    if (
        isinstance(dataset, tud.TensorDataset)
        and type(dataset).__getitem__ is tud.TensorDataset.__getitem__
        and dataset.tensors
        and all(t.device.type == "cpu" and t.layout == torch.strided for t in dataset.tensors)
    ):
        return lambda indices: gather_rows(dataset.tensors, indices)
    return getattr(dataset, "__fastload_batch__", None)


def _finisher(loader: DataLoader):
    """The source's ``__fastload_finish__`` where its batches take the planned path, else None."""
    if _batch_reader(loader) is None or loader.num_workers > 0:
        return None
    return getattr(loader.dataset, "__fastload_finish__", None)


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


def _first_pulled(indices):
    """``indices`` with the first item already drawn (on the calling thread: see NOTE [determinism]).
    A sampler that raises is raised by the first ``next()``, as torch does."""
    try:
        first = next(indices)
    except StopIteration:
        return iter(())
    except Exception as exc:
        return _raising(exc)
    return itertools.chain([first], indices)


def _raising(exc: Exception):
    raise exc
    yield  # a generator: raises when first advanced


class _InThreadSource(_SingleProcessDataLoaderIter):
    """torch's single-process iterator (same sampler and seed draws) for the fetch thread.

    It differs only in the collate function (``deferred_collate`` stacks straight into the
    pinned slot) and in allowing ``timeout`` (enforced by the consumer instead).
    """

    def __init__(self, loader: DataLoader, collate_fn):
        _BaseDataLoaderIter.__init__(self, loader)
        self._dataset_fetcher = _DatasetKind.create_fetcher(
            self._dataset_kind, self._dataset, self._auto_collation, collate_fn, self._drop_last
        )


class _Pipeline:
    """The threads, queues and state of one iterator (never referencing the iterator)."""

    _ids = itertools.count()

    def __init__(self, loader: DataLoader, source, progress: _resume.EpochProgress):
        self.loader = loader
        self.source = source
        self.progress = progress
        self.in_order = getattr(loader, "in_order", True)
        self.stop = threading.Event()
        self.poll = config.get("poll_interval")
        self.fetched: queue.Queue = queue.Queue(maxsize=loader.prefetch)
        self.ready: queue.Queue = queue.Queue(maxsize=loader.prefetch)
        self.engine, self.copier = loader._resources()
        self._finish = _finisher(loader) if isinstance(source, _InThreadSource) else None
        # a source that finishes batches itself may time how fast the training loop takes them
        self._on_delivered = getattr(loader.dataset, "__fastload_delivered__", None) if self._finish else None
        self.stats = loader._stats
        self.stats.path = (
            f"pinned-pool -> {loader.device}" if loader.device.type == "cuda" else "cpu (pageable slots, no pinning)"
        )
        self.copy_timer = loader._copy_timer
        self._lock = threading.Lock()
        self.finished = False
        uid = next(self._ids)
        self.fetch_thread = threading.Thread(target=self._fetch_loop, name=f"fastload-fetch-{uid}", daemon=True)
        self.stage_workers = [
            threading.Thread(target=self._stage_loop, name=f"fastload-stage-{uid}.{k}", daemon=True)
            for k in range(STAGE_WORKERS)
        ]
        self._reorder: dict = {}  # staged batches that arrived ahead of their turn, by index
        self._next_index = 0
        self._delivered = 0
        self._end_index: int | None = None  # where _END sits (out-of-order mode holds it back)
        _LIVE_PIPELINES.add(self)
        # The stage workers first: they block on the empty queue at once, whereas a fetch thread
        # started first takes the GIL for its first batch while this thread waits to start them
        # (on the GPU machine that put ~1.5 ms on every epoch's first batch).
        for worker in self.stage_workers:
            worker.start()
        self.fetch_thread.start()

    # -- queue helpers: every wait is bounded and honours the stop flag ---------------------
    def _put(self, q: queue.Queue, item) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=self.poll)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=self.poll)
            except queue.Empty:
                continue
        return None

    # -- fetch thread ---------------------------------------------------------------------
    def _fetched_batches(self):
        """``(epoch batch number, batch or the exception that batch raised)`` in sampler order
        (or as fetched, with ``in_order=False``)."""
        if isinstance(self.source, _InThreadSource):
            read_batch = _batch_reader(self.loader)
            if read_batch is not None:
                return self._in_thread_batches(read_batch)
            if self.loader.fetch_threads > 1 and self.source._dataset_kind == _DatasetKind.Map:
                return self._parallel_batches()
            return self._in_thread_batches(self.source._dataset_fetcher.fetch)
        return self._worker_batches()

    def _keyed(self, number: int, fetch, indices):
        """``fetch(indices)`` with the batch's key current (``resume.batch_generator``)."""
        with _resume._KeyScope(_resume.BatchKey(self.progress.base_seed, number)):
            return fetch(indices)

    def _in_thread_batches(self, fetch):
        """Per-sample fetches, or batches described whole (row gathers, file reads) and executed
        by the stager straight into the slot with no per-sample Python at all."""
        while True:
            try:
                indices = self.source._next_index()
            except StopIteration:
                return
            number = self.progress.next_number()
            try:
                yield number, self._keyed(number, fetch, indices)
            except StopIteration:  # an IterableDataset ended
                return
            except Exception as exc:
                yield number, exc

    def _worker_batches(self):
        """torch's worker processes, in their order (batch numbers follow the sampler's pulls)."""
        while True:
            try:
                batch = self.source.__next__()
            except StopIteration:
                return
            except Exception as exc:
                batch = exc
            yield self.progress.next_number(), batch
            if isinstance(batch, Exception) and getattr(self.source, "_shutdown", False):
                return  # torch shut its workers down (one died): nothing more will come

    def _parallel_batches(self):
        """``fetch_threads`` batches fetched at once (map-style datasets); in sampler order, or
        as they complete with ``in_order=False``."""
        threads = self.loader.fetch_threads
        fetch = self.source._dataset_fetcher.fetch
        pending: deque = deque()  # (number, future)
        with ThreadPoolExecutor(threads, thread_name_prefix="fastload-sample") as executor:
            exhausted = False
            while pending or not exhausted:
                while not exhausted and len(pending) < 2 * threads and not self.stop.is_set():
                    try:
                        indices = self.source._next_index()
                    except StopIteration:
                        exhausted = True
                        break
                    number = self.progress.next_number()
                    pending.append((number, executor.submit(self._keyed, number, fetch, indices)))
                if self.stop.is_set():
                    for _, future in pending:
                        future.cancel()
                    return
                if not pending:
                    continue
                if not self.in_order:
                    wait([future for _, future in pending], timeout=self.poll, return_when=FIRST_COMPLETED)
                    done = next((item for item in pending if item[1].done()), None)
                    if done is None:
                        continue
                    pending.remove(done)
                else:
                    done = pending.popleft()
                number, future = done
                try:
                    yield number, future.result()
                except Exception as exc:
                    yield number, exc

    def _fetch_loop(self) -> None:
        index = 0
        progress = self.progress
        try:
            batches = self._fetched_batches()
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    number, batch = next(batches)
                except StopIteration:
                    break
                if number < progress.discard_prefix or number in progress.discard:
                    continue  # a resumed IterableDataset epoch: yielded before the checkpoint
                self.stats.add_stage("fetch", time.perf_counter() - started)
                if isinstance(batch, Exception):
                    batch = _Failure(number, wrap(batch, "fetch", number))
                if not self._put(self.fetched, (index, number, batch)):
                    return
                index += 1
            self._put(self.fetched, (index, None, _END))
        except BaseException:
            self._put(self.fetched, (index, None, _Fatal(capture("fetch thread", index))))

    # -- stage threads --------------------------------------------------------------------
    def _stage_loop(self) -> None:
        """One of STAGE_WORKERS threads; batches leave in any order, ``next()`` restores it."""
        try:
            while True:
                item = self._get(self.fetched)
                if item is None:
                    return
                index, number, batch = item
                if batch is _END or isinstance(batch, _Fatal):
                    self._put(self.fetched, item)  # the other workers stop on it too
                    self._put(self.ready, item)
                    return
                if not isinstance(batch, _Failure):
                    try:
                        batch = self._stage_and_copy(number, batch)
                    except Exception:
                        if self.stop.is_set():
                            return
                        batch = _Failure(number, capture("stage/copy", number))
                if not self._put(self.ready, (index, number, batch)):
                    return
        except BaseException:
            self._put(self.ready, (None, None, _Fatal(capture("stage thread"))))
        finally:
            self.copy_timer.count()

    def _acquire_slot(self, nbytes: int, index: int):
        while True:
            pool = self.loader._pool_for(nbytes, index)
            try:
                return pool, pool.acquire(self.stop, poll=self.poll)
            except PoolError:
                if pool.closed and not self.stop.is_set():
                    continue  # another iterator re-sized the shared pool meanwhile
                raise

    def _stage_and_finish(self, index: int, batch, finish) -> _Ready:
        """Read the batch's files into a slot, then let the source build the device batch from
        it (``__fastload_finish__``: decode + augment) on the copy stream. The slot returns to
        the pool once everything enqueued on the stream so far has completed."""
        plan = plan_batch(batch, collated=True)
        items = plan.copy_list()
        reads = [(offset, src) for offset, src in items if isinstance(src, PendingRead)]
        reader = self.loader._slot_reader()
        pool, slot = self._acquire_slot(plan.total_bytes, index)
        copy = None
        try:
            started = time.perf_counter()
            by_path = reader.read(slot.buffer, reads)
            self.stats.add_stage("read", time.perf_counter() - started, sum(by_path.values()))
            self.stats.add_io(by_path)
            self.copier.copy_into(slot.buffer, [item for item in items if not isinstance(item[1], PendingRead)])
            host = plan.unpack(slot.buffer[: plan.total_bytes], lambda tensor: tensor)
            counts: dict = {}
            started = time.perf_counter()
            copy = self.engine.run(lambda: finish(host, self.loader.device, counts))
            self.stats.add_stage("decode", time.perf_counter() - started)
            self.stats.add_decoded(counts)
        finally:
            pool.release(slot, copy.done if copy is not None else self.engine.fence())
        samples = _leading_dim(copy.batch)
        return _Ready(index, copy, samples, plan.payload_bytes)

    def _stage_and_copy(self, index: int, batch) -> _Ready:
        finish = self._finish
        if finish is not None:
            return self._stage_and_finish(index, batch, finish)
        plan = plan_batch(batch, collated=self.loader._auto_collation)
        items = plan.copy_list()
        reads = [(offset, src) for offset, src in items if isinstance(src, PendingRead)]
        reader = self.loader._file_reader() if reads else None
        to_device = reader is not None and reader.path.to_device
        if to_device:  # file fields go straight to the device; the slot holds the rest, packed
            host, copies, host_bytes = _pack_host_fields(items)
        else:
            host, copies, host_bytes = items, None, plan.total_bytes
        moved: list = []

        def unpack(flat: torch.Tensor):
            return plan.unpack(flat, lambda tensor: self.engine.move_passthrough(tensor, moved))

        def read_into(buffer: torch.Tensor) -> None:
            started = time.perf_counter()
            by_path = reader.read(buffer, reads)
            self.stats.add_stage("read", time.perf_counter() - started, sum(by_path.values()))
            self.stats.add_io(by_path)

        pool = slot = copy = None
        if host_bytes:
            pool, slot = self._acquire_slot(host_bytes, index)
        try:
            if reads and not to_device:
                read_into(slot.buffer)
            if slot is not None:
                started = time.perf_counter()
                staged = self.copier.copy_into(slot.buffer, host)
                self.stats.add_stage("stage", time.perf_counter() - started, staged)
            span = slot.buffer[:host_bytes] if slot is not None else None
            copy = self.engine.start(
                span, unpack, nbytes=plan.total_bytes, copies=copies, fill=read_into if to_device else None
            )
        finally:
            if slot is not None:
                pool.release(slot, copy.done if copy is not None else None)
        copy.moved = moved
        on_stream = plan.payload_bytes if not to_device or reader.copies_on_stream else sum(n for _, _, n in copies)
        self.copy_timer.add(copy, on_stream)
        return _Ready(index, copy, plan.samples, plan.payload_bytes)

    # -- consumer ------------------------------------------------------------------------
    def next(self):
        if self.finished:
            raise StopIteration
        started = self.stats.request_started()
        number, item = self._next_ready()
        if item is _END:
            self.progress.finished = True
            self.shutdown(wait_for_copies=False)
            raise StopIteration
        if isinstance(item, _Fatal):
            self.shutdown()
            item.error.reraise()
        self.progress.yielded(number, item.samples)  # a failed batch is spent too: it was raised
        if isinstance(item, _Failure):
            self.stats.add_error()
            item.error.reraise()
        self.engine.hand_off(item.copy)
        self.stats.delivered(started, item.samples, item.nbytes)
        if self._on_delivered is not None:
            self._on_delivered(self.loader.device, time.perf_counter() - started)
        return item.copy.batch

    def _take(self, index: int):
        self._delivered += 1
        return self._reorder.pop(index)

    def _next_ready(self):
        """``(number, item)`` of the batch whose turn it is (stage workers finish out of order),
        or of any staged batch with ``in_order=False`` (the end only once all were delivered)."""
        timeout = self.loader.timeout
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        while True:
            if self.stop.is_set():
                raise LoaderShutdownError("this DataLoader iterator was shut down")
            if self.in_order:
                if self._next_index in self._reorder:
                    self._next_index += 1
                    return self._take(self._next_index - 1)
            else:
                staged = [i for i in self._reorder if i != self._end_index]
                if staged:
                    return self._take(min(staged))
                if self._end_index is not None and self._delivered == self._end_index:
                    return self._take(self._end_index)
            alive = any(worker.is_alive() for worker in self.stage_workers)
            try:
                index, number, item = self.ready.get(timeout=self.poll)
            except queue.Empty:
                if not alive and self.ready.empty():
                    raise LoaderShutdownError("the staging threads exited without delivering a batch") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
                continue
            if index is None:  # a stage thread itself broke: raised at once
                return None, item
            if item is _END:
                self._end_index = index
            self._reorder[index] = (number, item)

    def shutdown(self, wait_for_copies: bool = True) -> None:
        """Stop the threads, wait for copies in flight, return the slots. Idempotent.

        An exhausted epoch does not wait for its copies (``wait_for_copies=False``): every batch
        was handed to the consumer's stream, the slots and the ring guard their reuse with
        events, and a host synchronize here would only stall the next epoch's first reads
        behind the GPU's queue. ``close()`` still waits before it frees anything."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        self.stop.set()
        timeout = config.get("shutdown_timeout")
        deadline = time.monotonic() + timeout
        threads = [*self.stage_workers, self.fetch_thread]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            warnings.warn(
                f"torch_fastload: thread(s) {stuck} did not stop within {timeout} s "
                "(a dataset __getitem__ still running?); they are left as daemons. Where they are:\n"
                + _where([t for t in threads if t.is_alive()]),
                RuntimeWarning,
                stacklevel=2,
            )
        if wait_for_copies:
            self.engine.synchronize(max(0.0, deadline - time.monotonic()))
        self.copy_timer.count()
        for q in (self.fetched, self.ready):
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        if (
            not stuck
            and hasattr(self.source, "_shutdown_workers")
            and not (self.loader.persistent_workers and self.loader.num_workers > 0)
        ):
            self.source._shutdown_workers()
        _LIVE_PIPELINES.discard(self)


def _where(threads: list) -> str:
    """The innermost frames of each thread (what a stuck thread is doing)."""
    frames = sys._current_frames()
    out = []
    for thread in threads:
        frame = frames.get(thread.ident)
        stack = traceback.format_stack(frame, limit=8) if frame is not None else ["  (no frame)\n"]
        out.append(f"  {thread.name}:\n" + "".join(stack))
    return "".join(out)


class _FastloadIter:
    """What ``iter(loader)`` returns: a thin handle whose collection shuts the pipeline down."""

    def __init__(self, pipeline: _Pipeline):
        self._pipeline = pipeline

    def __iter__(self):
        return self

    def __next__(self):
        return self._pipeline.next()

    def __len__(self) -> int:
        return len(self._pipeline.source)

    def close(self) -> None:
        """Stop reading ahead now (also done on ``del``, garbage collection and exit)."""
        self._pipeline.shutdown()

    def __del__(self):
        # Garbage collection runs finalizers on whichever thread allocates: it may be a thread
        # the pipeline waits on (a decode or copy pool worker), so joining there would stall
        # both until the join times out. Off the main thread, stop at once and join elsewhere.
        pipeline = self._pipeline
        try:
            if threading.current_thread() is threading.main_thread():
                pipeline.shutdown()
                return
            pipeline.stop.set()
            threading.Thread(target=pipeline.shutdown, name="fastload-reaper", daemon=True).start()
        except Exception:
            pass


_LIVE_PIPELINES: weakref.WeakSet = weakref.WeakSet()
_LIVE_LOADERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    for pipeline in list(_LIVE_PIPELINES):
        try:
            pipeline.shutdown()
        except Exception:
            pass
    for loader in list(_LIVE_LOADERS):
        try:
            loader.close()
        except Exception:
            pass
