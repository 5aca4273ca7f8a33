"""What a DataLoader's iterators share: made on first use, reused across epochs, freed by close().

Each iterator's pipeline is handed the loader's ``LoaderResources``: the copy engine (the
loader's CUDA stream), the staging copier (memcpy threads), the pinned slot pool, the file
readers (``readers.py``) and the statistics. Building them once matters: pinning memory costs
~1 GB/s when allocated fresh, so the pool is allocated once, sized by the first batch (or a
source's bound), and only re-made when a batch outgrows it (``oversize='grow'``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from . import config, engine, readers
from . import io as fio
from .errors import BatchTooLargeError, PoolError
from .pool import PinnedPool
from .staging import ParallelCopier
from .stats import CopyTimer, LoaderStats
from .transfer import CopyEngine

__all__ = ["ResourceSettings", "LoaderResources"]

#: A pool re-made for an oversized batch gets this much headroom, so a run of slowly growing
#: batches does not re-pin memory for each one.
POOL_GROWTH = 1.25
PAGE = 4096


@dataclass(frozen=True)
class ResourceSettings:
    """The loader's resolved options that decide its resources (see ``DataLoader``)."""

    device: torch.device
    pin_cpu_output: bool  # device='cpu' with pin_memory=True: batches come out pinned, as torch's
    stage_threads: int
    pool_slots: int
    slot_bytes: int  # 0: exact size of the first batch (or the source's bound)
    oversize: str  # 'grow' or 'error'
    io_mode: str
    o_direct: bool
    io_threads: int
    io_task_size: int
    map_budget: int
    # config-only options, read when the loader is made (like every option): see config.py
    native: str = "auto"
    mapped_copy: str = "auto"
    memory_rows: str = "auto"
    nontemporal: bool = True
    output_stream: str = "copy"  # where batches' device memory is allocated: 'copy' or 'consumer'
    remote: bool = False  # the dataset reads s3:// or http(s):// objects (loader.io says how)


