"""A fixed pool of host staging slots, allocated once and reused.

Rule: a slot is handed out again only after the event recorded after its last H2D copy has
completed; otherwise the next batch would overwrite bytes the DMA engine has not read yet.

The pool is one allocation, touched and then registered with ``cudaHostRegister``: pinning
touched memory runs at ~37 GB/s on the reference machine, allocating fresh pinned memory at
~1 GB/s. Every slot starts on a 4 KiB boundary (O_DIRECT reads land in slots directly).
"""

from __future__ import annotations

import collections
import mmap
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from . import engine
from .errors import PoolError

__all__ = ["PinnedPool", "Slot", "PAGE"]

PAGE = 4096
_LEAKED_ON_TIMEOUT: list = []


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(eq=False)
class Slot:
    index: int
    buffer: torch.Tensor  # uint8, 1-D, PAGE-aligned
    free_after: object | None = None  # torch.cuda.Event recorded after the slot's last copy
    copy_timing: tuple | None = field(default=None, repr=False)  # (start, end) events
    # the sources a batch's device copy read where they lay (not through the slot), held until
    # ``free_after`` completed: their memory must not be freed and reused under the copy
    keep: list | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def _wait_event(event, stop: threading.Event | None, deadline: float | None, what: str) -> None:
    """Poll a CUDA event so the wait can honour a stop flag and a deadline."""
    pause = 2e-5
    while not event.query():
        if stop is not None and stop.is_set():
            raise PoolError(f"stopped while waiting for {what}")
        if deadline is not None and time.monotonic() > deadline:
            raise PoolError(f"timed out waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class PinnedPool:
    """``num_slots`` slots of ``slot_bytes`` each, page-locked when ``pin`` (needs CUDA)."""

    def __init__(self, num_slots: int, slot_bytes: int, *, pin: bool):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = _round_up(slot_bytes, PAGE)
        self.nbytes = self.num_slots * self.slot_bytes
        self.pinned = False
        self._registered_ptr: int | None = None
        self._registered_device = 0
        self._mapping: mmap.mmap | None = None
        self._memory = self._allocate(pin)
        self.slots = [Slot(i, self._memory[i * self.slot_bytes : (i + 1) * self.slot_bytes]) for i in range(num_slots)]
        self._free = collections.deque(self.slots)
        self._cond = threading.Condition()
        self._closed = False

    def _allocate(self, pin: bool) -> torch.Tensor:
        try:
            # An anonymous mapping: page-aligned, and eligible for transparent huge pages
            # (fewer pages to pin, fewer TLB misses for the staging memcpy).
            self._mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self._mapping.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
            memory.fill_(0)  # touch every page so registration does not fault them in one by one
        except RuntimeError as exc:
            raise PoolError(
                f"could not allocate a {self.nbytes}-byte staging pool "
                f"({self.num_slots} slots x {self.slot_bytes} bytes): {exc}"
            ) from exc
        if pin:
            err = engine.host_register(memory.data_ptr(), self.nbytes)
            if err != 0:
                raise PoolError(
                    f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {int(err)} "
                    f"({self.num_slots} slots x {self.slot_bytes} bytes); lower pool_slots or slot_bytes"
                )
            self._registered_ptr = memory.data_ptr()
            self._registered_device = torch.cuda.current_device()
            self.pinned = True
        return memory

    # -- slot hand-out -------------------------------------------------------------------
    def acquire(self, stop: threading.Event | None = None, timeout: float | None = None, poll: float = 0.05) -> Slot:
        """The oldest returned slot, once its last copy has completed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._closed or not self._free:
                if self._closed:
                    raise PoolError("pool is closed")
                if stop is not None and stop.is_set():
                    raise PoolError("stopped while waiting for a free pinned slot")
                if deadline is not None and time.monotonic() > deadline:
                    raise PoolError(f"timed out after {timeout} s waiting for a free pinned slot")
                self._cond.wait(poll)
            slot = self._free.popleft()
        if slot.free_after is not None:
            try:
                _wait_event(slot.free_after, stop, deadline, f"the copy out of pinned slot {slot.index}")
            except BaseException:
                self.release(slot, slot.free_after, front=True, keep=slot.keep)
                raise
            slot.free_after = None
        slot.keep = None
        return slot

    def lease_all(self, stop: threading.Event | None = None, poll: float = 0.05) -> list[Slot] | None:
        """Every slot at once, each once its last copy completed, for one user that keeps them
        (the native loop); None (nothing taken) when any slot is out with another user."""
        with self._cond:
            if self._closed:
                raise PoolError("pool is closed")
            if len(self._free) != self.num_slots:
                return None
            slots = list(self._free)
            self._free.clear()
        try:
            for slot in slots:
                if slot.free_after is not None:
                    _wait_event(slot.free_after, stop, None, f"the copy out of pinned slot {slot.index}")
                    slot.free_after = None
                slot.keep = None
        except BaseException:
            for slot in slots:
                self.release(slot, slot.free_after, keep=slot.keep)
            raise
        return sorted(slots, key=lambda s: s.index)

    def release(self, slot: Slot, free_after=None, front: bool = False, keep: list | None = None) -> None:
        """Give a slot back; it is reused only once ``free_after`` (a CUDA event) has completed,
        and ``keep`` (objects the copy reads outside the slot) is held until then."""
        slot.free_after = free_after
        slot.keep = keep
        with self._cond:
            if front:
                self._free.appendleft(slot)
            else:
                self._free.append(slot)
            self._cond.notify()

    def idle(self) -> bool:
        """Every slot is back and every copy out of the pool has completed."""
        with self._cond:
            if len(self._free) != self.num_slots:
                return False
            return all(s.free_after is None or s.free_after.query() for s in self._free)

    def wait_idle(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Wait until every slot is back and no copy reads from the pool any more."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                raise PoolError(f"timed out after {timeout} s waiting for in-flight copies to finish")
            if stop is not None and stop.is_set():
                raise PoolError("stopped while waiting for in-flight copies")
            time.sleep(1e-4)

    def close(self, timeout: float = 10.0) -> None:
        """Wait for copies reading the pool, then unregister and free it. Idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self.wait_idle(timeout)
        except PoolError:
            # A copy may still read these pages: keep them alive and registered for good
            # rather than hand the DMA engine freed memory.
            _LEAKED_ON_TIMEOUT.append(self._memory)
            warnings.warn(
                f"{self!r}: copies still in flight after {timeout} s ({self._outstanding()}); the pool is "
                "leaked instead of freed",
                RuntimeWarning,
                stacklevel=2,
            )
            self._registered_ptr = None
            return
        self._unregister()
        self.slots = []
        self._free.clear()
        self._memory = None

    def _outstanding(self) -> str:
        """What keeps the pool busy, for the leak warning: slots never given back (a user of the
        pool that did not finish) or given back with a copy out of them still running."""
        with self._cond:
            free = list(self._free)
        out = sorted(s.index for s in self.slots if all(s is not f for f in free))
        running = sorted(s.index for s in free if s.free_after is not None and not s.free_after.query())
        return f"slots not given back: {out or 'none'}; slots whose copy has not finished: {running or 'none'}"

    def _unregister(self) -> None:
        if self._registered_ptr is not None:
            try:
                engine.host_unregister(self._registered_ptr, self._registered_device)
            except Exception:  # interpreter shutdown may have torn CUDA down already
                pass
            self._registered_ptr = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self):
        try:
            if not self._closed:
                self._unregister()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"PinnedPool({self.num_slots} slots x {self.slot_bytes} bytes, {'pinned' if self.pinned else 'pageable'})"
        )
