"""File readers: the code that moves a batch's file ranges into the pinned slot or GPU memory.

``io.select`` decides which mode runs (``IoPath``); ``make_reader(path)`` builds the reader for
it: ``EngineReader`` (the C++ engine: pread or O_DIRECT, mapped page-cache gathers, the pinned
ring), ``KvikioReader`` (kvikio CuFile, GDS or compat) or ``PythonReader`` (os.pread, no engine).
Each checks every range against its file's size and pin before reading and reads whole ranges
or raises, never a partly filled batch (io.py's docstring has the table of modes)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings

import numpy as np
import torch

from . import config, engine, fileio, uva
from . import io as _io
from .engine import RangeError, ShortReadError
from .io import IoPath, log
from .pool import _wait_event
from .remote.url import is_url
from .staging import PendingRead

__all__ = ["Reader", "EngineReader", "PythonReader", "KvikioReader", "make_reader", "batch_ranges", "coalesce"]


def batch_ranges(reads: list[tuple[int, PendingRead]]):
    """``(paths, file_index, offsets, lengths, dst_offsets)`` of every range of a batch's
    ``(slot offset, PendingRead)`` fields, each field's ranges packed back to back."""
    paths: list = []
    which: dict = {}
    file_index, offsets, lengths, dst_offsets = [], [], [], []
    for at, read in reads:
        remap = np.empty(len(read.paths), dtype=np.int64)
        for i, path in enumerate(read.paths):
            key = os.fspath(path)
            if key not in which:
                which[key] = len(paths)
                paths.append(key)
            remap[i] = which[key]
        file_index.append(remap[read.file_index] if len(read.file_index) else read.file_index)
        offsets.append(read.offsets)
        lengths.append(read.lengths)
        starts = np.empty(len(read.lengths), dtype=np.int64)
        if len(starts):
            starts[0] = 0
            np.cumsum(read.lengths[:-1], out=starts[1:])
        dst_offsets.append(at + starts)

    def cat(parts):
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    return paths, cat(file_index), cat(offsets), cat(lengths), cat(dst_offsets)