class LoaderResources:
    """The copy engine, copier, pinned pool, readers and stats of one loader (thread-safe)."""

    def __init__(self, settings: ResourceSettings):
        self.settings = settings
        self.stats = LoaderStats()
        self.copy_timer = CopyTimer(self.stats)
        self._lock = threading.Lock()
        self._engine: CopyEngine | None = None
        self._copier: ParallelCopier | None = None
        self._pool: PinnedPool | None = None
        self._io_path: fio.IoPath | None = None
        self._file_reader: readers.Reader | None = None
        self._slot_reader: readers.Reader | None = None
        self._registered: dict = {}  # data_ptr -> (bytes, the tensor, kept alive while registered)
        self.registration_declined: str | None = None  # why a tensor was not registered (stats.path)
        # Undone when these resources close or are collected unclosed: a tensor freed while its
        # pages stay registered leaves a stale registration that later allocations land in
        # (the driver then refuses copies to them: "invalid argument" at a user's .cpu()).
        self._engines: list = []  # the copy engine, once made: the finalizer waits for its stream
        self._release_registrations = self._registrations_finalizer()
        self.copy_route: str | None = None  # 'auto' routes: what native.CopyRouteChoice chose
        self.copy_route_trial = None  # the CopyRouteChoice still watching (epochs shorter than its batches)
        self._parked = None  # an ended epoch's native loop, for the next epoch (native._ParkedLoop)
        self._closed = False  # close() ran: a loop parked later is closed at once

    def _registrations_finalizer(self) -> weakref.finalize:
        """Releases ``_registered`` on close() or when these resources are collected (it holds
        the dict and the engine list, never ``self``)."""
        return weakref.finalize(self, _release_registrations, self._registered, self._engines)

    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def engine(self) -> CopyEngine:
        """Copies slots to the device on the loader's own stream and hands batches over."""
        with self._lock:
            if self._engine is None:
                self._engine = CopyEngine(
                    self.device,
                    pin_cpu_output=self.settings.pin_cpu_output,
                    output_stream=self.settings.output_stream,
                )
                self._engines.append(self._engine)
            return self._engine

    @property
    def copier(self) -> ParallelCopier:
        """Copies pageable fields into a slot with ``stage_threads`` threads."""
        with self._lock:
            if self._copier is None:
                self._copier = ParallelCopier(self.settings.stage_threads, self.settings.nontemporal)
            return self._copier

    @property
    def io(self) -> fio.IoPath:
        """The file-read path in effect for file-backed sources, and why."""
        with self._lock:
            return self._io_locked()

    def _io_locked(self) -> fio.IoPath:
        if self._io_path is None:
            s = self.settings
            self._io_path = fio.select(
                s.io_mode, s.device, s.o_direct, s.io_threads, s.io_task_size, s.map_budget, remote=s.remote
            )
        return self._io_path

    def file_reader(self) -> readers.Reader:
        """The reader of ``io``: file fields into the slot, or straight into device memory."""
        with self._lock:
            if self._file_reader is None:
                path = self._io_locked()
                self._file_reader = readers.make_reader(path)
                if self.settings.mapped_copy == "dma" and hasattr(self._file_reader, "mapped_by_kernel"):
                    self._file_reader.mapped_by_kernel = False
                self.stats.set_io(str(path))
            return self._file_reader

    def slot_reader(self) -> readers.Reader:
        """A reader into host slots, for sources that finish batches themselves (image decode
        reads the encoded bytes on the host: nvJPEG takes host bitstreams)."""
        with self._lock:
            if self._slot_reader is None:
                s = self.settings
                mode = "pinned" if s.io_mode == "pinned" else "posix"
                path = fio.select(mode, "cpu", s.o_direct, s.io_threads, s.io_task_size, 0, remote=s.remote)
                why = f"{path.why}; the source decodes from host memory (nvJPEG takes host bitstreams)"
                path = dataclasses.replace(path, why=why)
                self._slot_reader = readers.make_reader(path)
                self.stats.set_io(str(path))
            return self._slot_reader

    def readers(self) -> list[readers.Reader]:
        """The readers made so far."""
        with self._lock:
            return [r for r in (self._file_reader, self._slot_reader) if r is not None]

    @property
    def reads_to_device(self) -> bool:
        """Whether file fields already go straight to device memory (then slots hold only the
        small host fields, and a source's slot-size bound does not apply)."""
        with self._lock:
            return self._file_reader is not None and self._file_reader.path.to_device

    @property
    def pool(self) -> PinnedPool | None:
        """The pinned pool, once the first batch has sized it."""
        return self._pool

    def pool_for(self, nbytes: int, number: int, hint: int = 0, slots: int = 0) -> PinnedPool:
        """A pool whose slots hold ``nbytes`` (batch ``number``): made on first use with exact
        slots (or ``hint``, a source's bound), re-made larger when a batch outgrows it. ``slots``:
        at least that many (the option ``pool_slots`` otherwise), for a caller whose slots are
        small enough to give each batch in flight its own."""
        wanted = max(self.settings.pool_slots, slots)
        with self._lock:
            pool = self._pool
            if pool is not None and not pool.closed and nbytes <= pool.slot_bytes and wanted <= pool.num_slots:
                return pool
            regrow = pool is not None and not pool.closed
            if regrow and nbytes > pool.slot_bytes and self.settings.oversize == "error":
                raise BatchTooLargeError(number, nbytes, pool.slot_bytes)
            if regrow:
                pool.close(timeout=config.get("shutdown_timeout"))
                if not pool.closed:
                    raise PoolError("could not retire the old pool to grow it")
            if regrow and nbytes > pool.slot_bytes:
                slot_bytes = max(nbytes, int(pool.slot_bytes * POOL_GROWTH))
            else:  # the first pool, or more slots (of the size this caller asks, not the old one's)
                slot_bytes = max(nbytes, self.settings.slot_bytes or hint)
            pinned = self.device.type == "cuda"
            self._pool = PinnedPool(wanted, slot_bytes, pin=pinned)
            self.stats.set_pool(self._pool.num_slots, self._pool.slot_bytes, regrew=regrow)
            return self._pool

    def register_host(self, tensor: torch.Tensor) -> bool:
        """Pin an in-memory dataset tensor where it lies (``cudaHostRegister`` of its pages), so
        the copy engines read its rows straight into the batch with no CPU copy. Counts against
        ``map_budget`` with the mapped files; False (rows are then gathered by the CPU) past the
        budget or where registration fails. Loaders over the same tensor share one
        registration, undone when the last of them closes."""
        if self.device.type != "cuda" or tensor.device.type != "cpu":
            return False
        with self._lock:
            key = tensor.data_ptr()
            if key in self._registered:
                return True
            nbytes = tensor.numel() * tensor.element_size()
            if not tail_page_private(tensor):
                self.registration_declined = (
                    "its last page may hold other allocations (pinning it would make CUDA refuse "
                    "their copies), so its rows are gathered by the CPU"
                )
                return False
            mapped = getattr(self._file_reader, "mapped", None)
            used = sum(n for n, _ in self._registered.values()) + (mapped.pinned_bytes if mapped else 0)
            if nbytes == 0 or used + nbytes > self.settings.map_budget:
                return False
            device = self.device.index if self.device.index is not None else torch.cuda.current_device()
            if not _REGISTRATIONS.acquire(key, nbytes, device):
                return False
            if not self._release_registrations.alive:  # registering again after close()
                self._release_registrations = self._registrations_finalizer()
            self._registered[key] = (nbytes, tensor)
            return True

    def park(self, parked) -> None:
        """Keep an ended epoch's native loop for the next one (it has ``key`` and ``close()``);
        one a loader: a loop parked before is closed."""
        with self._lock:
            stale = [self._parked]
            if self._closed:  # an epoch that ended as close() ran: nothing stays parked
                stale.append(parked)
                parked = None
            self._parked = parked
        for loop in stale:
            if loop is not None:
                loop.close()

    def adopt(self, key):
        """The parked loop if its ``key`` equals ``key`` (taken: no longer parked), else None
        (a parked loop of another layout is closed first: its pinned slots go back to the pool).
        An epoch starting after close() (the loader iterated again) may park its loop again."""
        with self._lock:
            parked, self._parked = self._parked, None
            self._closed = False
        if parked is None or parked.key == key:
            return parked
        parked.close()
        return None

    def close_parked(self) -> None:
        """Stop a parked loop, if any (before anything else leases the pool's slots)."""
        self.park(None)

    def close(self) -> None:
        """Stop a parked loop, wait for copies in flight, then free the readers, the pool and the copier."""
        with self._lock:
            self._closed = True
        self.close_parked()
        timeout = config.get("shutdown_timeout")
        with self._lock:
            if self._engine is not None:
                self._engine.synchronize(timeout)
            for reader in (self._file_reader, self._slot_reader):
                if reader is not None:
                    reader.close(timeout)
            self._file_reader = self._slot_reader = None
            if self._pool is not None:
                self._pool.close(timeout=timeout)
                self._pool = None
            if self._copier is not None:
                self._copier.close()
                self._copier = None
            self._release_registrations()


