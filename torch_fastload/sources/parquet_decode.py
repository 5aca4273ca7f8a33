"""Row groups decoded by pyarrow on a thread pool (the GIL released inside pyarrow), each with
its columns' tensors made there once (``parquet_tensors.prepare_row_group``), kept in a small
byte-bounded cache.

Two ways to get a row group's bytes (``read_mode``): ``"pyarrow"`` lets pyarrow read the file
itself (coalesced, pre-buffered reads); ``"pread"`` reads the span of the selected column
chunks with one ``os.pread`` and lets pyarrow decode from that memory. benchmarks/parquet.py
measures both; the faster on the reference machine is the default.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ParquetDecodeError, ParquetError, ParquetFormatError
from . import parquet_arena
from .parquet_plan import ParquetPlan, RowGroup
from .parquet_tensors import prepare_row_group, range_descriptor

__all__ = ["RowGroupCache", "DecodedRowGroup", "READ_MODES", "DECODERS", "AHEAD_MAX"]

READ_MODES = ("pyarrow", "pread")
DECODERS = ("pages", "pyarrow")  # ParquetDataset(decoder=): csrc/arrow/page_decode.cpp, or pyarrow's reader
_OPEN_FILES_PER_THREAD = 4
AHEAD_MAX = 256  # row groups of the sampler's order the read-ahead looks at
_PARALLEL_TAKE_ROWS = 4096  # smaller gathers are not worth a thread hand-off
# the order row groups are asked for, across every cache of the process: their column chunks
# decode on pyarrow's pool in this order (``_arrow.read_row_group(order=)``)
_ASKED = itertools.count()
#: ``RowGroupCache.start``: the epoch's first row group is read alone, the read-ahead held back
#: until pyarrow's reader is done with it (False: it decodes beside the next ones at once)
FIRST_ALONE = True


class _SpanFile:
    """A read-only file object over bytes ``[start, start + len(data))`` of a file, answering
    reads at the file's own offsets (pyarrow decodes a row group from it, footer given)."""

    def __init__(self, data: memoryview, start: int, size: int):
        self.data, self.start, self.size, self.pos = data, start, size, 0
        self.closed = False

    def seek(self, pos, whence=0):
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.size + pos)
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        begin = self.pos - self.start
        if n is None or n < 0:
            n = self.size - self.pos
        if begin < 0 or begin + n > len(self.data):
            raise OSError(f"read of {n} bytes at {self.pos} is outside the row group's bytes")
        self.pos += n
        return self.data[begin : begin + n]

    def readable(self):
        return True

    def seekable(self):
        return True

    def close(self):
        self.closed = True


class DecodedRowGroup(NamedTuple):
    """A decoded row group: its table, the bytes it holds, and its columns' tensors made once
    (``prepare_row_group``) for the batches of consecutive rows cut from it."""

    table: pa.Table
    nbytes: int
    columns: list
    ranged: tuple | None = None  # ``range_descriptor(columns)``: what ``planned_range`` reads


