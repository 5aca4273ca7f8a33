"""The fetch side of a pipeline: where each batch's samples (or its read plan) come from.

Three strategies, chosen per iterator, each producing ``(number, batch or the exception that
batch raised)`` in the order ``next()`` delivers them (``number``: the batch's number in the
epoch, which a resumed epoch skips ahead in):

- **in thread**: torch's single-process iterator on the fetch thread. A batch source
  (``__fastload_batch__``) or a ``TensorDataset`` describes the whole batch as read plans, with
  no per-sample Python; any other dataset runs ``__getitem__`` and a collate that leaves tensor
  fields for the stager to stack straight into the pinned slot (``deferred_collate``);
- **parallel**: ``fetch_threads`` batches of a map-style dataset fetched at once on daemon
  threads (``SampleThreads``: per-sample Python that releases the GIL; at most ``prefetch + 1``
  batches at once, NOTE [read-ahead]);
- **workers**: torch's own worker processes (``num_workers > 0``), in their order.

NOTE [read-ahead]: every strategy takes a batch from its source only with a ``ReadAhead``
credit, so the fetch side runs ahead of the consumer by torch's rule plus ``prefetch`` batches:
torch fetches batch ``p`` inside the ``p + 1``-th ``next()`` (no workers), and with workers
hands batch ``p + prefetch_factor * num_workers`` to them when its ``p + 1``-th ``next()``
returns. Here batch ``p`` is taken from the source (the in-thread fetch, or torch's worker
iterator, which adds its own ``prefetch_factor * num_workers``) once ``next()`` was called
``p + 1 - prefetch`` times. With ``prefetch=0`` the batches fetched before the consumer changes
some state after batch ``k`` (an event a dataset checks) are exactly torch's; each fetched
batch is staged (and copied) at once, so ``prefetch`` is also the pipeline's depth.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable

import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind, _SingleProcessDataLoaderIter

from .resume import BatchKey, EpochProgress, _KeyScope
from .sampling import OrderPass
from .sources.protocol import SourceHooks, hooks_of
from .staging import deferred_collate, gather_rows

__all__ = [
    "InThreadSource",
    "Fetcher",
    "ReadAhead",
    "SampleThreads",
    "make_source",
    "batch_reader",
    "source_hooks",
    "uses_workers",
]

#: torch's DataLoader class, bound once: a framework that installs torch_fastload's class as
#: ``torch.utils.data.DataLoader`` must not make the subclass find itself as its base.
TorchDataLoader = tud.DataLoader

#: Batches the parallel strategy keeps in flight per fetch thread.
PARALLEL_DEPTH = 2


class InThreadSource(_SingleProcessDataLoaderIter):
    """torch's single-process iterator (same sampler and seed draws) for the fetch thread.

    It differs only in the collate function (``deferred_collate`` stacks straight into the
    pinned slot) and in allowing ``timeout`` (enforced by the consumer instead).
    """

    def __init__(self, loader, collate_fn):
        _BaseDataLoaderIter.__init__(self, loader)
        self._dataset_fetcher = _DatasetKind.create_fetcher(
            self._dataset_kind, self._dataset, self._auto_collation, collate_fn, self._drop_last
        )


class ReadAhead:
    """Credits for taking batches from the source (NOTE [read-ahead]): ``extra`` at the start,
    one more at each ``next()``."""

    def __init__(self, extra: int, stop: threading.Event, poll: float):
        self._allowed = extra
        self._taken = 0
        self._stop = stop
        self._poll = poll
        self._changed = threading.Condition()

    def grant(self) -> None:
        """The consumer asked for a batch: one more may be fetched."""
        with self._changed:
            self._allowed += 1
            self._changed.notify_all()

    def take(self, block: bool = True) -> bool:
        """A credit for the next batch: False once stopped (or, with ``block=False``, if none)."""
        with self._changed:
            while self._taken >= self._allowed:
                if not block or self._stop.is_set():
                    return False
                self._changed.wait(self._poll)
            self._taken += 1
            return True

    def widen(self, extra: int) -> None:
        """``extra`` more batches may run ahead from now on (a remote source, NOTE [remote depth])."""
        with self._changed:
            self._allowed += extra
            self._changed.notify_all()

    def give_back(self) -> None:
        """A taken batch was dropped, not delivered (a resumed iterable epoch's replay)."""
        with self._changed:
            self._taken -= 1
            self._changed.notify_all()


class SampleThreads:
    """``count`` daemon threads running per-sample Python (the parallel strategy).

    Not a ``ThreadPoolExecutor``: concurrent.futures joins its threads at interpreter exit, so a
    ``__getitem__`` that never returns would hang exit forever. These threads are daemons and
    ``close()`` only tells them to stop: a stuck one is abandoned (``Pipeline.shutdown`` joins
    it within ``shutdown_timeout`` and names it in its warning)."""

    def __init__(self, count: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"{name}.{k}", daemon=True) for k in range(count)]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """Stop each thread after its current job; jobs not started are cancelled."""
        for _ in self.threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            del job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
            del future  # a finished batch is held by the fetch side's reference only


