"""One iterator's pipeline: its threads, bounded queues, reordering and shutdown.

    fetch thread  --fetched-->  stage threads  --ready-->  consumer's next()
    (fetch.Fetcher: torch       (STAGE_THREADS batches     (back in order; the consumer
     workers, per-sample         at once: stager.stage,     stream waits on the batch's
     Python, or read plans)      H2D on the copy stream)    event, record_stream)

Each queue item is ``(position, number, item)``: ``position`` is the batch's place in this
iterator's delivery order (what the reordering restores), ``number`` its number in the epoch
(what errors and checkpoints name; a resumed epoch starts past its yielded batches). Every
blocking wait is bounded and polls the stop flag. A batch that failed to fetch or stage is a
``Failure``, raised by its own ``next()`` with its type and traceback; later batches still
arrive, as with torch. A broken pipeline thread is ``Fatal``: raised once, then shut down.

NOTE [shutdown]: the threads reference the ``Pipeline``, never the user-facing iterator, so
dropping the iterator (break, del, an exception unwinding the loop) runs its ``__del__``, which
stops the threads, waits for copies in flight and hands the slots back (``shutdown``). The
loader's ``close()`` (or garbage collection, or interpreter exit) frees the shared resources.

NOTE [held batches]: a thread lets go of each batch once it handed it on. A failed batch's
exception, once ``next()`` raised it, has the consumer's frames in its traceback, the
iterator's among them: a thread still holding it (waiting for the next read-ahead credit,
which only the consumer grants) would keep the dropped iterator alive, and so itself.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import config
from .errors import CapturedError, LoaderShutdownError, capture, wrap
from .fetch import Fetcher, ReadAhead
from .resources import LoaderResources
from .resume import EpochProgress
from .sources.protocol import SourceHooks
from .stager import BatchStager, StagedBatch

__all__ = ["Pipeline", "STAGE_THREADS", "LIVE_PIPELINES", "stage_thread_count"]

#: Batches staged at once: while one's read or copy runs in C++ without the GIL, the other's
#: per-batch Python (plan, slot, stream calls) runs; the consumer restores the order.
STAGE_THREADS = 2
#: memcpy threads per batch when torch's worker processes fetch: they hold every core already,
#: and each thread taken from them slows the whole pipeline (H100 machine, 16 workers: 8 threads
#: gave 2,772 images/s on ResNet-18, 1 thread 3,678).
WORKER_COPY_THREADS = 2


def stage_thread_count(hooks: SourceHooks, prefetch: int) -> int:
    """STAGE_THREADS, or more where the source asks to have more batches staged at once
    (``__fastload_staged_at_once__``), up to the ``prefetch + 1`` batches the read-ahead
    credits let be in flight: a thread beyond those would only wait."""
    return max(STAGE_THREADS, min(hooks.staged_at_once, prefetch + 1))


#: batches an iterator over remote objects fetches ahead at most (NOTE [remote depth])
MAX_REMOTE_AHEAD = 64

END = object()  # the fetch side is exhausted
LIVE_PIPELINES: weakref.WeakSet = weakref.WeakSet()
log = logging.getLogger("torch_fastload")


@dataclass
class Failure:
    """A batch that could not be produced; ``next()`` re-raises it in its turn."""

    number: int
    error: CapturedError
    samples = 0


@dataclass
class Fatal:
    """The pipeline itself broke: raised once, then the iterator is shut down."""

    error: CapturedError


class Pipeline:
    """The threads, queues and state of one iterator (never referencing the iterator)."""

    _ids = itertools.count()

    def __init__(self, loader, source, progress: EpochProgress, resources: LoaderResources, hooks: SourceHooks):
        self.loader = loader  # kept alive while the threads run: its close() frees the resources
        self.source = source
        self.progress = progress
        self.resources = resources
        self.device = resources.device
        self.in_order = getattr(loader, "in_order", True)
        self.timeout = loader.timeout
        self.keep_workers = bool(loader.persistent_workers and loader.num_workers > 0)
        self.stop = threading.Event()
        self.poll = config.get("poll_interval")
        # NOTE [read-ahead] in fetch.py: the credits bound the batches in flight to prefetch + 1,
        # so these queues never hold the fetch side back; they only hand batches on.
        self.read_ahead = ReadAhead(loader.prefetch, self.stop, self.poll)
        self.fetched: queue.Queue = queue.Queue(maxsize=loader.prefetch + 1)  # NOTE [remote depth]
        self._deepened = False
        self.ready: queue.Queue = queue.Queue(maxsize=loader.prefetch + 1)
        self.fetcher = Fetcher(
            loader, source, progress, self.stop, self.poll, self.read_ahead, hooks.batch, hooks.parallel
        )
        bound = None
        if hooks.slot_bytes is not None:
            batch_size = loader.batch_size

            def bound() -> int:
                return hooks.slot_bytes(batch_size)

        self.stager = BatchStager(
            resources,
            collated=loader._auto_collation,
            stop=self.stop,
            poll=self.poll,
            finish=hooks.finish,
            slot_bytes_bound=bound,
            consumer=torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None,
            copy_threads=WORKER_COPY_THREADS if self.fetcher.uses_workers else None,
            direct_cpu=hooks.direct_cpu,
            samples=hooks.samples,
        )
        bound = None
        self._unbind = None  # the source's __fastload_unbind__, owed once by shutdown()
        if hooks.bind is not None and not self.fetcher.uses_workers:
            bound = hooks.bind(self.device)  # before any batch is fetched (the threads start below)
            self._unbind = hooks.unbind
        self.on_delivered = hooks.delivered
        self.on_requested = hooks.requested
        self.engine = resources.engine
        self.stats = resources.stats
        if self.device.type == "cuda":
            self.stats.path = f"pinned-pool -> {self.device}"
        elif self.stager.direct_cpu:
            self.stats.path = "cpu (copied once, straight into each batch)"
        else:
            self.stats.path = "cpu (pageable slots, no pinning)"
        if bound:  # the source's own word on how it produces its fields for this device
            self.stats.path += f"; {bound}"
        self._lock = threading.Lock()
        self.finished = False
        self._reorder: dict = {}  # staged batches that arrived ahead of their turn, by position
        self._next_position = 0
        self._delivered = 0
        self._end_position: int | None = None  # where END sits (out-of-order mode holds it back)
        uid = next(self._ids)
        self.fetch_thread = threading.Thread(target=self._fetch_loop, name=f"fastload-fetch-{uid}", daemon=True)
        self.stage_threads = [
            threading.Thread(target=self._stage_loop, name=f"fastload-stage-{uid}.{k}", daemon=True)
            for k in range(stage_thread_count(hooks, loader.prefetch))
        ]
        LIVE_PIPELINES.add(self)
        # The stage threads first: they block on the empty queue at once, whereas a fetch thread
        # started first takes the GIL for its first batch while this thread waits to start them
        # (on the GPU machine that put ~1.5 ms on every epoch's first batch).
        for thread in self.stage_threads:
            thread.start()
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
    def _fetch_loop(self) -> None:
        position = 0
        progress = self.progress
        try:
            batches = self.fetcher.batches()
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    number, batch = next(batches)
                except StopIteration:
                    break
                if number < progress.discard_prefix or number in progress.discard:
                    self.read_ahead.give_back()  # a resumed IterableDataset epoch: yielded before
                    continue  # the checkpoint, fetched again and dropped
                self.stats.add_stage("fetch", time.perf_counter() - started, number=number)
                if isinstance(batch, Exception):
                    batch = Failure(number, wrap(batch, "fetch", number))
                else:
                    self._read_ahead(batch)
                if not self._put(self.fetched, (position, number, batch)):
                    return
                batch = None  # NOTE [held batches]
                position += 1
            self._put(self.fetched, (position, None, END))
        except BaseException:
            self._put(self.fetched, (position, None, Fatal(capture("fetch thread"))))

    def _read_ahead(self, batch) -> None:
        """Its remote ranges requested now (``remote/ahead.py``): the stage threads read the
        batches before it meanwhile. Never raises: the batch's own read meets any error."""
        try:
            started, budget = self.stager.read_ahead(batch)
        except Exception as exc:
            log.debug("torch_fastload: batch not read ahead (%s)", exc)
            return
        if started and not self._deepened:
            self._deepen(started, budget)

    def _deepen(self, batch_bytes: int, budget: int) -> None:
        """NOTE [remote depth]: the first batch read ahead sizes how many batches this iterator
        fetches ahead: as many as ``remote_read_ahead`` holds (at most ``MAX_REMOTE_AHEAD``),
        where that is more than ``prefetch + 1``. At one request latency per batch and a few
        batches in flight, a link of latency x bandwidth bytes (450 MB at 50 ms x 9 GB/s)
        idles; only batch plans are fetched early, their bytes held within the budget. With
        ``prefetch=0`` (exactly torch's fetch order, asked for) the depth is kept."""
        self._deepened = True
        if self.loader.prefetch == 0:
            return
        extra = min(MAX_REMOTE_AHEAD, budget // max(1, batch_bytes)) - (self.loader.prefetch + 1)
        if extra > 0:
            with self.fetched.mutex:  # the queue holds every batch the credits let in
                self.fetched.maxsize += extra
            self.read_ahead.widen(extra)

    # -- stage threads --------------------------------------------------------------------
    def _stage_loop(self) -> None:
        """One of the stage threads; batches leave in any order, ``next()`` restores it."""
        try:
            while True:
                item = self._get(self.fetched)
                if item is None:
                    return
                position, number, batch = item
                if batch is END or isinstance(batch, Fatal):
                    self._put(self.fetched, item)  # the other stage threads stop on it too
                    self._put(self.ready, item)
                    return
                if not isinstance(batch, Failure):
                    try:
                        started = time.perf_counter()
                        batch = self.stager.stage(number, batch)
                        self.stats.mark("staged", number, started)
                    except Exception:
                        if self.stop.is_set():
                            return
                        batch = Failure(number, capture("stage/copy", number))
                if not self._put(self.ready, (position, number, batch)):
                    return
                item = batch = None  # NOTE [held batches]
        except BaseException:
            self._put(self.ready, (None, None, Fatal(capture("stage thread"))))
        finally:
            self.resources.copy_timer.count()

    # -- consumer ------------------------------------------------------------------------
    def next(self) -> Any:
        if self.finished:
            raise StopIteration
        started = self.stats.request_started()
        if self.on_requested is not None:
            self.on_requested(self.device)
        # NOTE [read-ahead] in fetch.py: this call's credit. Granted before any wait (the batch
        # waited for may need it), else once the batch is handed over: the fetch thread it wakes
        # runs Python (torch's worker iterator rebuilds each batch from shared memory), which
        # would hold the GIL while this call's last steps queue for it.
        granted = []

        def grant() -> None:
            self.read_ahead.grant()
            granted.append(True)

        try:
            number, item = self._next_ready(before_wait=grant)
            self.stats.mark("next:ready", number, started)
            if item is END:
                self.progress.finished = True
                self.shutdown(wait_for_copies=False)
                raise StopIteration
            if isinstance(item, Fatal):
                self.shutdown()
                item.error.reraise()
            self.progress.yielded(number, item.samples)  # a failed batch is spent too: it was raised
            if isinstance(item, Failure):
                self.stats.add_error()
                item.error.reraise()
            staged: StagedBatch = item
            self.engine.hand_off(staged.copy)
            self.stats.delivered(started, staged.samples, staged.nbytes, number)
            if self.on_delivered is not None:
                self.on_delivered(self.device, time.perf_counter() - started)
        finally:
            if not granted:
                self.read_ahead.grant()
        return staged.copy.batch

    def _take(self, position: int):
        self._delivered += 1
        return self._reorder.pop(position)

    def _next_ready(self, before_wait: Callable[[], None] | None = None):
        """``(number, item)`` of the batch whose turn it is (stage threads finish out of order),
        or of any staged batch with ``in_order=False`` (the end only once all were delivered).
        ``before_wait()`` runs once, before the first wait for a batch not staged yet."""
        timeout = self.timeout
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        while True:
            if self.stop.is_set():
                raise LoaderShutdownError("this DataLoader iterator was shut down")
            ready = self._ready_in_turn()
            if ready is not None:
                return ready
            try:
                position, number, item = self.ready.get_nowait()
            except queue.Empty:
                if before_wait is not None:
                    before_wait()
                    before_wait = None
                alive = any(thread.is_alive() for thread in self.stage_threads)
                try:
                    position, number, item = self.ready.get(timeout=self.poll)
                except queue.Empty:
                    if not alive and self.ready.empty():
                        raise LoaderShutdownError("the staging threads exited without delivering a batch") from None
                    if deadline is not None and time.monotonic() > deadline:
                        raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
                    continue
            if position is None:  # a stage thread itself broke: raised at once
                return None, item
            if item is END:
                self._end_position = position
            self._reorder[position] = (number, item)

    def _ready_in_turn(self):
        """The staged batch to deliver now, if it has arrived (None otherwise)."""
        if self.in_order:
            if self._next_position in self._reorder:
                self._next_position += 1
                return self._take(self._next_position - 1)
            return None
        staged = [p for p in self._reorder if p != self._end_position]
        if staged:
            return self._take(min(staged))
        if self._end_position is not None and self._delivered == self._end_position:
            return self._take(self._end_position)
        return None

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
        threads = [*self.stage_threads, self.fetch_thread]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        for thread in self.fetcher.sample_threads:  # started by the fetch thread, joined above
            thread.join(max(0.0, deadline - time.monotonic()))
            threads.append(thread)
        stuck = [t for t in threads if t.is_alive()]
        if stuck:
            warnings.warn(
                f"torch_fastload: thread(s) {[t.name for t in stuck]} did not stop within {timeout} s "
                "(a dataset __getitem__ still running?); they are left as daemons. Where they are:\n" + _where(stuck),
                RuntimeWarning,
                stacklevel=2,
            )
        self.stager.cancel_read_ahead()  # the batches not staged: their requests are dropped
        if wait_for_copies:
            self.engine.synchronize(max(0.0, deadline - time.monotonic()))
        self.resources.copy_timer.count()
        for q in (self.fetched, self.ready):
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        if not stuck and not self.keep_workers:
            self.fetcher.shutdown_workers()
        unbind, self._unbind = self._unbind, None
        if unbind is not None:
            try:
                unbind(self.device)
            except Exception as exc:  # the source's own undoing: never fails the shutdown
                log.warning("torch_fastload: the source's __fastload_unbind__ failed: %s", exc)
        LIVE_PIPELINES.discard(self)


def _where(threads: list) -> str:
    """The innermost frames of each thread (what a stuck thread is doing)."""
    frames = sys._current_frames()
    out = []
    for thread in threads:
        frame = frames.get(thread.ident)
        stack = traceback.format_stack(frame, limit=8) if frame is not None else ["  (no frame)\n"]
        out.append(f"  {thread.name}:\n" + "".join(stack))
    return "".join(out)