class RowGroupCache:
    """Decoded row groups (``pa.Table`` of the selected columns) by plan index, LRU-bounded by
    bytes; a row group asked for while it decodes is waited for, not decoded twice."""

    def __init__(
        self,
        plan: ParquetPlan,
        threads: int,
        read_mode: str,
        cache_bytes: int,
        arrow_threads: bool = True,
        at_once: int | None = None,
        decoder: str = "pages",
    ):
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        self.plan = plan
        self.threads = max(1, threads)
        self.read_mode = read_mode
        self.cache_bytes = cache_bytes
        self.arrow_threads = arrow_threads
        self.names = [c.name for c in plan.columns]
        self.entries: OrderedDict = OrderedDict()  # index -> Future of (table, nbytes)
        self.held = 0
        self.running = 0  # decodes submitted and not finished
        self.reading = 0  # of those, row groups pyarrow is still reading (not yet at prepare_row_group)
        self.decoded = [0, 0]  # row groups decoded, their bytes: the read-ahead's size estimate
        self.upcoming: list = []  # the row groups the sampler reads next, in order
        self.failed: set = set()  # row groups whose decode raised: retried only by their batch
        self.alone = False  # the epoch's first row group is being read alone (``start``)
        leaves = max(1, sum(len(plan.leaves[0][name]) for name in self.names)) if plan.leaves else 1
        # enough row groups at once that every thread has about two column chunks, and no more:
        # with pyarrow's column threads on, row groups then finish in the order they are read
        self.at_once = max(2, -(-2 * self.threads // leaves)) if arrow_threads else self.threads
        self.at_once = min(at_once or self.at_once, self.threads)
        self.chunks = leaves  # column chunks a row group decodes in parallel (``start``)
        self.lock = threading.RLock()  # a decode that is already done runs its callback at once
        self.local = threading.local()
        self.pool: ThreadPoolExecutor | None = None
        self.gather_pool: ThreadPoolExecutor | None = None  # not the decode pool: no queueing behind read-ahead
        # parquet_arena's decoder (row groups decoded into pinned memory), once a loader binds
        # the source to a CUDA device; else the page decoder into pageable memory where the
        # extension is built and ``decoder="pages"``; else (None) pyarrow's Python API
        self.arena_decode = None
        self.page_decode = parquet_arena.page_decoder() if decoder == "pages" else None

    def _file(self, f: int) -> pq.ParquetFile:
        """This thread's ParquetFile of file ``f`` (readers are not shared between threads); a
        few stay open per thread, so thousands of files do not hold thousands of descriptors."""
        files = self.local.__dict__.setdefault("files", OrderedDict())
        if f in files:
            files.move_to_end(f)
            return files[f]
        if len(files) >= _OPEN_FILES_PER_THREAD:
            files.popitem(last=False)[1].close()
        files[f] = pq.ParquetFile(self.plan.paths[f], metadata=self.plan.metadata[f], pre_buffer=True)
        return files[f]

    def _decode(self, index: int, order: int = -1) -> DecodedRowGroup:
        group: RowGroup = self.plan.row_groups[index]
        path = self.plan.paths[group.file]
        try:
            table = self._read_checked(group, path, order)
        finally:
            self._read_finished()
        if table.num_rows != group.rows:
            raise ParquetDecodeError(
                path, f"decoded {table.num_rows} rows, the footer says {group.rows}", row_group=group.index
            )
        columns, extra = prepare_row_group(self.plan.columns, table)
        return DecodedRowGroup(table, table.nbytes + extra, columns, range_descriptor(columns))

    def _read_checked(self, group: RowGroup, path: str, order: int = -1) -> pa.Table:
        """The row group's table, its file checked unchanged first; errors named by file, row
        group and (where it can be found) column."""
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise ParquetFormatError(path, f"cannot be read any more ({exc})", row_group=group.index) from None
        if size != self.plan.sizes[group.file]:
            raise ParquetFormatError(
                path,
                f"has {size} bytes now, {self.plan.sizes[group.file]} when it was opened "
                "(rewritten or still being written)",
                row_group=group.index,
            )
        try:
            return self._read(group, self.names, order)
        except ParquetError:
            raise
        except (OSError, pa.ArrowException, ValueError, IndexError) as exc:
            raise self._name_column(group, exc) from None

    def _read_finished(self) -> None:
        """A row group left pyarrow's reader: the next one starts now, while this one's tensors
        are made (holding its read slot through ``prepare_row_group``, which runs Python, left
        a fifth of the read slots idle on the 16-core machine)."""
        with self.lock:
            self.reading -= 1
            self.alone = False
            self._read_ahead()

    def _read(self, group: RowGroup, names: list, order: int = -1) -> pa.Table:
        """Columns ``names`` of a row group, in that order. They are selected by leaf column
        index: pyarrow reads a dotted name as a path into a struct. ``order``: where its column
        chunks queue among those of row groups decoding at once (``_ASKED``; -1: last)."""
        leaves = self.plan.leaves[group.file]
        indices = sorted(j for name in names for j in leaves[name])
        decode = self.arena_decode or self.page_decode
        if decode is not None and self.read_mode == "pyarrow":
            table = decode(self.plan.paths[group.file], group.index, indices, self.arrow_threads, order=order)
        else:
            owner = self._file(group.file) if self.read_mode == "pyarrow" else self._span_file(group)
            table = owner.reader.read_row_group(group.index, column_indices=indices, use_threads=self.arrow_threads)
        return table.select([table.schema.get_field_index(name) for name in names])

    def _span_file(self, group: RowGroup) -> pq.ParquetFile:
        """The row group's bytes read with one pread, as a ParquetFile decoding from memory."""
        path = self.plan.paths[group.file]
        fd = os.open(path, os.O_RDONLY)
        try:
            data = bytearray(group.end - group.start)
            got = os.preadv(fd, [data], group.start)
        finally:
            os.close(fd)
        if got != len(data):
            raise ParquetFormatError(path, f"ended at byte {group.start + got} inside a row group", group.index)
        span = _SpanFile(memoryview(data), group.start, self.plan.sizes[group.file])
        return pq.ParquetFile(pa.PythonFile(span, mode="r"), metadata=self.plan.metadata[group.file])

    def _name_column(self, group: RowGroup, exc: BaseException) -> ParquetDecodeError:
        """The error of a row group that fails to decode, naming the first column that fails alone."""
        path = self.plan.paths[group.file]
        for name in self.names:
            try:
                self._read(group, [name])
            except (OSError, pa.ArrowException, ValueError, IndexError, ParquetError):
                return ParquetDecodeError(path, f"pages do not decode ({exc})", group.index, name)
        return ParquetDecodeError(path, f"pages do not decode ({exc})", group.index)

    def _start(self, index: int) -> Future:
        """The future of row group ``index``, its decode submitted if it is not cached (lock held)."""
        future = self.entries.get(index)
        if future is not None:
            self.entries.move_to_end(index)
            return future
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastload-parquet")
        future = self.pool.submit(self._decode, index, next(_ASKED))
        self.entries[index] = future
        self.running += 1
        self.reading += 1
        future.add_done_callback(lambda f, i=index: self._account(i, f))
        return future

    def _account(self, index: int, future: Future) -> None:
        with self.lock:
            self.running -= 1
            if future.cancelled():  # never started: its read slot is given back here
                self.reading -= 1
                self.alone = False
            if future.cancelled() or future.exception() is not None:
                if self.entries.get(index) is future:
                    del self.entries[index]  # an error is raised to its batch, then retried
                self.failed.add(index)
                return
            nbytes = future.result().nbytes
            self.failed.discard(index)  # its batch tried again, and it decoded this time
            self.held += nbytes
            self.decoded[0] += 1
            self.decoded[1] += nbytes
            self._evict(keep=index)
            self._read_ahead()

    def _read_ahead(self) -> None:
        """Start decoding the next row groups the sampler reads (lock held), as decodes finish:
        the decode threads run ahead of the batches, never waiting for a batch to be asked
        for, and hold at most half the cache in row groups decoded and not yet read."""
        if self.pool is None or not self.upcoming or self.alone:
            return
        mean = self.decoded[1] / self.decoded[0] if self.decoded[0] else 0
        limit = max(self.at_once, int(self.cache_bytes // 2 // mean)) if mean else self.at_once
        for ahead, index in enumerate(self.upcoming):
            if ahead >= limit or self.reading >= self.at_once:
                break
            if index in self.entries or index in self.failed:
                continue
            if mean:
                room = int((self.running + 1) * mean)
                self._evict(keep=-1, room=room, behind_only=True)  # row groups read already
                if self.held + room > self.cache_bytes:
                    break  # it would only push out a row group decoded ahead, to be decoded again
            if index not in self.entries:
                try:
                    self._start(index)
                except RuntimeError:  # the pool was shut down (interpreter exit): nothing is read ahead
                    return

    def _evict(self, keep: int, room: int = 0, behind_only: bool = False) -> None:
        """Drop decoded row groups until the cache fits (with ``room`` bytes to spare), least
        recently read first; those the sampler reads next (decoded ahead, not read yet) go
        last, the furthest ahead first (never with ``behind_only``)."""
        if self.held + room <= self.cache_bytes:
            return
        upcoming = set(self.upcoming)
        behind = [i for i in self.entries if i not in upcoming]
        ahead = [] if behind_only else [i for i in reversed(self.upcoming) if i in self.entries]
        for index in behind + ahead:
            if self.held + room <= self.cache_bytes or len(self.entries) <= 1:
                return
            future = self.entries[index]
            if index == keep or not future.done():
                continue
            del self.entries[index]
            if future.exception() is None:
                self.held -= future.result().nbytes

    def get(self, indices, ahead=()) -> list:
        """``DecodedRowGroup`` of row groups ``indices`` (decoded in parallel); ``ahead``: the row groups
        read after them, in order, decoded ahead as decode threads free up."""
        with self.lock:
            futures = [self._start(i) for i in indices]
            self.upcoming = list(ahead)
            self._read_ahead()
        return [f.result() for f in futures]

    def start(self, groups) -> None:
        """Start decoding ``groups`` (the epoch's first, in the order the sampler reads them)
        before any batch asks for them: the epoch's first batch waits for its row group's
        decode alone, not for the loader's threads to start first. With ``FIRST_ALONE`` the
        first row group has pyarrow's pool to itself (the read-ahead resumes once it is read)
        where its column chunks fill the pool: the alert table's first batch came 1.5-5 ms
        sooner on the H200, its epochs unchanged."""
        groups = [int(g) for g in groups]
        if not groups:
            return
        with self.lock:
            self.upcoming = groups
            fresh = groups[0] not in self.entries
            try:
                self._start(groups[0])
            except RuntimeError:  # the pool was shut down (interpreter exit)
                return
            self.alone = FIRST_ALONE and fresh and self.reading == 1 and self._fills_the_pool()
            self._read_ahead()

    def _fills_the_pool(self) -> bool:
        """A row group alone has a column chunk for every thread decoding (pyarrow's pool, at
        most ``threads``): only then is reading it alone faster. A one-column file's row group
        is one chunk on one thread; alone it left the others idle (a 64 MiB string file's
        epoch 60-67 ms against 40-53 on the H200)."""
        return self.arrow_threads and self.chunks >= min(self.threads, pa.cpu_count())

    def take(self, table: pa.Table, rows: np.ndarray) -> pa.Table:
        """Rows ``rows`` of ``table``, its columns gathered in parallel (pyarrow's take runs one
        column after another, without the GIL): a shuffled batch's gather was a serial step on
        the fetch thread as long as the decode of its rows."""
        # from the buffer, not pa.array(rows): that imports pandas where it is installed (once
        # a process, a fraction of a second holding the GIL in the first shuffled batch)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        indices = pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])
        if table.num_columns < 2 or len(rows) < _PARALLEL_TAKE_ROWS or self.threads < 2:
            return table.take(indices)
        with self.lock:
            if self.gather_pool is None:
                workers = min(self.threads, table.num_columns)
                self.gather_pool = ThreadPoolExecutor(workers, thread_name_prefix="fastload-parquet-take")
            pool = self.gather_pool
        columns = list(pool.map(lambda column: column.take(indices), table.columns))
        return pa.Table.from_arrays(columns, schema=table.schema)

    def close(self) -> None:
        with self.lock:
            gather, self.gather_pool = self.gather_pool, None
            pool, self.pool = self.pool, None
            self.entries.clear()
            self.held = 0
            self.upcoming = []
            self.failed = set()
            self.alone = False
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if gather is not None:
            gather.shutdown(wait=True)
