"""The concurrent range reader: a batch's ranges of remote objects into a slot or GPU memory.

A batch's ranges are coalesced (neighbours in the object and in the destination), ranges of
an object less than ``MERGE_GAP`` apart joined into one request (the gaps read and dropped,
never more than the bytes used + ``MERGE_SLACK``),
long ones cut into requests of at most ``remote_request_size`` bytes (smaller, down to
``MIN_PIECE``, where a batch has too few bytes to give every connection one), and the requests run
``remote_concurrency`` at a time on the reader's threads, each response read straight into
its place in the destination (a host slot; for a GPU destination a pinned bounce buffer, then
copies on the current stream). Every request is retried and checked (``client.py``); a
failed request cancels the batch's queued ones, waits for those in flight and raises, so no
partly filled batch is returned.

Objects opened with a shard cache (``cache_dir``) are read from it once cached, through the
local read path; a miss schedules the whole object for a background fill while the batch reads
its ranges remotely. (An epoch that starts with every object cached does not come here: the
loader runs it on the cache entries as local files, ``epoch.py``.)

``remote_backend='kvikio'`` reads with kvikio's ``RemoteFile`` (its own thread pool and
retries; it needs libcuda), checking each object's version with a HEAD after the batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import numpy as np
import torch

from .. import config
from .ahead import AheadReads
from .client import Client, count
from .objects import RemoteObject, check_ranges, opened
from .pool import BATCH, FILL, RequestPool, wait_all
from .url import is_url, parse

__all__ = ["RemoteReader", "describe_settings", "backend_in_effect", "plan_requests", "MERGE_GAP"]

log = logging.getLogger("torch_fastload")

#: ranges of one object closer than this may share a request (a request costs more than
#: reading the gap), as long as the bytes dropped stay under the bytes used + MERGE_SLACK
MERGE_GAP = 256 << 10
MERGE_SLACK = 64 << 10
#: the smallest piece a long range is cut into to spread a batch over the reader's
#: connections (kvikio's RemoteFile task size): a batch of fewer bytes than
#: ``SPREAD x remote_request_size`` is cut into ~``SPREAD`` requests of at least this size
#: rather than a few of ``remote_request_size`` that leave most connections idle (one 16 MiB
#: batch: one request, one connection's rate after the round trip)
MIN_PIECE = 4 << 20
#: requests a batch is spread over at most (fewer where ``concurrency`` is lower): past ~16
#: streams more, smaller requests only add per-request cost (2-core loopback, 256 MiB batch at
#: 64 x 16 MiB: 16 requests 3.6 GB/s, cut into 64 of 4 MiB 2.9 GB/s)
SPREAD = 16
#: seconds a cache hit is trusted without another stat + LRU touch (a batch's stat and utime
#: cost ~10% of a cache-hit batch read)
HIT_MEMORY = 1.0


def backend_in_effect(requested: str | None = None) -> tuple[str, str]:
    """``(backend, why)``: 'http' or 'kvikio' for ``remote_backend`` (None: configured)."""
    requested = config.resolve("remote_backend", requested)
    if requested in ("auto", "http"):
        why = "asked for" if requested == "http" else "auto: the range reader (kvikio only where asked)"
        return "http", why
    from .kvikio_backend import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise ValueError(f"remote_backend='kvikio' cannot run here: {reason}")
    return "kvikio", "asked for"


def describe_settings(backend: str | None = None) -> str:
    """One line on how remote objects are read with the settings in effect."""
    name, why = backend_in_effect(backend)
    cache = config.get("remote_cache_dir")
    return (
        f"remote-{name} ({config.get('remote_concurrency')} requests x "
        f"{config.get('remote_request_size') / 2**20:g} MiB in flight, {config.get('remote_retries')} retries, "
        f"timeout {config.get('remote_timeout'):g} s; {why})"
        + (f"; shard cache {cache} ({config.get('remote_cache_limit') / 2**30:.1f} GiB)" if cache else "")
    )


def _subset(paths, file_index, arrays, keep):
    """The ranges ``keep`` (a mask) with their paths renumbered: ``(paths, file_index, *arrays)``."""
    used = np.unique(file_index[keep])
    remap = np.zeros(len(paths), dtype=np.int64)
    remap[used] = np.arange(len(used))
    return [paths[i] for i in used.tolist()], remap[file_index[keep]], *(a[keep] for a in arrays)


class RemoteReader:
    """Reads ranges of remote objects for one loader (or one FeatureStore); ``close`` it."""

    def __init__(self, concurrency=None, request_size=None, backend=None, timeout=None, retries=None, read_ahead=None):
        self.concurrency = config.resolve("remote_concurrency", concurrency)
        self.request_size = config.resolve("remote_request_size", request_size)
        self.backend, self.why = backend_in_effect(backend)
        self.client = Client(timeout=timeout, retries=retries)
        self.pool = RequestPool(self.concurrency)
        self.ahead = AheadReads(self, config.resolve("remote_read_ahead", read_ahead))
        self._kvikio = None
        if self.backend == "kvikio":
            from .kvikio_backend import KvikioRemote

            self._kvikio = KvikioRemote(self.client, self.concurrency, self.request_size)
        self._lock = threading.Lock()
        self._closed = False
        self._filling: set = set()
        self._fills: queue.Queue = queue.Queue()
        self._filler: threading.Thread | None = None
        self._hits: dict = {}  # url -> (cache entry, until when it is trusted without a stat)

    @property
    def mode(self) -> str:
        return f"remote-{self.backend}"

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- a batch --------------------------------------------------------------------------
    def read_fields(self, dst: torch.Tensor, reads, local: Callable | None = None) -> dict[str, int]:
        """A batch's file fields ``reads`` (``(offset in dst, PendingRead)``) into ``dst``: those
        read ahead (``ahead.py``) from their entries, the rest now (``read``). Returns the bytes
        moved per path; on an error no entry of the batch is left in flight."""
        from .. import readers  # readers imports this package

        taken = [(at, self.ahead.take(read)) for at, read in reads]
        rest = [(at, read) for (at, read), (_, entry) in zip(reads, taken) if entry is None]
        waiting = [(at, entry) for at, entry in taken if entry is not None]
        try:
            moved = self.read(dst, *readers.batch_ranges(rest), local=local) if rest else {}
            while waiting:
                at, entry = waiting[0]
                n = entry.copy_into(dst, at)
                waiting.pop(0)
                moved[self.mode] = moved.get(self.mode, 0) + n
        finally:
            for _, entry in waiting:
                entry.cancel()
        return moved

    def read(
        self, dst: torch.Tensor, paths, file_index, offsets, lengths, dst_offsets, local: Callable | None = None
    ) -> dict[str, int]:
        """Ranges ``(file_index, offsets, lengths)`` of ``paths`` into ``dst`` (uint8, 1-D) at
        ``dst_offsets``. Local paths and cached objects go to ``local`` (same arguments,
        returning bytes per path). Returns the bytes moved per path."""
        arrays = (offsets, lengths, dst_offsets)
        remote = np.array([is_url(p) for p in paths], dtype=bool)
        on_remote = remote[file_index] if len(file_index) else np.zeros(0, dtype=bool)
        moved: dict[str, int] = {}
        if (~on_remote).any():
            _add(moved, local(dst, *_subset(paths, file_index, arrays, ~on_remote)))
        if not on_remote.any():
            return moved
        paths, file_index, offsets, lengths, dst_offsets = _subset(paths, file_index, arrays, on_remote)
        objects = [opened(p) for p in paths]
        check_ranges(objects, file_index, offsets, lengths)
        cached = self._cached_paths(objects)
        hit = cached[file_index] != ""
        if hit.any() and local is not None:
            local_paths = [c or o.url for c, o in zip(cached, objects)]
            try:
                got = local(dst, *_subset(local_paths, file_index, (offsets, lengths, dst_offsets), hit))
                moved["remote-cache"] = sum(got.values())
                count(cache_hits=1)
                file_index, offsets, lengths, dst_offsets = (
                    a[~hit] for a in (file_index, offsets, lengths, dst_offsets)
                )
            except FileNotFoundError:  # evicted by another process meanwhile: read remotely
                self._hits.clear()
        if len(offsets):
            moved[self.mode] = self._fetch(dst, objects, file_index, offsets, lengths, dst_offsets)
        return moved

    def _cached_paths(self, objects: list[RemoteObject]) -> np.ndarray:
        """The cache entry of each object ("" where none), scheduling fills for misses."""
        out = np.full(len(objects), "", dtype=object)
        now = time.monotonic()
        for i, obj in enumerate(objects):
            cache = obj.cache()
            if cache is None:
                continue
            known = self._hits.get(obj.url)
            if known is not None and known[1] > now:  # looked up (and touched) less than a second ago
                out[i] = known[0]
                continue
            path = cache.lookup(obj)
            if path is not None:
                out[i] = path
                self._hits[obj.url] = (path, now + HIT_MEMORY)
            else:
                self._schedule_fill(obj)
        return out

    def _fetch(self, dst, objects, file_index, offsets, lengths, dst_offsets) -> int:
        if dst.device.type == "cpu":
            self._fetch_host(dst.numpy(), objects, file_index, offsets, lengths, dst_offsets, BATCH)
            return int(lengths.sum())
        order = np.argsort(dst_offsets, kind="stable")
        file_index, offsets, lengths, dst_offsets = (a[order] for a in (file_index, offsets, lengths, dst_offsets))
        at = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=at[1:])
        total = int(lengths.sum())
        bounce = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._fetch_host(bounce.numpy(), objects, file_index, offsets, lengths, at, BATCH)
        starts = np.flatnonzero(np.concatenate(([True], dst_offsets[1:] != dst_offsets[:-1] + lengths[:-1])))
        ends = np.append(starts[1:], len(lengths))
        for s, e in zip(starts.tolist(), ends.tolist()):
            n = int(at[e - 1] + lengths[e - 1] - at[s])
            d = int(dst_offsets[s])
            dst[d : d + n].copy_(bounce[int(at[s]) : int(at[s]) + n], non_blocking=True)
        return total

    def _fetch_host(self, host: np.ndarray, objects, file_index, offsets, lengths, dst_offsets, priority) -> None:
        """Every range into ``host``, or raise once no request writes into it any more."""
        if self._kvikio is not None and priority == BATCH:
            self._kvikio.read(host, objects, file_index, offsets, lengths, dst_offsets)
            return
        futures: list = []
        try:
            self.submit_host(futures, host, objects, file_index, offsets, lengths, dst_offsets, priority)
        finally:
            wait_all(futures)

    def submit_host(
        self, futures: list, host, objects, file_index, offsets, lengths, dst_offsets, priority, spread: bool = True
    ) -> None:
        """Queue the requests of every range into ``host``, their futures appended to ``futures``
        (those queued before a failure to queue more are there too). ``spread``: a batch of few
        bytes is cut into pieces for several connections (``plan_requests``); read-ahead batches
        are not (the batches around them keep the connections busy, and pieces of
        ``remote_request_size`` put more bytes behind each request's latency)."""
        from .. import readers  # readers imports this package

        ranges = readers.coalesce(file_index, offsets, lengths, dst_offsets)
        locs = [parse(o.url) for o in objects]
        spread_over = self.concurrency if spread else None
        for k, offset, length, at, parts in plan_requests(*ranges, self.request_size, spread_over):
            obj = objects[k]
            if parts is None:
                out = host[at : at + length]
                call = (self.client.read_range, locs[k], obj.size, obj.version, offset, out)
            else:
                call = (self._read_scattered, locs[k], obj, offset, length, host, parts)
            futures.append(self.pool.submit(priority, *call))

    def _read_scattered(self, loc, obj, offset: int, length: int, host: np.ndarray, parts) -> None:
        """One request spanning several ranges (and the gaps between), cut into place."""
        span = np.empty(length, dtype=np.uint8)
        self.client.read_range(loc, obj.size, obj.version, offset, span)
        for start, at, n in parts:
            host[at : at + n] = span[start : start + n]

    # -- the shard cache ------------------------------------------------------------------
    def _schedule_fill(self, obj: RemoteObject) -> None:
        with self._lock:
            if self._closed or obj.url in self._filling:
                return
            self._filling.add(obj.url)  # kept after a failed fill: not retried by this reader
            if self._filler is None:
                self._filler = threading.Thread(target=self._fill_loop, name="fastload-remote-cache", daemon=True)
                self._filler.start()
        self._fills.put(obj)

    def _fill_loop(self) -> None:
        while True:
            obj = self._fills.get()
            if obj is None:
                return
            try:
                self.fill(obj)
            except Exception as exc:
                if not self._closed:
                    log.warning("torch_fastload cache: %s was not cached (%s)", obj.display, exc)

    def fill(self, obj: RemoteObject) -> str | None:
        """Download ``obj`` into its shard cache now (its path; None if it does not fit)."""
        cache = obj.cache()
        if cache is None:
            raise ValueError(f"{obj.display} was opened without a cache_dir")
        found = cache.lookup(obj)
        if found is not None:
            return found
        zero = np.zeros(1, dtype=np.int64)
        return cache.fill(
            obj,
            lambda buffer: self._fetch_host(buffer, [obj], zero, zero, np.array([obj.size]), zero, FILL),
        )

    # -- shutdown -------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Abort requests in flight and cache fills (their partial files are removed), join
        every thread."""
        timeout = config.get("shutdown_timeout") if timeout is None else timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            filler = self._filler
        self.ahead.close()
        self.client.close()
        self._fills.put(None)
        if not self.pool.close(timeout):
            log.warning("torch_fastload: remote read threads still running after %s s", timeout)
        if filler is not None:
            filler.join(timeout)
        if self._kvikio is not None:
            self._kvikio.close()


def plan_requests(
    file_index, offsets, lengths, dst_offsets, request_size: int, concurrency: int | None = None, gap: int = MERGE_GAP
) -> list:
    """The requests for coalesced ranges (sorted by file and offset):
    ``(file, offset, length, dst_offset, None)`` reads straight into place (a range longer than
    the piece size is split), ``(file, offset, length, None, parts)`` spans neighbours less than
    ``gap`` apart in one request of at most ``request_size`` whose dropped bytes stay under its
    used bytes + ``MERGE_SLACK``; ``parts`` = ``(start in the span, dst_offset, length)``. The
    piece size is ``request_size``, or with ``concurrency`` the bytes over ``concurrency`` (or
    ``SPREAD``, the lower; 64 KiB multiples, ``MIN_PIECE`` at least) where that is smaller."""
    fi, off, ln, at = (a.tolist() for a in (file_index, offsets, lengths, dst_offsets))
    piece = request_size
    if concurrency:
        share = -(-sum(ln) // min(concurrency, SPREAD))
        piece = min(request_size, max(MIN_PIECE, -(-share // (64 << 10)) * (64 << 10)))
    requests, i = [], 0
    while i < len(off):
        j, end, used = i + 1, off[i] + ln[i], ln[i]
        while j < len(off) and fi[j] == fi[i] and off[j] - end <= gap:
            new_end, useful = max(end, off[j] + ln[j]), used + ln[j]
            span = new_end - off[i]
            if span > request_size or span - useful > useful + MERGE_SLACK:  # too long, or mostly gaps
                break
            end, used = new_end, useful
            j += 1
        if j - i == 1:
            for start in range(0, ln[i], piece):
                requests.append((fi[i], off[i] + start, min(piece, ln[i] - start), at[i] + start, None))
        else:
            parts = [(off[k] - off[i], at[k], ln[k]) for k in range(i, j)]
            requests.append((fi[i], off[i], end - off[i], None, parts))
        i = j
    return requests


def _add(moved: dict, more: dict) -> None:
    for key, n in more.items():
        moved[key] = moved.get(key, 0) + n
