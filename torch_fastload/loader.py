"""``torch_fastload.DataLoader``: torch's DataLoader, with batches arriving on the GPU.

This module is the torch-facing surface: the arguments, ``iter()``, ``len()``, checkpoints,
statistics and ``close()``. The rest lives along the pipeline's seams (docs/architecture.md):
``resume.py`` makes each epoch's draws and continues checkpointed epochs, ``fetch.py`` picks
where samples come from, ``stager.py`` stages one batch into a pinned slot and starts its copy,
``pipeline.py`` runs the threads, queues, reordering and shutdown of one iterator, and
``resources.py`` holds what the loader's iterators share (pool, copy stream, readers, stats).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import inspect
import sys
import threading
import time
import warnings
import weakref
from typing import TypeVar

import torch
from torch.utils.data import IterableDataset

from . import config
from . import io as fio
from . import resume as _resume
from .fetch import TorchDataLoader, ignores_workers, make_source, source_hooks
from .native import run_native_or_none
from .pipeline import LIVE_PIPELINES, Pipeline
from .pool import PinnedPool
from .remote import urls_of
from .remote.epoch import CACHE_PATH_NOTE, start_epoch
from .resources import LoaderResources, ResourceSettings
from .resume_check import check_state
from .sources.protocol import hooks_of
from .stats import StatsSnapshot

__all__ = ["DataLoader"]

_TORCH_INIT_PARAMS = set(inspect.signature(TorchDataLoader.__init__).parameters)


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


#: The type of the dataset's samples: ``DataLoader[T]`` as with torch's ``Generic[T_co]`` loader.
T_co = TypeVar("T_co", covariant=True)


class DataLoader(TorchDataLoader[T_co]):
    """A drop-in for ``torch.utils.data.DataLoader`` whose batches arrive on ``device``.

    Every torch argument keeps its meaning, and with the same seed and generator the batches
    come in the same order. On a CUDA device ``pin_memory`` is implied (batches are staged
    through the pinned pool and arrive as GPU tensors). The extra keyword arguments default
    to ``None``, meaning the value in ``torch_fastload.config`` (env ``TORCH_FASTLOAD_*``):

    device: where batches arrive; default the current CUDA device, else ``'cpu'``.
    prefetch: batches fetched and staged ahead of the consumer beyond torch's own read-ahead
        (none without workers, ``prefetch_factor * num_workers`` with them); 0: torch's exactly.
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
        if collate_fn is None:  # a source's own collate (ragged records), by its explicit hook only
            collate_fn = hooks_of(dataset).collate
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
        self._user_collate = collate_fn
        self.resources = LoaderResources(
            ResourceSettings(
                device=self.device,
                pin_cpu_output=self.device.type == "cpu" and self.pin_memory_requested and torch.cuda.is_available(),
                stage_threads=self.stage_threads,
                pool_slots=self.pool_slots,
                slot_bytes=self.slot_bytes,
                oversize=self.oversize,
                io_mode=self.io_mode,
                o_direct=self.o_direct,
                io_threads=self.io_threads,
                io_task_size=self.io_task_size,
                map_budget=self.map_budget,
                native=config.get("native"),
                mapped_copy=config.get("mapped_copy"),
                memory_rows=config.get("memory_rows"),
                nontemporal=config.get("nontemporal"),
                output_stream=config.get("output_stream"),
                remote=bool(urls_of(dataset)),
            )
        )
        self._pipelines: weakref.WeakSet = weakref.WeakSet()
        self._progress: _resume.EpochProgress | None = None  # of the latest iterator
        self._pending_resume: dict | None = None
        # the epoch's index batches where the loader draws them itself (a resumed epoch; a
        # DistributedSampler's, sliced lazily): set only while __iter__ builds the iterator
        self._epoch_index_sampler = None
        _LIVE_LOADERS.add(self)
        if ignores_workers(self):
            warnings.warn(
                f"torch_fastload: {type(dataset).__name__} reads whole batches itself (C++ reads, batched "
                f"decode), so num_workers={num_workers} starts no worker processes: they would run its "
                "per-sample __getitem__ instead, far slower. Pass num_workers=0 to silence this.",
                stacklevel=2,
            )
        if self.device.type == "cpu" and self.pin_memory_requested and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no CUDA device is available: batches will not be pinned", stacklevel=2)

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> _FastloadIter:
        if self.persistent_workers and self.num_workers > 0:
            for pipeline in list(self._pipelines):  # the torch iterator is shared: stop its reader
                pipeline.shutdown()
        # every object cached: the epoch reads the entries as local files, the objects' versions
        # checked meanwhile (the first next() waits for that)
        cached, check = start_epoch(urls_of(self.dataset)) if self.resources.settings.remote else (None, None)
        state = self._pending_resume
        source, progress = _resume.begin_epoch(self, state, lambda: make_source(self))
        self._pending_resume = None  # only once the epoch began: a failed iter() can be retried
        self._progress = progress
        hooks = source_hooks(self, source)
        pipeline = run_native_or_none(self, source, progress, self.resources, hooks, cached)
        if pipeline is None:
            pipeline = Pipeline(self, source, progress, self.resources, hooks)
        self._pipelines.add(pipeline)
        return _FastloadIter(pipeline, check)

    @property
    def _index_sampler(self):
        return _resume.index_sampler(self, lambda: TorchDataLoader._index_sampler.fget(self))

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
        state = check_state(self, state)
        if "dataset" in state and callable(getattr(self.dataset, "load_state_dict", None)):
            self.dataset.load_state_dict(state["dataset"])
        self._pending_resume = state

    def stats(self, reset: bool = False) -> StatsSnapshot:
        """Input-wait time, per-stage times, bytes and GB/s since creation (or the last reset)."""
        for pipeline in list(self._pipelines):
            if hasattr(pipeline, "sync_stats") and not pipeline.finished:
                pipeline.sync_stats()
        self.resources.copy_timer.count()
        snapshot = self.resources.stats.snapshot()
        if reset:
            self.resources.stats.reset()
        return snapshot

    @property
    def io(self) -> fio.IoPath:
        """The file-read path in effect (gds, kvikio-compat, engine-posix, ...) and why."""
        path = self.resources.io
        caches = sorted({o.cache_dir for o in urls_of(self.dataset) if o.cache_dir})
        if caches:  # the epochs that will read the entries as local files (stats().path says which did)
            note = f"; shard cache {', '.join(caches)}: {CACHE_PATH_NOTE} on the native loop where it runs"
            path = dataclasses.replace(path, remote=path.remote + note)
        return path

    @property
    def pool(self) -> PinnedPool | None:
        """The pinned pool, once the first batch has sized it."""
        return self.resources.pool

    def close(self) -> None:
        """Stop every iterator, wait for copies in flight, free the pinned pool and threads."""
        for pipeline in list(self._pipelines):
            pipeline.shutdown()
        self.resources.close()
        iterator = getattr(self, "_iterator", None)  # persistent workers
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self._iterator = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _FastloadIter:
    """What ``iter(loader)`` returns: a thin handle whose collection shuts the pipeline down.

    torch's iterator attributes with a public meaning keep their names: ``_num_yielded``
    (batches this epoch has yielded), ``_shutdown_workers()`` (stop early: threads and worker
    processes, idempotent) and ``_workers`` (torch's worker processes, where they fetch). As
    with torch, the IterableDataset length warning is raised by the ``next()`` that passes the
    reported length, on the caller's thread."""

    def __init__(self, pipeline: Pipeline, check=None):
        self._pipeline = pipeline
        progress = pipeline.progress
        self._num_yielded = progress.prefix + len(progress.extra)  # a resumed epoch counts on
        loader = pipeline.loader
        self._dataset = loader.dataset
        self._num_workers = loader.num_workers
        self._IterableDataset_len_called = (
            loader._IterableDataset_len_called if isinstance(loader.dataset, IterableDataset) else None
        )
        self._check = check  # a cached epoch's check of its objects (remote/epoch.py)

    def __iter__(self):
        return self

    def __next__(self):
        if self._check is not None:  # no batch before the objects are known unchanged
            check, self._check = self._check, None
            self._pipeline.stats.request_started()  # the wait counts in the epoch's wall time
            try:
                check.wait()
            except BaseException:
                self._pipeline.shutdown()
                raise
        batch = self._pipeline.next()
        self._num_yielded += 1
        if self._IterableDataset_len_called is not None and self._num_yielded > self._IterableDataset_len_called:
            warnings.warn(_length_warning(self), stacklevel=2)
        return batch

    def __len__(self) -> int:
        return len(self._pipeline.source)

    @property
    def _workers(self) -> list:
        """torch's worker processes (``num_workers > 0`` on the per-sample path); like torch's
        single-process iterator, no such attribute where no workers fetch."""
        workers = getattr(self._pipeline.source, "_workers", None)
        if workers is None:
            raise AttributeError(f"{type(self).__name__!r} has no worker processes: no attribute '_workers'")
        return workers

    def _shutdown_workers(self) -> None:
        """Stop now, as torch's method of that name: the pipeline's threads and torch's worker
        processes (persistent ones too; the next ``iter()`` starts fresh ones). Idempotent."""
        self._pipeline.shutdown()
        source = self._pipeline.source
        if hasattr(source, "_shutdown_workers"):
            source._shutdown_workers()  # torch's own is idempotent
            loader = self._pipeline.loader
            if getattr(loader, "_iterator", None) is source:
                loader._iterator = None

    def close(self) -> None:
        """Stop reading ahead now (also done on ``del``, garbage collection and exit)."""
        self._pipeline.shutdown()

    def __del__(self):
        # Garbage collection runs finalizers on whichever thread allocates, wherever it is: on a
        # thread the pipeline waits on (a decode or copy pool worker), or on the main thread
        # inside a lock a pipeline thread needs (the fuzz found one: a collection inside
        # ThreadPoolExecutor.submit, which holds concurrent.futures' global lock, while the fetch
        # thread waited for it in its own submit). Joining there stalls both until the join
        # times out. So only a plain ``del`` on the main thread joins here; a collection or
        # another thread stops the pipeline at once and joins on a thread of its own. Not while
        # the interpreter exits: no thread starts then (the start would wait forever), and the
        # exit handler has shut every pipeline down already (this call returns at once).
        pipeline = self._pipeline
        try:
            on_main = threading.current_thread() is threading.main_thread()
            if (on_main and not _COLLECTING[0]) or sys.is_finalizing():
                pipeline.shutdown()
                return
            pipeline.stop.set()
            reaper = threading.Thread(target=pipeline.shutdown, name="fastload-reaper", daemon=True)
            reaper.start()
            _REAPERS.add(reaper)
        except Exception:
            pass