def uses_workers(loader) -> bool:
    """Whether torch's worker processes fetch this loader's batches. Not for a batch source
    (``__fastload_batch__``): it reads whole batches in C++ and decodes them in batches, where
    worker processes would run its per-sample ``__getitem__`` instead, far slower. The user's
    ``num_workers`` is then not used, which ``DataLoader`` says once."""
    return loader.num_workers > 0 and not ignores_workers(loader)


def ignores_workers(loader) -> bool:
    """A batch source taking the batch path although ``num_workers > 0`` was asked for."""
    return (
        loader.num_workers > 0
        and not isinstance(loader.dataset, tud.TensorDataset)
        and batch_reader(loader) is not None
    )


def make_source(loader) -> Any:
    """The torch-side iterator of one epoch: torch's worker iterator, or ``InThreadSource``.

    Called while the epoch's draws are made (``resume.begin_epoch``): the first batch of
    indices is pulled here, on the calling thread (NOTE [determinism] in resume.py)."""
    if uses_workers(loader):
        in_order, loader.in_order = getattr(loader, "in_order", True), True
        try:  # torch's workers keep their order: batch numbers follow the sampler
            source = TorchDataLoader.__iter__(loader)
        finally:
            loader.in_order = in_order
        # The IterableDataset length warning belongs to the user's next() (loader._FastloadIter),
        # not to the fetch thread reading ahead through torch's __next__.
        source._IterableDataset_len_called = None
        return source
    deferred = loader._user_collate is None and loader._auto_collation
    source = InThreadSource(loader, deferred_collate if deferred else loader.collate_fn)
    source._sampler_iter = _first_pulled(source._sampler_iter)
    return source


def batch_reader(loader) -> Callable[[Any], Any] | None:
    """``indices -> batch of Pending fields`` where the dataset can describe a whole batch as
    reads (``__fastload_batch__``) or as row gathers (a TensorDataset); None otherwise. Only
    with the default collate or the source's own (``__fastload_collate__``), whose result
    these reproduce."""
    dataset = loader.dataset
    if not loader._auto_collation or loader._user_collate not in (None, hooks_of(dataset).collate):
        return None
    if (
        isinstance(dataset, tud.TensorDataset)
        and type(dataset).__getitem__ is tud.TensorDataset.__getitem__
        and dataset.tensors
        and all(t.device.type == "cpu" and t.layout == torch.strided for t in dataset.tensors)
    ):
        return lambda indices: gather_rows(dataset.tensors, indices)
    return hooks_of(dataset).batch


def source_hooks(loader, source) -> SourceHooks:
    """The protocol hooks that apply to this iterator: the batch reader, finish and delivered
    hooks where batches take the planned (in-thread) path; the slot-size bound wherever batches
    are collated (worker batches of a source fill the same slots)."""
    hooks = hooks_of(loader.dataset)
    bound = hooks.slot_bytes if loader._auto_collation and loader.batch_size is not None else None
    read = batch_reader(loader) if isinstance(source, InThreadSource) else None
    if read is None:
        return SourceHooks(slot_bytes=bound)
    return SourceHooks(
        read,
        hooks.finish,
        bound,
        hooks.delivered,
        hooks.requested,
        hooks.native,
        direct_cpu=hooks.direct_cpu,
        parallel=hooks.parallel,
        bind=hooks.bind,
        unbind=hooks.unbind,
        staged_at_once=hooks.staged_at_once,
        samples=hooks.samples,
    )


