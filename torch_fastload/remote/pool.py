"""Threads that run range requests: a batch's reads, then batches' read-ahead, then cache fills
(a priority queue; first come, first served within a priority)."""

from __future__ import annotations

import itertools
import os
import queue
import threading
from concurrent.futures import CancelledError, Future

__all__ = ["RequestPool", "BATCH", "AHEAD", "FILL", "wait_all"]

#: priorities: a batch read now (its stage waits) jumps ahead of queued read-ahead requests of
#: later batches, and both ahead of queued cache-fill requests
BATCH, AHEAD, FILL = 0, 1, 2
_STOP = 3


class RequestPool:
    """``threads`` workers started on first use, named ``fastload-remote-<i>``."""

    def __init__(self, threads: int, name: str = "fastload-remote"):
        self.threads = threads
        self.name = name
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def submit(self, priority: int, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the remote reader is closed")
            if self._pid != os.getpid():  # a forked child: its parent's workers are not here
                self._queue, self._workers, self._pid = queue.PriorityQueue(), [], os.getpid()
            if not self._workers:
                for i in range(self.threads):
                    worker = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                    worker.start()
                    self._workers.append(worker)
            self._queue.put((priority, next(self._order), future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            priority, _, future, fn, args = self._queue.get()
            if priority == _STOP:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def close(self, timeout: float) -> bool:
        """Cancel queued work, stop the workers and join them; False if one outlived ``timeout``."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item[0] != _STOP:
                item[2].cancel()
        for _ in workers:
            self._queue.put((_STOP, next(self._order), None, None, None))
        for worker in workers:
            worker.join(timeout)
        return not any(w.is_alive() for w in workers)


def wait_all(futures) -> None:
    """Wait for every request; on the first failure cancel those still queued. Raises the
    first real error (not a cancellation) once nothing writes into the buffer."""
    error = None
    for future in futures:
        try:
            future.result()
        except CancelledError:
            continue
        except BaseException as exc:
            if error is None:
                error = exc
                for other in futures:
                    other.cancel()
    if error is not None:
        raise error