_COLLECTING = [False]  # True while the garbage collector runs (its finalizers among them)
#: Threads shutting down collected iterators' pipelines: the exit waits for them, or their
#: threads would still be inside pyarrow or the engine when the process tears its libraries down.
_REAPERS: weakref.WeakSet = weakref.WeakSet()


def _collecting(phase: str, info: dict) -> None:
    _COLLECTING[0] = phase == "start"


gc.callbacks.append(_collecting)


def _length_warning(iterator: _FastloadIter) -> str:
    """torch's text (``_BaseDataLoaderIter.__next__``), word for word."""
    text = (
        f"Length of IterableDataset {iterator._dataset} was reported to be {iterator._IterableDataset_len_called}"
        f"(when accessing len(dataloader)), but {iterator._num_yielded} samples have been fetched. "
    )
    if iterator._num_workers > 0:
        text += (
            "For multiprocessing data-loading, this could be caused by not properly configuring the "
            "IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
        )
    return text


_LIVE_LOADERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    for pipeline in list(LIVE_PIPELINES):
        try:
            pipeline.shutdown()
        except Exception:
            pass
    deadline = time.monotonic() + config.get("shutdown_timeout")
    for reaper in list(_REAPERS):
        reaper.join(max(0.0, deadline - time.monotonic()))
    for loader in list(_LIVE_LOADERS):
        try:
            loader.close()
        except Exception:
            pass