class Fetcher:
    """The fetch thread's batches for one iterator, by the strategy that fits the loader."""

    def __init__(
        self,
        loader,
        source,
        progress: EpochProgress,
        stop,
        poll: float,
        read_ahead: ReadAhead,
        read_batch=None,
        parallel_batches: bool = False,
    ):
        self.source = source
        self.read_ahead = read_ahead
        self.progress = progress
        self.stop = stop
        self.poll = poll
        self.in_order = getattr(loader, "in_order", True)
        self.fetch_threads = loader.fetch_threads
        self.read_batch = read_batch  # source_hooks(...).batch: whole batches described as reads
        self.parallel_batches = parallel_batches  # read_batch may run for several batches at once
        self.uses_workers = not isinstance(source, InThreadSource)
        self.sample_threads: list[threading.Thread] = []  # the parallel strategy's, once started

    def batches(self) -> Iterator[tuple[int, Any]]:
        """``(number, batch or the exception it raised)``, in sampler order (or as fetched, with
        ``in_order=False``)."""
        if not isinstance(self.source, InThreadSource):
            return self._from_workers()
        if self.read_batch is not None:
            if self.fetch_threads > 1 and self.parallel_batches:
                return self._parallel(self.read_batch)
            return self._in_thread(self.read_batch)
        if self.fetch_threads > 1 and self.source._dataset_kind == _DatasetKind.Map:
            return self._parallel()
        return self._in_thread(self.source._dataset_fetcher.fetch)

    def _keyed(self, number: int, fetch, indices):
        """``fetch(indices)`` with the batch's key current (``resume.batch_generator``)."""
        with _KeyScope(BatchKey(self.progress.base_seed, number)):
            return fetch(indices)

    def _in_thread(self, fetch):
        """Per-sample fetches, or batches described whole (row gathers, file reads) and executed
        by the stager straight into the slot with no per-sample Python at all."""
        while self.read_ahead.take():
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

    def _from_workers(self):
        """torch's worker processes, in their order (batch numbers follow the sampler's pulls)."""
        while self.read_ahead.take():
            try:
                batch = self.source.__next__()
            except StopIteration:
                return
            except Exception as exc:
                batch = exc
            yield self.progress.next_number(), batch
            if isinstance(batch, Exception) and getattr(self.source, "_shutdown", False):
                return  # torch shut its workers down (one died): nothing more will come
            batch = None  # NOTE [held batches] in pipeline.py

    def _parallel(self, fetch=None):
        """``fetch_threads`` batches fetched at once (map-style datasets, or a batch source's
        ``fetch`` that allows it); in sampler order, or as they complete with ``in_order=False``."""
        fetch = fetch or self.source._dataset_fetcher.fetch
        pending: deque = deque()  # (number, future)
        pool = SampleThreads(self.fetch_threads, threading.current_thread().name.replace("fetch", "sample"))
        self.sample_threads = pool.threads
        try:
            exhausted = False
            while pending or not exhausted:
                while not exhausted and len(pending) < PARALLEL_DEPTH * self.fetch_threads and not self.stop.is_set():
                    if not self.read_ahead.take(block=not pending):  # waits only with nothing to hand on
                        break
                    try:
                        indices = self.source._next_index()
                    except StopIteration:
                        exhausted = True
                        break
                    number = self.progress.next_number()
                    pending.append((number, pool.submit(self._keyed, number, fetch, indices)))
                if self.stop.is_set():
                    return
                if not pending:
                    continue
                done = self._next_done(pending)
                if done is None:
                    continue
                number, future = done
                while not future.done():  # in polls: a stop is never held up by a stuck sample
                    if self.stop.is_set():
                        return
                    wait([future], timeout=self.poll)
                try:
                    yield number, future.result()
                except Exception as exc:
                    yield number, exc
                done = future = None  # NOTE [held batches] in pipeline.py
        finally:
            for _, future in pending:
                future.cancel()
            pool.close()

    def _next_done(self, pending: deque):
        """The next ``(number, future)`` to hand on: the oldest, or with ``in_order=False`` any
        finished one (None if none finished within a poll)."""
        if self.in_order:
            return pending.popleft()
        wait([future for _, future in pending], timeout=self.poll, return_when=FIRST_COMPLETED)
        done = next((item for item in pending if item[1].done()), None)
        if done is not None:
            pending.remove(done)
        return done

    def shutdown_workers(self) -> None:
        """Stop torch's worker processes (no-op on the in-thread strategies)."""
        if hasattr(self.source, "_shutdown_workers"):
            self.source._shutdown_workers()


def _first_pulled(indices):
    """``indices`` with the first item already drawn (on the calling thread: see NOTE [determinism]).
    A sampler that raises is raised by the first ``next()``, as torch does. A pass of batches
    drawn in bulk (``sampling.OrderPass``) makes its draws instead, and stays itself (the native
    loop reads it as arrays)."""
    if isinstance(indices, OrderPass):
        try:
            indices.draw()
        except Exception as exc:
            return _raising(exc)
        return indices
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
