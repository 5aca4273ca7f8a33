"""Node features on storage: batched random row gathers for GNN training (issue 5, first part).

``FeatureStore(path)`` holds an on-disk ``(N, D)`` feature matrix (``.npy``, or a raw file
with ``shape`` and ``dtype``: float32, bfloat16, float16, ...). ``store.gather(ids)`` returns
the rows ``ids`` as one tensor on the store's device, in request order, from three tiers:

- ``cache``: hot rows kept in GPU memory (``cache_ids``, e.g. the highest-degree nodes),
  gathered by ``index_select`` on the GPU; hits and misses are counted (``store.stats()``);
- ``uva``: with ``pin=True`` the file's page-cache mapping is registered with CUDA and the
  GPU gathers rows straight out of host memory (zero-copy, no CPU copy), for matrices that
  fit in RAM;
- ``storage``: the rest. Ids are sorted and deduplicated and mapped to the aligned 4 KiB
  pages holding their rows; the C++ engine reads those pages in parallel (neighbours
  coalesced; ``o_direct`` for data larger than the page cache) into a pinned buffer, one H2D
  copy moves it, and one gather on the GPU cuts every row out of its page straight into
  request order (duplicates included).

``path`` may be an ``s3://`` / ``http(s)://`` URL: the storage tier's pages are then range
requests of the remote reader (``cache_dir``: the whole matrix kept on local disk once read),
and the uva tier is off (it maps a local file). ``close()`` stops the reader's threads.

Ids are validated first: out of range, negative or non-integer ids raise with the values;
nothing is clipped. Left for the rest of issue 5: prefetching the next mini-batches' gathers,
PyG's FeatureStore interface and a neighbour sampler, examples/gnn_sage.py, the benchmark.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import engine, fileio
from ..errors import FastloadError
from ..remote import RemoteReader, is_url, open_object
from .arrays import ArrayFormatError, _torch_dtype, read_npy_header

__all__ = ["FeatureStore", "FeatureStoreError", "GatherStats"]

#: reads are whole aligned pages (what O_DIRECT needs; neighbouring rows share one read)
PAGE = 4096


class FeatureStoreError(FastloadError, ValueError):
    """Bad ids, a bad feature file or a cache that cannot be held."""


@dataclass
class GatherStats:
    gathers: int = 0
    rows: int = 0
    unique_rows: int = 0
    cache_hits: int = 0
    uva_rows: int = 0
    storage_rows: int = 0
    storage_bytes: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hits / self.unique_rows if self.unique_rows else 0.0


class FeatureStore:
    """An ``(N, D)`` feature matrix on storage, gathered by row ids onto ``device``."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device=None,
        cache_ids=None,
        pin: bool | str = False,
        o_direct: bool = False,
        io_threads: int | None = None,
        cache_dir: str | None = None,
    ):
        self.path = os.fspath(path)
        self.remote = open_object(self.path, cache_dir) if is_url(self.path) else None
        # a local file as opened (regular files only): checked after every read from storage
        self.file_pin = fileio.pin(self.path) if self.remote is None else None
        self.remote_objects = [self.remote] if self.remote is not None else []
        self._remote_reader: RemoteReader | None = None
        if self.path.split("?", 1)[0].endswith(".npy"):
            np_dtype, file_shape, self.offset = read_npy_header(self.path, self.remote)
            if len(file_shape) != 2:
                raise ArrayFormatError(self.path, f"a feature matrix is 2-D (N, D), got shape {file_shape}")
            self.dtype = _torch_dtype(np_dtype)
            self.shape = tuple(int(s) for s in file_shape)
        else:
            if shape is None or dtype is None or len(shape) != 2:
                raise FeatureStoreError(f"'{self.path}': a raw feature file needs shape=(N, D) and dtype")
            self.shape, self.dtype, self.offset = (int(shape[0]), int(shape[1])), dtype, 0
            size = self.remote.size if self.remote is not None else self.file_pin.size
            needed = self.shape[0] * self.shape[1] * dtype.itemsize
            if size < needed:
                raise ArrayFormatError(
                    self.path, f"shape {self.shape} of {dtype} needs {needed} bytes, the file has {size}"
                )
        self.num_nodes, self.dim = self.shape
        self.file_size = self.remote.size if self.remote is not None else self.file_pin.size
        self.row_bytes = self.dim * self.dtype.itemsize
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.o_direct = bool(o_direct)
        self.io_threads = io_threads
        self._stats = GatherStats()
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pinned: torch.Tensor | None = None
        self._cache_slot = None  # int32 (N,) host: cache row of each node, -1 if not cached
        self._cache_slot_device: torch.Tensor | None = None
        self.cache: torch.Tensor | None = None
        if cache_ids is not None:
            self._build_cache(cache_ids)
        self._mapped = None
        self._host_rows: torch.Tensor | None = None
        self.pin_reason = self._pin_choice(pin)
        if self.pin_reason.startswith("pinned"):
            self._map_for_uva()

    # -- ids ------------------------------------------------------------------------------
    def check_ids(self, ids) -> np.ndarray:
        """ids as int64 numpy, refusing anything that is not an in-range integer id."""
        if isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
                raise FeatureStoreError(f"node ids must be integers, got a {ids.dtype} tensor")
            ids = ids.detach().cpu().numpy()
        array = np.asarray(ids)
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if array.dtype.kind not in "iu":
            raise FeatureStoreError(f"node ids must be integers, got dtype {array.dtype}")
        array = array.astype(np.int64, copy=False).reshape(-1)
        if len(array):
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.num_nodes:
                bad = array[(array < 0) | (array >= self.num_nodes)]
                raise FeatureStoreError(
                    f"node ids {bad[:5].tolist()}{' ...' if len(bad) > 5 else ''} "
                    f"({len(bad)} in all) are outside [0, {self.num_nodes}) of '{self.path}'"
                )
        return array

    # -- tiers ----------------------------------------------------------------------------
    def _build_cache(self, cache_ids) -> None:
        ids = np.unique(self.check_ids(cache_ids))
        need = len(ids) * self.row_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise FeatureStoreError(
                    f"a cache of {len(ids)} rows x {self.row_bytes} bytes = {need / 2**30:.2f} "
                    f"GiB does not fit in the {free / 2**30:.2f} GiB free on {self.device}"
                )
        with self._lock:
            self.cache = self._rows_from_storage(ids, np.arange(len(ids)), torch.device("cpu")).to(self.device)
        self._cache_slot = np.full(self.num_nodes, -1, dtype=np.int32)
        self._cache_slot[ids] = np.arange(len(ids), dtype=np.int32)

    def _pin_choice(self, pin) -> str:
        """Whether the uva tier is used, and why (``pin``: True, False or "auto")."""
        if self.remote is not None:
            if pin is True:
                raise FeatureStoreError("pin=True maps a local file; the features are a remote object")
            return "not pinned: the features are a remote object"
        if pin == "auto":
            from .. import config

            budget = config.get("map_budget")
            if self.device.type != "cuda":
                return "not pinned: auto, and the device is not a GPU"
            if self.o_direct:
                return "not pinned: auto, and o_direct asks to leave the page cache alone"
            if self.file_size > budget:
                return (
                    f"not pinned: auto, and the file ({self.file_size / 2**30:.2f} GiB) exceeds map_budget "
                    f"({budget / 2**30:.2f} GiB)"
                )
            return (
                f"pinned: auto, the file ({self.file_size / 2**30:.2f} GiB) fits map_budget ({budget / 2**30:.2f} GiB)"
            )
        if pin not in (True, False):
            raise FeatureStoreError(f"pin must be True, False or 'auto', got {pin!r}")
        return "pinned: pin=True" if pin else "not pinned: pin=False"

    def _map_for_uva(self) -> None:
        if self.device.type != "cuda":
            raise FeatureStoreError("pin=True (zero-copy gathers by the GPU) needs a CUDA device")
        from .. import uva

        self._mapped = engine._require().MappedFile(self.path)  # mmap + cudaHostRegister(READ_ONLY)
        total = self.num_nodes * self.row_bytes
        flat = uva.host_view(self._mapped.data_ptr + self.offset, total, self.device)
        self._host_rows = flat.view(self.dtype).view(self.num_nodes, self.dim)

    # -- reads ----------------------------------------------------------------------------
    def _plan_pages(self, unique_ids: np.ndarray):
        """The aligned pages holding rows ``unique_ids`` (sorted): ``(pages, row_element)`` where
        ``pages`` are the file's page numbers, read back to back, and ``row_element[i]`` is where
        row i starts in that buffer, in elements of the dtype."""
        start = self.offset + unique_ids * self.row_bytes
        first = start // PAGE
        last = (start + self.row_bytes - 1) // PAGE
        counts = last - first + 1
        if int(counts.max()) == 1:  # ids are sorted, so pages are too: drop repeats without a sort
            pages = first[np.concatenate(([True], first[1:] != first[:-1]))]
        else:  # rows spanning pages: every page they touch
            total = int(counts.sum())
            base = np.repeat(first, counts)
            within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            pages = np.unique(base + within)
        at = np.searchsorted(pages, first)  # a row's pages are consecutive in the buffer too
        row_byte = at * PAGE + (start - first * PAGE)
        return pages, row_byte // self.dtype.itemsize

    def _read_pages(self, pages: np.ndarray, buffer: torch.Tensor) -> int:
        """Pages ``pages`` of the file into ``buffer`` back to back (the last one cut at EOF)."""
        offsets = pages * PAGE
        lengths = np.minimum(PAGE, self.file_size - offsets)
        at = np.arange(len(pages), dtype=np.int64) * PAGE
        if self.remote is not None:
            if self._remote_reader is None:  # under _lock: every storage read holds it
                self._remote_reader = RemoteReader()
                weakref.finalize(self, self._remote_reader.close)
            self._remote_reader.read(
                buffer, [self.path], np.zeros(len(pages), np.int64), offsets, lengths, at, local=self._read_local
            )
            return int(lengths.sum())
        try:
            engine.read_ranges(
                self.path, None, offsets, lengths, buffer, at, num_threads=self.io_threads, o_direct=self.o_direct
            )
        except Exception as exc:  # a file that changed explains a short or out-of-range read
            fileio.check_unchanged(self.path, self.file_pin, cause=exc)
            raise
        fileio.check_unchanged(self.path, self.file_pin)  # replaced before or while it was read
        return int(lengths.sum())

    def _read_local(self, dst, paths, file_index, offsets, lengths, dst_offsets) -> dict:
        """The shard cache's copy of a remote matrix, read by the engine."""
        engine.read_ranges(
            paths, file_index, offsets, lengths, dst, dst_offsets, num_threads=self.io_threads, o_direct=self.o_direct
        )
        return {"remote-cache": int(lengths.sum())}

    def close(self) -> None:
        """Stop the remote reader's threads (a local store holds none)."""
        reader, self._remote_reader = self._remote_reader, None
        if reader is not None:
            reader.close()

    def _rows_from_storage(self, unique_ids: np.ndarray, select: np.ndarray, device: torch.device) -> torch.Tensor:
        """Rows ``unique_ids[select]`` on ``device``: the engine reads the aligned 4 KiB pages
        holding them (neighbouring pages coalesced; what O_DIRECT needs, and fewer reads than
        one per row where rows share pages) into the pinned buffer, one copy moves the
        buffer, one gather on the device cuts the rows out of their pages."""
        pages, row_element = self._plan_pages(unique_ids)
        buffer = self._pinned_buffer(len(pages) * PAGE)
        self._stats.storage_bytes += self._read_pages(pages, buffer)
        moved = buffer.to(device, non_blocking=True) if device.type == "cuda" else buffer
        elements = moved.view(self.dtype)
        windows = elements.as_strided((elements.numel() - self.dim + 1, self.dim), (1, 1))
        index = torch.from_numpy(row_element[select]).to(device, non_blocking=True)
        return windows.index_select(0, index)

    def reserve(self, ids_per_gather: int) -> None:
        """Allocate the pinned buffer for gathers of up to ``ids_per_gather`` ids now (pinning
        costs ~1 GB/s; done lazily, the first gathers would pay for it)."""
        pages_per_row = 1 + -(-self.row_bytes // PAGE)
        self._pinned_buffer(int(ids_per_gather) * pages_per_row * PAGE)

    def _pinned_buffer(self, nbytes: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.numel() < nbytes:
            size = 1 << max(20, math.ceil(math.log2(max(nbytes, 1))))
            self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._pinned[:nbytes]

    def gather(self, ids) -> torch.Tensor:
        """Rows ``ids`` (any integer array or tensor) as ``(len(ids), D)`` on the device, in order."""
        ids = self.check_ids(ids)
        if not len(ids):
            return torch.empty((0, self.dim), dtype=self.dtype, device=self.device)
        cuda = self.device.type == "cuda"
        if cuda and (self.cache is not None or self._host_rows is not None):
            return self._gather_on_device(ids)
        unique, inverse = np.unique(ids, return_inverse=True)
        with self._lock:  # one gather at a time uses the pinned buffer
            out_unique = torch.empty((len(unique), self.dim), dtype=self.dtype, device=self.device)
            if self._cache_slot is not None:
                slots = self._cache_slot[unique]
                hit = slots >= 0
            else:
                slots, hit = None, np.zeros(len(unique), dtype=bool)
            miss = np.flatnonzero(~hit)
            stream = self._stream
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                if cuda:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                if hit.any():
                    at = torch.from_numpy(np.flatnonzero(hit)).to(self.device, non_blocking=True)
                    src = torch.from_numpy(slots[hit].astype(np.int64)).to(self.device, non_blocking=True)
                    out_unique.index_copy_(0, at, self.cache.index_select(0, src))
                if len(miss) and self._host_rows is not None:
                    at = torch.from_numpy(miss).to(self.device, non_blocking=True)
                    rows = torch.from_numpy(unique[miss]).to(self.device, non_blocking=True)
                    out_unique.index_copy_(0, at, self._host_rows.index_select(0, rows))  # zero-copy UVA
                elif len(miss) == len(unique):  # storage only: one gather straight into request order
                    out_unique = None
                    result = self._rows_from_storage(unique, inverse.reshape(-1), self.device)
                elif len(miss):
                    at = torch.from_numpy(miss).to(self.device, non_blocking=True)
                    out_unique.index_copy_(
                        0, at, self._rows_from_storage(unique[miss], np.arange(len(miss)), self.device)
                    )
                if out_unique is not None:
                    result = out_unique.index_select(
                        0, torch.from_numpy(inverse.reshape(-1)).to(self.device, non_blocking=True)
                    )
                if cuda:
                    done = torch.cuda.Event()
                    done.record(stream)
            if cuda:
                torch.cuda.current_stream(self.device).wait_event(done)
                result.record_stream(torch.cuda.current_stream(self.device))
                done.synchronize()  # the pinned buffer is reused by the next gather
            self._count(len(ids), len(unique), int(hit.sum()), len(miss))
        return result

    def _gather_on_device(self, ids: np.ndarray) -> torch.Tensor:
        """The cache and uva tiers on the GPU: ids deduplicated by ``torch.unique`` and looked up
        in a device copy of the cache-slot table (numpy's sort of a million ids takes ~70 ms on
        the host, the GPU's ~1 ms). Misses come from the uva tier, or go back to the host for
        the storage tier's page reads."""
        device = self.device
        current = torch.cuda.current_stream(device)
        stream = self._stream
        with self._lock:
            with torch.cuda.stream(stream):
                stream.wait_stream(current)
                device_ids = torch.from_numpy(ids).to(device, non_blocking=True)
                unique, inverse = torch.unique(device_ids, return_inverse=True)
                misses, miss_at, hits = unique, None, 0
                out_unique = None
                if self.cache is not None:
                    out_unique = torch.empty((unique.numel(), self.dim), dtype=self.dtype, device=device)
                    slots = self._device_cache_slots()[unique]
                    hit = slots >= 0
                    hit_at = hit.nonzero().squeeze(1)
                    hits = hit_at.numel()
                    if hits:
                        out_unique.index_copy_(0, hit_at, self.cache.index_select(0, slots[hit_at].long()))
                    miss_at = (~hit).nonzero().squeeze(1)
                    misses = unique[miss_at]
                from_storage = bool(misses.numel()) and self._host_rows is None
                if misses.numel():
                    if self._host_rows is not None:
                        rows = self._host_rows.index_select(0, misses)  # zero-copy UVA
                    else:
                        wanted = misses.cpu().numpy()  # sorted: unique's order
                        rows = self._rows_from_storage(wanted, np.arange(len(wanted)), device)
                    if out_unique is None:
                        out_unique = rows
                    else:
                        out_unique.index_copy_(0, miss_at, rows)
                result = out_unique.index_select(0, inverse)
                done = torch.cuda.Event()
                done.record(stream)
            current.wait_event(done)
            result.record_stream(current)
            if from_storage:
                done.synchronize()  # the pinned buffer is reused by the next gather
            self._count(len(ids), unique.numel(), hits, misses.numel())
        return result

    def _count(self, rows: int, unique: int, hits: int, misses: int) -> None:
        """One gather in the stats (under ``_lock``); misses went to the uva tier or to storage."""
        s = self._stats
        s.gathers += 1
        s.rows += rows
        s.unique_rows += unique
        s.cache_hits += hits
        if self._host_rows is not None:
            s.uva_rows += misses
        else:
            s.storage_rows += misses

    def _device_cache_slots(self) -> torch.Tensor:
        """The cache-slot table on the GPU (int32, 4 bytes a node), made on first use."""
        if self._cache_slot_device is None:
            self._cache_slot_device = torch.from_numpy(self._cache_slot).to(self.device)
        return self._cache_slot_device

    def stats(self, reset: bool = False) -> GatherStats:
        with self._lock:
            snapshot = GatherStats(**vars(self._stats))
            if reset:
                self._stats = GatherStats()
        return snapshot

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        tiers = [
            t
            for t, on in (("cache", self.cache is not None), ("uva", self._host_rows is not None), ("storage", True))
            if on
        ]
        return f"FeatureStore('{self.path}', {self.num_nodes} x {self.dim} {self.dtype}, {'+'.join(tiers)})"