def coalesce(file_index, offsets, lengths, dst_offsets):
    """Merge ranges adjacent both in their file and in the destination (what the engine does
    in C++), for backends that issue one call per range. Returns the four arrays, merged."""
    keep = lengths > 0
    file_index, offsets, lengths, dst_offsets = (a[keep] for a in (file_index, offsets, lengths, dst_offsets))
    if len(offsets) < 2:
        return file_index, offsets, lengths, dst_offsets
    order = np.lexsort((dst_offsets, offsets, file_index))
    file_index, offsets, lengths, dst_offsets = (a[order] for a in (file_index, offsets, lengths, dst_offsets))
    joins = (
        (file_index[1:] == file_index[:-1])
        & (offsets[1:] == offsets[:-1] + lengths[:-1])
        & (dst_offsets[1:] == dst_offsets[:-1] + lengths[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = np.add.reduceat(lengths, starts)
    return file_index[starts], offsets[starts], merged, dst_offsets[starts]


def _open_checked(paths, file_index, offsets, lengths) -> list[int]:
    """Open every file, and check every range against its size, before any byte is read."""
    fds: list[int] = []
    try:
        sizes = []
        for path in paths:
            fds.append(fileio.open_regular(path))  # a FIFO never hangs; special files are refused
            sizes.append(os.fstat(fds[-1]).st_size)
        sizes = np.array(sizes, dtype=np.int64)
        if len(offsets):
            bad = (offsets < 0) | (lengths < 0) | (offsets + lengths > sizes[file_index])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise RangeError(
                    f"range #{i} (offset={int(offsets[i])}, length={int(lengths[i])}) of "
                    f"'{paths[file_index[i]]}': reads past the end of the file "
                    f"({int(sizes[file_index[i]])} bytes)"
                )
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# ------------------------------------------------------------------------------------------
# readers
# ------------------------------------------------------------------------------------------


class Reader:
    """Reads a batch's ``PendingRead`` fields into a slot (host) or a device buffer."""

    copies_on_stream = True  # device reads are copies on the loader's stream (timed with it)

    def __init__(self, path: IoPath):
        self.path = path
        self._remote = None
        self._remote_lock = threading.Lock()

    @property
    def mode(self) -> str:
        return self.path.mode

    def read(self, dst: torch.Tensor, reads: list[tuple[int, PendingRead]]) -> dict[str, int]:
        """Read every field of ``reads`` to ``dst`` (uint8, 1-D) at its offset; returns the bytes
        moved by each path (``{"engine-posix": n}``, or ``{"mapped": m, "engine-posix": n}``)."""
        if not reads:
            return {}
        expected = "cuda" if self.path.to_device else "cpu"
        if dst.device.type != expected:
            raise ValueError(f"{self.mode} reads into {expected} memory, got a buffer on {dst.device}")
        ranges = batch_ranges(reads)
        try:
            if any(is_url(p) for p in ranges[0]):
                moved = self._remote_reader().read_fields(dst, reads, local=self._read_local)
            else:
                moved = self._read_local(dst, *ranges)
        except Exception as exc:  # a file that changed explains a short or out-of-range read
            _check_pins(reads, exc)
            raise
        _check_pins(reads)  # after the read: a file replaced before or while it was read is caught
        return moved

    def read_ahead(self, reads: list, owner=None) -> tuple[int, int]:
        """Request the remote ranges of a fetched batch's file fields (``PendingRead``s) before
        its turn (``remote/ahead.py``); ``read`` takes them. Returns ``(bytes started, the
        read-ahead budget)``."""
        if not any(is_url(p) for read in reads for p in read.paths):
            return 0, 0
        ahead = self._remote_reader().ahead
        started = [read for read in reads if ahead.start(read, pinned=self.path.to_device, owner=owner)]
        return sum(int(read.lengths.sum()) for read in started), ahead.budget

    def cancel_read_ahead(self, owner) -> None:
        """Drop ``owner``'s read-ahead entries not taken (an iterator shut down mid-epoch)."""
        with self._remote_lock:
            remote = self._remote
        if remote is not None:
            remote.ahead.cancel(owner)

    def _read_local(self, dst, *ranges) -> dict[str, int]:
        moved = self._read(dst, *ranges)
        return moved if isinstance(moved, dict) else {self.mode: moved}

    def _read(self, dst, paths, file_index, offsets, lengths, dst_offsets) -> int | dict[str, int]:
        raise NotImplementedError  # each backend implements it

    def _remote_reader(self):
        """The reader of URL ranges, made on the first batch that has any."""
        with self._remote_lock:
            if self._remote is None:
                from .remote import RemoteReader, describe_settings

                self._remote = RemoteReader()
                self.path = dataclasses.replace(self.path, remote=describe_settings())
                log.info("torch_fastload reads remote objects with %s", self.path.remote)
            return self._remote

    def close(self, timeout: float = 10.0) -> None:
        """Free what the reader holds once no copy reads it any more."""
        with self._remote_lock:
            remote, self._remote = self._remote, None
        if remote is not None:
            remote.close(timeout)


def _check_pins(reads: list[tuple[int, PendingRead]], cause: BaseException | None = None) -> None:
    """``FileChangedError`` where a file a batch read is no longer the one its source opened."""
    for _, read in reads:
        if read.pins is not None:
            used = range(len(read.paths)) if len(read.paths) == 1 else np.unique(read.file_index).tolist()
            try:
                fileio.check_pins((read.paths[i], read.pins[i]) for i in used)
            except fileio.FileChangedError as changed:
                raise changed from cause


class EngineReader(Reader):
    """The C++ engine: one call per batch, GIL released, ranges coalesced and sliced in C++.

    On a CUDA device, files already resident in the page cache (within ``map_budget``) are
    mapped and registered, and a GPU kernel gathers their ranges straight out of the page
    cache (``engine.MappedFiles`` + uva.py's kernel: no CPU copy); the rest streams
    through the engine's pinned ring. Either way the work is on the current (the loader's
    copy) stream."""

    #: streams the mapped DMA copies are spread over (the copy engines work in parallel)
    mapped_streams = 2

    def __init__(self, path: IoPath):
        super().__init__(path)
        self.stager = engine.DeviceStager(path.task_size, path.ring_chunks) if path.ring_chunks else None
        self.mapped = engine.MappedFiles(path.map_budget) if path.map_budget else None
        self._gather_blocks = uva.blocks() if self.mapped is not None else 0  # validated here, not at import
        self._aux_streams: list = []
        self._lock = threading.Lock()
        self.unsafe_ring_reuse = False  # tests: skip the per-chunk wait to prove it is needed
        self.mapped_by_kernel = True  # False: mapped ranges by DMA copies (mapped_copy='dma')

    def _read(self, dst, paths, file_index, offsets, lengths, dst_offsets):
        common = dict(
            num_threads=self.path.threads, task_size=self.path.task_size, o_direct=self.path.mode == "engine-odirect"
        )
        if self.stager is None:
            return engine.read_ranges(paths, file_index, offsets, lengths, dst, dst_offsets, **common)
        moved = {}
        if self.mapped is not None:
            maps = [self.mapped.get(p) for p in paths]
            if any(m is not None for m in maps):
                direct = np.array([m is not None for m in maps])[file_index]
                moved["mapped"] = self._copy_mapped(
                    dst, maps, file_index[direct], offsets[direct], lengths[direct], dst_offsets[direct]
                )
                rest = ~direct
                file_index, offsets, lengths, dst_offsets = (
                    a[rest] for a in (file_index, offsets, lengths, dst_offsets)
                )
        if len(offsets):
            stream = torch.cuda.current_stream(dst.device).cuda_stream
            moved[self.mode] = self.stager.read(
                paths,
                file_index,
                offsets,
                lengths,
                dst,
                dst_offsets,
                stream=stream,
                wait_for_chunks=not self.unsafe_ring_reuse,
                **common,
            )
        return moved

    def _copy_mapped(self, dst, maps, file_index, offsets, lengths, dst_offsets) -> int:
        """Ranges of mapped files into ``dst``: the engine launches uva.py's gather kernel on
        the copy stream (no GIL, no CPU copy), or DMA copies where it cannot be compiled or
        ``mapped_copy='dma'`` asks for them (this pipeline takes 'auto' as the kernel)."""
        used = sorted(set(file_index.tolist()))
        if not (self.mapped_by_kernel and uva.available()):
            return self._dma_mapped(dst, maps, used, file_index, offsets, lengths, dst_offsets)
        remap = np.zeros(len(maps), dtype=np.int64)
        remap[used] = np.arange(len(used))
        return self.stager.gather_mapped(
            [maps[i] for i in used],
            remap[file_index],
            offsets,
            lengths,
            dst,
            dst_offsets,
            stream=torch.cuda.current_stream(dst.device).cuda_stream,
            function=uva.kernel_handle(dst.device),
            piece_bytes=uva.PIECE,
            blocks=self._gather_blocks,
        )

    def _dma_mapped(self, dst, maps, used, file_index, offsets, lengths, dst_offsets) -> int:
        """One DMA copy per coalesced range, spread over ``mapped_streams`` streams."""
        remap = np.zeros(len(maps), dtype=np.int64)
        remap[used] = np.arange(len(used))
        main = torch.cuda.current_stream(dst.device)
        with self._lock:
            while len(self._aux_streams) < self.mapped_streams - 1:
                self._aux_streams.append(torch.cuda.Stream(dst.device))
        for aux in self._aux_streams:
            aux.wait_stream(main)  # the buffer's allocation is ordered on the main stream
        moved = engine._require().mapped_copy(
            [maps[i] for i in used],
            remap[file_index],
            offsets,
            lengths,
            dst.data_ptr(),
            dst.numel(),
            dst_offsets,
            [main.cuda_stream] + [s.cuda_stream for s in self._aux_streams],
        )
        for aux in self._aux_streams:
            main.wait_stream(aux)  # the batch's completion event covers every copy
        return moved

    def close(self, timeout: float = 10.0) -> None:
        """Called once the loader's copy stream is idle (every copy out of the ring or a mapping)."""
        if self.stager is not None and not self.stager.close(timeout):
            warnings.warn(
                f"torch_fastload: copies out of the pinned ring still running after {timeout} s; "
                "the ring is kept alive instead of freed",
                RuntimeWarning,
                stacklevel=2,
            )
        self.stager = None
        if self.mapped is not None:
            self.mapped.close()
        super().close(timeout)


class PythonReader(Reader):
    """``os.pread`` per coalesced range: the fallback where the C++ engine is not built."""

    def _read(self, dst, paths, file_index, offsets, lengths, dst_offsets) -> int:
        view = dst.numpy()
        if len(dst_offsets) and (int((dst_offsets + lengths).max()) > view.size or int(dst_offsets.min()) < 0):
            raise RangeError(f"ranges exceed the {view.size}-byte destination")
        fds = _open_checked(paths, file_index, offsets, lengths)
        try:
            for fi, off, length, at in zip(*coalesce(file_index, offsets, lengths, dst_offsets)):
                got = 0
                while got < length:
                    data = os.pread(fds[fi], int(length - got), int(off + got))
                    if not data:
                        raise ShortReadError(
                            f"unexpected end of file at byte {int(off + got)} while reading "
                            f"file '{paths[fi]}', offset={int(off)}, length={int(length)}"
                        )
                    view[at + got : at + got + len(data)] = np.frombuffer(data, dtype=np.uint8)
                    got += len(data)
        finally:
            for fd in fds:
                os.close(fd)
        return int(lengths.sum())


class KvikioReader(Reader):
    """kvikio's ``CuFile.pread`` per coalesced range, all in flight at once on kvikio's pool.
    Its device writes are host-synchronous and off our streams: before them, the buffer's
    allocation (stream-ordered on the copy stream) must have settled."""

    copies_on_stream = False

    def __init__(self, path: IoPath):
        super().__init__(path)
        self.kvikio = _io._kvikio()
        if self.kvikio is None:
            raise ValueError(f"{path.mode} needs kvikio, which does not import here")
        if self.kvikio.defaults.get("num_threads") != path.threads:
            self.kvikio.defaults.set("num_threads", path.threads)  # process-wide: kvikio has one pool

    def _read(self, dst, paths, file_index, offsets, lengths, dst_offsets) -> int:
        total = dst.numel()
        if len(dst_offsets) and (int((dst_offsets + lengths).max()) > total or int(dst_offsets.min()) < 0):
            raise RangeError(f"ranges exceed the {total}-byte destination")
        fds = _open_checked(paths, file_index, offsets, lengths)  # typed errors before kvikio sees a path
        for fd in fds:
            os.close(fd)
        host = None if self.path.to_device else dst.numpy()
        if host is None:
            settled = torch.cuda.Event()
            settled.record(torch.cuda.current_stream(dst.device))
            _wait_event(
                settled,
                None,
                time.monotonic() + config.get("shutdown_timeout"),
                "the copy stream before a kvikio device read",
            )
        files = [self.kvikio.CuFile(p, "r") for p in paths]
        futures, error = [], None
        try:
            for fi, off, length, at in zip(*coalesce(file_index, offsets, lengths, dst_offsets)):
                view = dst[at : at + length] if host is None else host[at : at + length]
                futures.append(
                    (fi, off, length, files[fi].pread(view, int(length), int(off), task_size=self.path.task_size))
                )
        finally:
            for fi, off, length, future in futures:  # every read in flight finishes before we leave
                try:
                    got = future.get()
                except Exception as exc:
                    error = error or exc
                    continue
                if got != length and error is None:
                    error = ShortReadError(
                        f"kvikio read {got} of {int(length)} bytes from file '{paths[fi]}', "
                        f"offset={int(off)}, length={int(length)} (was it truncated?)"
                    )
            for f in files:
                f.close()
        if error is not None:
            raise error
        return int(lengths.sum())


def make_reader(path: IoPath) -> Reader:
    """The reader that implements ``path`` (logged once per loader at INFO)."""
    log.info("torch_fastload reads files with %s", path)
    if path.mode in ("gds", "kvikio-compat"):
        return KvikioReader(path)
    if path.mode == "python-posix":
        return PythonReader(path)
    return EngineReader(path)
