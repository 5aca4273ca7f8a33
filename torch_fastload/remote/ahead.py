"""Read-ahead: the remote ranges of batches the loader has fetched but not yet staged, requested
before their turn so that the connections never idle between batches.

Read one batch at a time, every batch pays a whole request latency with the link idle: its
requests go out, the last bytes land, only then do the next batch's requests leave (at 50 ms
and a few hundred MiB a batch, a quarter of the link's time). A training loader knows its next
batches (the sampler's order; the pipeline's fetch thread takes them ``prefetch`` batches
ahead), so as each batch is fetched its file fields' ranges (``PendingRead``) are submitted
here into a buffer of their own, at a priority below the batches being read now, while at most
``remote_read_ahead`` bytes are held this way. The stage that reads the batch ``take``s its
entry: ``copy_into`` waits for the requests, raising their error there (at that batch's
``next()``, never earlier), then copies the bytes into the batch's memory (a host slot, or
from the pinned buffer onto the GPU on the current stream). Every request is the same checked,
retried request as a batch read now (the object's size and version on every answer).

Only fields whose every path is a URL without a shard cache are read ahead (cached objects are
read as local files); anything else, and a field that does not fit in the budget, is read when
its batch is staged, as without read-ahead. Entries never taken (a batch that failed before its
read, an iterator dropped mid-epoch) are cancelled by their owner (``cancel``) or at ``close``.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from .client import count
from .objects import check_ranges, opened
from .pool import AHEAD, wait_all
from .url import is_url

__all__ = ["AheadReads", "AheadEntry"]

log = logging.getLogger("torch_fastload")


class AheadEntry:
    """One field's ranges in flight into ``buffer`` (packed back to back, as in the batch)."""

    def __init__(self, read, buffer: torch.Tensor, nbytes: int, futures: list, owner, release, recycle):
        self.read = read  # held: its id is the key, never reused while the entry lives
        self.buffer = buffer  # at least nbytes (a recycled one may be longer)
        self.futures = futures
        self.owner = owner
        self.nbytes = nbytes
        self._release = release
        self._recycle = recycle
        self._released = False

    def copy_into(self, dst: torch.Tensor, at: int) -> int:
        """Wait for the requests (their first error raised here), then copy into ``dst[at:]``."""
        try:
            wait_all(self.futures)
        finally:
            self.release()
        on_gpu = dst.device.type == "cuda"
        dst[at : at + self.nbytes].copy_(self.buffer[: self.nbytes], non_blocking=on_gpu)
        if not on_gpu:  # copied already: the next entry may receive into it (no fresh pages)
            self._recycle(self.buffer)
        return self.nbytes

    def cancel(self) -> None:
        """Drop the requests still queued; those running finish into the entry's own buffer."""
        for future in self.futures:
            future.cancel()
        self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release(self.nbytes)


class AheadReads:
    """The read-ahead entries of one ``RemoteReader``, at most ``budget`` bytes held."""

    #: cut a batch into pieces for several connections, as a batch read now is (``submit_host``)
    spread = False

    def __init__(self, reader, budget: int):
        self.reader = reader
        self.budget = budget
        self._entries: dict[int, AheadEntry] = {}
        self._spare: list[torch.Tensor] = []  # host buffers copied out, to receive again
        self._held = 0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes requested ahead and not yet taken (or cancelled)."""
        with self._lock:
            return self._held

    def start(self, read, pinned: bool = False, owner=None) -> bool:
        """Submit the ranges of ``read`` (a ``PendingRead``) now; False where it is not read
        ahead (local paths, a shard cache, another backend, the budget full, already started,
        or any error: its batch's own read meets that error in its turn)."""
        nbytes = int(read.lengths.sum())
        if nbytes == 0 or self.reader.backend != "http" or not read.paths or not all(is_url(p) for p in read.paths):
            return False
        with self._lock:
            if self._closed or id(read) in self._entries or self._held + nbytes > self.budget:
                return False
            self._held += nbytes  # reserved before the requests go out
        futures: list = []
        try:
            objects = [opened(p) for p in read.paths]
            if any(o.cache() is not None for o in objects):
                raise LookupError("cached objects are read from the cache")
            check_ranges(objects, read.file_index, read.offsets, read.lengths)
            buffer = self._buffer(nbytes, pinned and torch.cuda.is_available())
            packed = np.zeros(len(read.lengths), dtype=np.int64)
            np.cumsum(read.lengths[:-1], out=packed[1:])
            host = buffer.numpy()
            self.reader.submit_host(
                futures, host, objects, read.file_index, read.offsets, read.lengths, packed, AHEAD, spread=self.spread
            )
        except Exception as exc:  # the batch's own read meets (and raises) it in its turn
            log.debug("torch_fastload: a batch's remote ranges were not read ahead (%s)", exc)
            for future in futures:
                future.cancel()
            self._give_back(nbytes)
            return False
        entry = AheadEntry(read, buffer, nbytes, futures, owner, self._give_back, self._keep)
        with self._lock:
            closed = self._closed
            if not closed:
                self._entries[id(read)] = entry
        if closed:
            entry.cancel()
            return False
        count(read_ahead=1)
        return True

    def take(self, read) -> AheadEntry | None:
        """The entry of ``read`` (no longer held here), or None where it was not read ahead."""
        with self._lock:
            entry = self._entries.get(id(read))
            if entry is None or entry.read is not read:
                return None
            del self._entries[id(read)]
            return entry

    def cancel(self, owner=None) -> int:
        """Cancel the entries of ``owner`` (every entry with None); returns how many."""
        with self._lock:
            dropped = [k for k, e in self._entries.items() if owner is None or e.owner is owner]
            entries = [self._entries.pop(k) for k in dropped]
        for entry in entries:
            entry.cancel()
        return len(entries)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._spare.clear()
        self.cancel()

    def _buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A host buffer of at least ``nbytes``: a spare one that fits (its pages already
        mapped: a fresh 64 MiB buffer costs 16k page faults as it is written), else a new one.
        Pinned buffers come from torch's caching host allocator, which guards their reuse with
        the copies' events."""
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.numel() >= nbytes]
            if fits:  # the smallest that fits (by position: tensors compare element-wise)
                return self._spare.pop(min(fits, key=lambda i: self._spare[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def _keep(self, buffer: torch.Tensor) -> None:
        """Keep a copied-out host buffer for the next entries, within the budget."""
        with self._lock:
            if self._closed:
                return
            self._spare.append(buffer)
            while sum(b.numel() for b in self._spare) > self.budget:
                self._spare.pop(min(range(len(self._spare)), key=lambda i: self._spare[i].numel()))

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
