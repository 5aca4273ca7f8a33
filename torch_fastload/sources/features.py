"""Node features on storage: batched random row gathers for GNN training (issue 5, first part).

``FeatureStore(path)`` holds an on-disk ``(N, D)`` feature matrix (``.npy``, or a raw file
with ``shape`` and ``dtype``: float32, bfloat16, float16, ...). ``store.gather(ids)`` returns
the rows ``ids`` as one tensor on the store's device, in request order, from three tiers:

- ``cache``: hot rows kept in GPU memory (``cache_ids``, e.g. the highest-degree nodes),
  gathered by ``index_select`` on the GPU; hits and misses are counted (``store.stats()``);
- ``uva``: with ``pin=True`` the file's page-cache mapping is registered with CUDA and the
  GPU gathers rows straight out of host memory (zero-copy, no CPU copy), for matrices that
  fit in RAM;
- ``storage``: the rest. Ids are sorted and deduplicated, each unique row is one range, the
  C++ engine reads them in parallel (coalescing neighbours, ``o_direct`` for data larger
  than the page cache) into a pinned buffer, one H2D copy moves them, and an
  ``index_select`` on the GPU puts them back in request order (duplicates included).

Ids are validated first: out of range, negative or non-integer ids raise with the values;
nothing is clipped. Left for the rest of issue 5: prefetching the next mini-batches' gathers,
PyG's FeatureStore interface and a neighbour sampler, examples/gnn_sage.py, the benchmark.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .. import engine
from ..errors import FastloadError
from .arrays import ArrayFormatError, _torch_dtype, read_npy_header

__all__ = ["FeatureStore", "FeatureStoreError", "GatherStats"]

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

    def __init__(self, path: str | os.PathLike, *, shape: Optional[Sequence[int]] = None,
                 dtype: Optional[torch.dtype] = None, device=None, cache_ids=None, pin: bool = False,
                 o_direct: bool = False, io_threads: Optional[int] = None):
        self.path = os.fspath(path)
        if self.path.endswith(".npy"):
            np_dtype, file_shape, self.offset = read_npy_header(self.path)
            if len(file_shape) != 2:
                raise ArrayFormatError(self.path, f"a feature matrix is 2-D (N, D), got shape {file_shape}")
            self.dtype = _torch_dtype(np_dtype)
            self.shape = tuple(int(s) for s in file_shape)
        else:
            if shape is None or dtype is None or len(shape) != 2:
                raise FeatureStoreError(f"'{self.path}': a raw feature file needs shape=(N, D) and dtype")
            self.shape, self.dtype, self.offset = (int(shape[0]), int(shape[1])), dtype, 0
            size = os.stat(self.path).st_size
            needed = self.shape[0] * self.shape[1] * dtype.itemsize
            if size < needed:
                raise ArrayFormatError(self.path, f"shape {self.shape} of {dtype} needs {needed} bytes, the file "
                                                  f"has {size}")
        self.num_nodes, self.dim = self.shape
        self.row_bytes = self.dim * self.dtype.itemsize
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.o_direct = bool(o_direct)
        self.io_threads = io_threads
        self._stats = GatherStats()
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pinned: Optional[torch.Tensor] = None
        self._cache_slot = None  # int32 (N,) host: cache row of each node, -1 if not cached
        self.cache: Optional[torch.Tensor] = None
        if cache_ids is not None:
            self._build_cache(cache_ids)
        self._mapped = None
        self._host_rows: Optional[torch.Tensor] = None
        if pin:
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
                raise FeatureStoreError(f"node ids {bad[:5].tolist()}{' ...' if len(bad) > 5 else ''} "
                                        f"({len(bad)} in all) are outside [0, {self.num_nodes}) of '{self.path}'")
        return array

    # -- tiers ----------------------------------------------------------------------------
    def _build_cache(self, cache_ids) -> None:
        ids = np.unique(self.check_ids(cache_ids))
        need = len(ids) * self.row_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise FeatureStoreError(f"a cache of {len(ids)} rows x {self.row_bytes} bytes = {need / 2**30:.2f} "
                                        f"GiB does not fit in the {free / 2**30:.2f} GiB free on {self.device}")
        rows = self._read_rows(ids)
        self.cache = rows.to(self.device)
        self._cache_slot = np.full(self.num_nodes, -1, dtype=np.int32)
        self._cache_slot[ids] = np.arange(len(ids), dtype=np.int32)

    def _map_for_uva(self) -> None:
        if self.device.type != "cuda":
            raise FeatureStoreError("pin=True (zero-copy gathers by the GPU) needs a CUDA device")
        from .. import uva

        self._mapped = engine._require().MappedFile(self.path)  # mmap + cudaHostRegister(READ_ONLY)
        total = self.num_nodes * self.row_bytes
        flat = uva.host_view(self._mapped.data_ptr + self.offset, total, self.device)
        self._host_rows = flat.view(self.dtype).view(self.num_nodes, self.dim)

    # -- reads ----------------------------------------------------------------------------
    def _read_rows(self, unique_ids: np.ndarray, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``unique_ids`` (sorted) read by the engine into ``out`` (a host tensor)."""
        n = len(unique_ids)
        if out is None:
            out = torch.empty((n, self.dim), dtype=self.dtype)
        offsets = self.offset + unique_ids * self.row_bytes
        if n:
            engine.read_ranges(self.path, None, offsets, np.full(n, self.row_bytes, dtype=np.int64),
                               out.view(torch.uint8).view(-1), num_threads=self.io_threads, o_direct=self.o_direct)
        return out

    def _pinned_buffer(self, rows: int) -> torch.Tensor:
        need = rows * self.row_bytes
        if self._pinned is None or self._pinned.numel() < need:
            size = 1 << max(20, math.ceil(math.log2(max(need, 1))))
            self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._pinned[:need].view(self.dtype).view(rows, self.dim)

    def gather(self, ids) -> torch.Tensor:
        """Rows ``ids`` (any integer array or tensor) as ``(len(ids), D)`` on the device, in order."""
        ids = self.check_ids(ids)
        unique, inverse = np.unique(ids, return_inverse=True)
        cuda = self.device.type == "cuda"
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
                elif len(miss):
                    staged = self._read_rows(unique[miss], self._pinned_buffer(len(miss)))
                    moved = staged.to(self.device, non_blocking=True)
                    if len(miss) == len(unique):
                        out_unique = moved
                    else:
                        at = torch.from_numpy(miss).to(self.device, non_blocking=True)
                        out_unique.index_copy_(0, at, moved)
                result = out_unique.index_select(0, torch.from_numpy(inverse.reshape(-1)).to(self.device,
                                                                                             non_blocking=True))
                if cuda:
                    done = torch.cuda.Event()
                    done.record(stream)
            if cuda:
                torch.cuda.current_stream(self.device).wait_event(done)
                result.record_stream(torch.cuda.current_stream(self.device))
                done.synchronize()  # the pinned buffer is reused by the next gather
            s = self._stats
            s.gathers += 1
            s.rows += len(ids)
            s.unique_rows += len(unique)
            s.cache_hits += int(hit.sum())
            if self._host_rows is not None:
                s.uva_rows += len(miss)
            else:
                s.storage_rows += len(miss)
                s.storage_bytes += len(miss) * self.row_bytes
        return result

    def stats(self, reset: bool = False) -> GatherStats:
        with self._lock:
            snapshot = GatherStats(**vars(self._stats))
            if reset:
                self._stats = GatherStats()
        return snapshot

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        tiers = [t for t, on in (("cache", self.cache is not None), ("uva", self._host_rows is not None),
                                 ("storage", True)) if on]
        return f"FeatureStore('{self.path}', {self.num_nodes} x {self.dim} {self.dtype}, {'+'.join(tiers)})"