#: glibc serves every allocation of at least this many bytes with a mapping of its own (its
#: dynamic mmap threshold never exceeds 32 MiB on 64-bit), whose last page nothing else shares.
_ALWAYS_OWN_MAPPING = 32 << 20


def tail_page_private(tensor: torch.Tensor) -> bool:
    """Whether registering ``tensor``'s pages in place is safe for the rest of the process. CUDA
    registers whole pages; a buffer of someone else's that starts in the tensor's last,
    partly used page and runs past it then straddles the registration's end, and every CUDA
    copy to or from it fails with "invalid argument" (a user's ``.cpu()``, torch's pinned
    copies) until the loader lets go. Safe where the tensor ends on a page boundary, where that
    page lies inside the tensor's own storage, or where the storage is large enough to be a
    mapping of its own."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if end % PAGE == 0:
        return True
    storage = tensor.untyped_storage()
    if -(-end // PAGE) * PAGE <= storage.data_ptr() + storage.nbytes():
        return True
    own_mappings = os.environ.get("MALLOC_MMAP_MAX_", "") != "0"  # 0: glibc never maps
    return own_mappings and storage.nbytes() >= _ALWAYS_OWN_MAPPING


class _HostRegistrations:
    """Process-wide ``cudaHostRegister`` of in-memory tensors' pages, counted per range: CUDA
    refuses to register a range twice, and one loader's close must not unpin memory another
    loader still copies from."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ranges: dict = {}  # (page start, bytes) -> users

    @staticmethod
    def _pages(key: int, nbytes: int) -> tuple[int, int]:
        start = key // PAGE * PAGE
        return start, -(-(key + nbytes) // PAGE) * PAGE - start

    def acquire(self, key: int, nbytes: int, device: int) -> bool:
        pages = self._pages(key, nbytes)
        with self._lock:
            if pages not in self._ranges:
                if engine.host_register(pages[0], pages[1], device) != 0:
                    return False  # e.g. pages shared with another registration
                self._ranges[pages] = [0, device]
            self._ranges[pages][0] += 1
            return True

    def release(self, key: int, nbytes: int) -> None:
        pages = self._pages(key, nbytes)
        with self._lock:
            users, device = self._ranges.get(pages, (1, None))
            if users > 1:
                self._ranges[pages][0] = users - 1
                return
            self._ranges.pop(pages, None)
            if device is None:
                return
            try:
                engine.host_unregister(pages[0], device)
            except Exception:  # interpreter shutdown may have torn CUDA down already
                pass


_REGISTRATIONS = _HostRegistrations()


def _release_registrations(registered: dict, engines: list) -> None:
    """Unregister a resources' tensors, then let them go (their memory is freed only after);
    copies on its stream finish first (bounded: shutdown_timeout)."""
    if registered and engines:
        try:
            engines[0].synchronize(config.get("shutdown_timeout"))
        except Exception:  # interpreter shutdown may have torn CUDA down already
            pass
    for key, (nbytes, _) in list(registered.items()):
        _REGISTRATIONS.release(key, nbytes)
    registered.clear()
