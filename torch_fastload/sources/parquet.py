"""Parquet files as a Dataset whose batches are decoded whole: row groups decoded by pyarrow on a
thread pool (no GIL), the batch's rows gathered in Arrow, and each column handed to the loader as
CPU tensors that the stager copies into the pinned slot and on to the device.

A batch is a dict; for a column ``c``:

======================  ===================================================================
type                    keys and tensors (``n`` rows)
======================  ===================================================================
int/uint/float          ``c``: (n,) of the same width (uint16/32/64 as torch's uint types)
bool                    ``c``: (n,) torch.bool
timestamp, duration,    ``c``: (n,) int64 counts of the column's own unit (``s``/``ms``/``us``/
time, date              ``ns``; date32 in days, date64 in ms): ``dataset.units[c]``
decimal128 (p <= 18)    ``c``: (n,) int64 unscaled value (value = c / 10**scale;
                        ``dataset.units[c] == "scale=S"``); precision > 18 is refused
string, binary          ``c``: uint8 bytes of all rows back to back; ``c__offsets``: (n + 1,)
                        int64, row ``i`` is ``c[c__offsets[i]:c__offsets[i + 1]]``
string in               ``c``: (n,) int32 codes into the batch's dictionary (-1: null);
``dictionary_columns``  ``c__dictionary`` + ``c__dictionary_offsets``: its values, as strings
list<number>            ``c``: the values back to back; ``c__offsets``: (n + 1,) int64
fixed_size_list<number> ``c``: (n, k) 2-D tensor (embeddings)
nullable                ``c__valid``: (n,) torch.bool, False where the row is null (the value
                        there is 0, or an empty string/list); present when the column is
                        optional and the footer's statistics report nulls or no null count
                        (``masks="always"`` / ``"never"`` to choose)
======================  ===================================================================

Any other type (nested structs, maps, lists of strings, large decimals) is refused when the
files are opened, by name: leave it out with ``columns=``. ``ParquetSampler`` shuffles row
groups, then rows within a bounded window, and shards them across ranks by rows.

Delivered to a CUDA device, row groups decode into a pinned arena where the extension
``torch_fastload._arrow`` is built (``parquet_arena.py``): the columns of a batch of
consecutive rows go to the GPU from where they were decoded, with no copy into a slot.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
import weakref

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset

from .. import config
from ..resume import batch_key
from ..staging import direct_regions_array, in_direct_region, materialize
from . import parquet_arena
from .parquet_decode import AHEAD_MAX, DECODERS, READ_MODES, RowGroupCache
from .parquet_plan import expand_paths, open_plan
from .parquet_sampler import ParquetBatchSampler, ParquetSampler
from .parquet_tensors import (
    RowsGather,
    can_gather,
    can_plan_ranges,
    columns_to_tensors,
    gather_tensors,
    planned_range,
    range_tensors,
)

__all__ = ["ParquetDataset", "ParquetSampler", "ParquetBatchSampler"]

_BOOKKEEPING = threading.Lock()  # the cache's creation and the fetched rows, across fetch threads
# iterators bound and ended (``__fastload_bind__`` / ``__fastload_unbind__``); re-entrant: an
# iterator collected while this thread holds it ends there (its shutdown unbinds)
_BINDING = threading.RLock()


class _Spans(list):
    """A batch of consecutive rows: (decoded row group, first row, end row) a row group it spans,
    and ``row_groups``, their indices (for errors)."""

    row_groups: list = []


class _ArrowPoolLease:
    """pyarrow's CPU pool (one per process) made smaller while loaders over Parquet datasets
    run, and given its size back when the last of them ends: a ``read_table`` elsewhere in the
    process, between epochs or after training, gets every core again. A size the user set in
    the meantime is kept."""

    def __init__(self):
        self.lock = threading.RLock()  # a bound dataset collected inside it gives its hold back here
        self.holders = 0
        self.before: int | None = None
        self.size: int | None = None

    def take(self, size: int) -> int | None:
        """One more holder of a pool of at most ``size`` threads (made so by the first, where
        it was larger); the size it had before, or None where it was not made smaller."""
        with self.lock:
            if self.holders == 0:
                before = pa.cpu_count()
                if before <= size:
                    return None  # never grown: a pool the user made smaller stays
                pa.set_cpu_count(size)
                self.before, self.size = before, size
            self.holders += 1
            return self.before

    def give_back(self) -> None:
        """One holder fewer; the last one gives the pool its size back."""
        with self.lock:
            if not self.holders:
                return
            self.holders -= 1
            if self.holders == 0:
                if pa.cpu_count() == self.size:
                    pa.set_cpu_count(self.before)
                self.before = self.size = None


_ARROW_POOL = _ArrowPoolLease()

#: A bound loader starts decoding the epoch's first row groups as soon as the sampler has drawn
#: the epoch (``_start_epoch``); False: only when the fetch thread asks for the first batch.
DECODE_AT_ITER = True


class ParquetDataset(Dataset):
    """Rows of one or more Parquet files (a file, a list, a directory or a glob).

    ``columns``: the columns read (all by default). ``dictionary_columns``: string columns
    delivered as codes + a per-batch dictionary. ``threads``: decode threads (default: the
    CPU count). ``read_mode``: ``"pyarrow"`` (pyarrow reads the file) or
    ``"pread"`` (one pread per row group, decoded from memory). ``cache_bytes``: decoded row
    groups kept (a shuffle window must fit; order rows with ``ParquetSampler``: a uniform
    shuffle such as ``shuffle=True`` touches every row group in every batch).
    ``arrow_threads``: each row group's columns are also decoded in parallel on pyarrow's CPU
    pool (small files have few row groups). Footers are read and checked here, once.
    ``row_groups_at_once``: row groups decoding at the same time (default: enough to give
    each thread about two column chunks, so they finish in the order they are read).
    ``pinned_arena``: bytes of the pinned memory row groups decode into when a loader delivers
    to a CUDA device (module docstring; one arena per process, sized by the first dataset
    that makes it). None: twice ``cache_bytes`` (what a full cache, batches in flight and the
    arena's size classes take); 0: decode into pageable memory and stage through a slot.
    ``decoder``: ``"pages"`` (flat numeric, boolean and string columns of PLAIN or dictionary
    pages, and strings of DELTA_* pages, decoded by torch_fastload's page decoder from pyarrow's
    pages, 3.3-5.6x faster a string column on one thread; every other column by pyarrow's reader) or
    ``"pyarrow"`` (all by pyarrow).
    Both give the same tables; ``"pages"`` needs the extension ``torch_fastload._arrow``.
    """

    __fastload_direct_cpu__ = True  # a CPU batch is copied once from Arrow's buffers, no slot
    __fastload_parallel_batches__ = True  # with fetch_threads > 1, batches wait for decodes together

    def __init__(
        self,
        source,
        columns=None,
        *,
        dictionary_columns=(),
        masks: str = "auto",
        threads: int | None = None,
        read_mode: str = "pyarrow",
        cache_bytes: int = 1 << 30,
        arrow_threads: bool = True,
        row_groups_at_once: int | None = None,
        pinned_arena: int | None = None,
        decoder: str = "pages",
    ):
        if masks not in ("auto", "always", "never"):
            raise ValueError(f"masks must be 'auto', 'always' or 'never', got {masks!r}")
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        self.paths = expand_paths(source)
        self.plan = open_plan(self.paths, list(columns) if columns is not None else None, masks, dictionary_columns)
        self.columns = [c.name for c in self.plan.columns]
        self.units = {c.name: c.unit for c in self.plan.columns if c.unit}
        self.threads = threads or os.cpu_count() or 1
        self.read_mode = read_mode
        self.cache_bytes = cache_bytes
        self.arrow_threads = arrow_threads
        self.row_groups_at_once = row_groups_at_once
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        self.decoder = decoder
        if pinned_arena is not None and pinned_arena < 0:
            raise ValueError(f"pinned_arena must be >= 0 bytes, got {pinned_arena}")
        self.pinned_arena = pinned_arena
        self._arena_decode = None  # parquet_arena's decoder, once a loader binds to a CUDA device
        self._bound = 0  # iterators bound to this dataset and not ended (``__fastload_bind__``)
        self._pool_held = None  # its hold of _ARROW_POOL while _bound > 0: a finalizer giving it back
        self._cores_note: str | None = None
        self._cache: RowGroupCache | None = None
        self._schedule: np.ndarray | None = None  # row groups in the order the sampler reads them
        self._schedule_started = False  # its first row groups' decodes started (``_start_epoch``)
        self._position: dict = {}
        self._epoch: dict | None = None  # the settings of the epoch the sampler last drew
        self._resume: dict | None = None  # a checkpoint's, until the next epoch is checked
        # (batch number, call, rows) of each batch fetched and not yet delivered: a heap, as
        # batches fetched on several threads at once finish out of order
        self._fetched: list = []
        self._calls = 0
        self._delivered = 0  # rows of this epoch handed to the training loop
        # where the batches' fetch time went: "rows" (the batch in Arrow: waits for row groups
        # to decode, gathers) and "tensors" (its columns as tensors); benchmarks/parquet.py
        self.fetch_seconds = {"rows": 0.0, "tensors": 0.0}

    # -- layout -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.plan.rows

    @property
    def schema(self) -> pa.Schema:
        return self.plan.schema

    @property
    def row_group_rows(self) -> np.ndarray:
        """Rows of every row group, in file then row-group order."""
        return np.diff(self.plan.starts)

    def __fastload_samples__(self, batch) -> int:
        """The rows of one of its batches (``loader.stats()``): the first column's rows, not
        its first field's length (a string column's first field is its bytes)."""
        first = self.plan.columns[0]
        if first.kind in ("bytes", "list"):
            return int(batch[first.name + "__offsets"].shape[0]) - 1
        return int(batch[first.name].shape[0])

    def keys(self) -> list:
        """The keys of every batch, in order."""
        keys = []
        for c in self.plan.columns:
            keys.append(c.name)
            if c.kind in ("bytes", "list"):
                keys.append(c.name + "__offsets")
            if c.kind == "dictionary":
                keys += [c.name + "__dictionary", c.name + "__dictionary_offsets"]
            if c.masked:
                keys.append(c.name + "__valid")
        return keys

    def _check(self, indices) -> np.ndarray | range:
        """``indices`` as int64 rows in range (negative ones counted from the end); a ``range``
        of consecutive rows (``ParquetBatchSampler``'s) stays one: no array of its rows."""
        if isinstance(indices, range) and indices.step == 1 and (0 <= indices.start <= indices.stop <= len(self)):
            return indices
        raw = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(raw) or (raw.min() >= 0 and raw.max() < len(self)):
            return raw
        index = np.where(raw < 0, raw + len(self), raw)
        bad = (index < 0) | (index >= len(self))
        if bad.any():
            raise IndexError(f"row {int(raw[bad][0])} is out of range for {self.paths[0]!r} ({len(self)} rows)")
        return index

    def _reader(self) -> RowGroupCache:
        if self._cache is None:
            with _BOOKKEEPING:
                if self._cache is None:
                    self._cache = RowGroupCache(
                        self.plan,
                        self.threads,
                        self.read_mode,
                        self.cache_bytes,
                        self.arrow_threads,
                        self.row_groups_at_once,
                        self.decoder,
                    )
                    self._cache.arena_decode = self._arena_decode
        return self._cache

    def _ahead(self, groups: np.ndarray) -> list:
        """The row groups the sampler reads from the last of ``groups`` on, in order (decoded
        ahead; that last one is the next batch's first more often than not)."""
        if self._schedule is not None:
            last = max((self._position.get(int(g), 0) for g in groups), default=0)
            return self._schedule[last : last + AHEAD_MAX].tolist()
        top = int(groups.max())
        return list(range(top, min(top + AHEAD_MAX, len(self.plan.row_groups))))

    def read_table(self, indices) -> pa.Table:
        """Rows ``indices`` (in that order) as an Arrow table of the selected columns."""
        table, _, spans = self._table(self._check(indices))
        return table() if spans is not None else table

    def _table(self, index: np.ndarray | range) -> tuple:
        """(rows ``index`` as a table, the file of the first one, and for consecutive rows the
        spans of ``range_tensors``, for shuffled rows a ``RowsGather`` (with the extension),
        else None): the batch in Arrow. With spans or a gather the table is a function making it:
        those batches need it only for unprepared columns."""
        if not len(index):
            return self.plan.schema.empty_table(), 0, None
        if isinstance(index, range):  # consecutive rows (``_check``)
            return self._range(index.start, len(index))
        first, n = int(index[0]), len(index)
        if int(index[-1]) - first == n - 1 and (n < 3 or bool((index == np.arange(first, first + n)).all())):
            return self._range(first, n)
        groups = np.searchsorted(self.plan.starts, index, side="right") - 1
        unique = np.flatnonzero(np.bincount(groups, minlength=len(self.plan.row_groups)))
        file = self.plan.row_groups[int(groups[0])].file
        decoded = self._reader().get(unique.tolist(), self._ahead(unique))
        tables = [d.table for d in decoded]
        base = np.zeros(len(self.plan.row_groups), dtype=np.int64)
        base[unique] = np.cumsum([0] + [t.num_rows for t in tables[:-1]])
        local = np.ascontiguousarray(index - (self.plan.starts[:-1] - base)[groups], dtype=np.int64)
        if can_gather() and config.get("parquet_gather") == "native":
            gather = RowsGather([d.columns for d in decoded], [t.num_rows for t in tables], local)

            def table() -> pa.Table:
                whole = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
                return self._reader().take(whole, local)

            return table, file, gather
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        return self._reader().take(table, local), file, None

    def _range(self, first: int, n: int) -> tuple:
        """Rows ``first .. first + n - 1`` (in order): slices of the row groups, no gather."""
        lo, hi = np.searchsorted(self.plan.starts, [first, first + n - 1], side="right") - 1
        groups = list(range(int(lo), int(hi) + 1))
        decoded = self._reader().get(groups, self._ahead(np.asarray(groups)))
        skip = first - int(self.plan.starts[lo])

        def table() -> pa.Table:
            whole = decoded[0].table if len(decoded) == 1 else pa.concat_tables([d.table for d in decoded])
            return whole.slice(skip, n)

        spans, left, start = _Spans(), n, skip
        spans.row_groups = groups
        for group in decoded:
            stop = min(group.table.num_rows, start + left)
            spans.append((group, start, stop))
            left -= stop - start
            start = 0
        return table, self.plan.row_groups[int(lo)].file, spans

    # -- the protocol -------------------------------------------------------------------
    def batch(self, indices) -> dict:
        """The batch dict of rows ``indices`` as plain CPU tensors (what the loader delivers).
        Tensors lying in the pinned arena or gather region (a CUDA loader bound this dataset)
        are copied out: that memory is CUDA-registered and reused by the loader, so a user's
        non-blocking copy of it could read bytes rewritten under it."""
        out = materialize(self.__fastload_batch__(indices))
        return {key: value.clone() if in_direct_region(value) else value for key, value in out.items()}

    def __fastload_batch__(self, indices) -> dict:
        """The batch dict of rows ``indices``: decoded whole, no per-row Python. A column whose
        rows span row groups is a ``PendingConcat`` of their buffers, string/list offsets are
        ``PendingOffsets`` rebased as the stager writes them (``batch()`` joins both)."""
        index = self._check(indices)
        if not len(index):
            return self.collate([])
        started = time.perf_counter()
        table, file, spans = self._table(index)
        arrow = time.perf_counter()
        if spans is None:
            batch = columns_to_tensors(self.paths[file], self.plan.columns, table)
        elif isinstance(spans, RowsGather):  # shuffled rows, gathered in C++
            threads = config.get("parquet_gather_threads") or min(16, self.threads)
            batch = gather_tensors(self.paths[file], self.plan.columns, spans, table, threads)
        else:  # consecutive rows: cut from each row group's tensors, made when it was decoded
            batch = None
            if can_plan_ranges() and config.get("parquet_range_plan") and batch_key() is not None:
                regions = direct_regions_array()
                batch = planned_range(self.paths[file], self.plan.columns, spans, regions, spans.row_groups)
            if batch is None:  # outside a loader, or a column not prepared: per column in Python
                columns = [(group.columns, start, stop) for group, start, stop in spans]
                batch = range_tensors(self.paths[file], self.plan.columns, columns, table)
        self.fetch_seconds["rows"] += arrow - started
        self.fetch_seconds["tensors"] += time.perf_counter() - arrow
        key = batch_key()  # None outside the loader: those count first, as they came
        with _BOOKKEEPING:
            self._calls += 1
            heapq.heappush(self._fetched, (key.number if key is not None else -1, self._calls, len(index)))
        return batch

    def __fastload_bind__(self, device: torch.device) -> str | None:
        """A loader delivers this source's batches to ``device``: pyarrow's CPU pool leaves
        cores to the loader's threads (``_leave_cores``); on a CUDA device, row groups decode
        into the pinned arena from now on (module docstring), where it can be made. Returns
        what it did, for ``loader.stats().path``."""
        cores = self._leave_cores()
        pages = self._decoder_note()
        if device.type != "cuda":
            self._start_epoch()
            return "; ".join(note for note in (pages, cores) if note)
        if self.pinned_arena == 0:
            decode = "Parquet decoded into pageable memory (pinned_arena=0), staged through the slot"
        else:
            nbytes = 2 * self.cache_bytes if self.pinned_arena is None else self.pinned_arena
            self._arena_decode = parquet_arena.decoder(device, nbytes, by_pages=self.decoder == "pages")
            self._reader().arena_decode = self._arena_decode  # the cache made after a close() too
            if self._arena_decode is not None:
                decode = "Parquet decoded into the pinned arena, columns copied to the GPU from there"
                if can_gather() and config.get("parquet_gather") == "native" and parquet_arena.gather_region(device):
                    decode += "; shuffled rows gathered into pinned memory, copied from there"
            else:
                why = parquet_arena.unavailable_reason() or "its registration with CUDA was refused"
                decode = f"Parquet decoded into pageable memory ({why}), staged through the slot"
        self._start_epoch()  # into the arena: after the cache has its decoder
        return "; ".join(note for note in (pages, decode, cores) if note)

    def _start_epoch(self) -> None:
        """The epoch's first row groups start decoding once the sampler has drawn the epoch and a
        loader has bound this dataset, whichever comes second: ``ParquetBatchSampler`` draws at
        ``iter(loader)``, before the loader's threads start, so the first batch no longer waits
        for them (~1-2 ms of a small file's 40 ms epoch). A resumed epoch starts mid-schedule:
        its batches ask for their row groups themselves."""
        with _BINDING:
            if not DECODE_AT_ITER or self._schedule is None or self._schedule_started or not self._bound:
                return
            self._schedule_started = True
            if self._delivered:
                return
            first = self._schedule[:AHEAD_MAX]
        self._reader().start(first.tolist())

    def _decoder_note(self) -> str:
        """Which decoder reads the column chunks, and why not the page decoder where it was
        asked for and cannot be used (for ``loader.stats().path``)."""
        if self.decoder == "pyarrow":
            return "Parquet columns read by pyarrow's reader (decoder='pyarrow')"
        if self.read_mode != "pyarrow":  # the page decoder reads files by path
            mode = f"read_mode={self.read_mode!r}"
            return f"Parquet columns read by pyarrow's reader from each row group's bytes ({mode})"
        why = parquet_arena.unavailable_reason()
        if why is not None:
            return f"Parquet columns read by pyarrow's reader: the page decoder is not available ({why})"
        return "Parquet column chunks of flat numbers, booleans and strings decoded by the page decoder"

    def _leave_cores(self) -> str | None:
        """pyarrow's CPU pool made ``parquet_cores_left`` smaller than the machine (at least half
        of it), where it is larger (never grown: a pool the user made smaller stays), while this
        dataset has iterators running (``_ARROW_POOL``; ``__fastload_unbind__`` gives it back).
        With every core decoding, the loader's stage threads stalled for 10-20 ms at a time in
        steps of microseconds (their threads preempted by decode threads, the GIL held
        meanwhile) and the epoch ran at the stage's pace, not the decode's
        (benchmarks/JOURNAL.md, 2026-11-27, ninth session: 1.11-1.36x with 6 of 16 cores left)."""
        with _BINDING:
            self._bound += 1
            if self._bound > 1:
                return self._cores_note  # the first iterator's decision holds for the others
            self._cores_note = None
            left = config.get("parquet_cores_left")
            if not self.arrow_threads or left == 0:
                return None
            cpus = os.cpu_count() or 1
            before = _ARROW_POOL.take(max(cpus - left, cpus // 2, 2))
            if before is None:
                return None
            # given back by the last iterator's unbind, or when the dataset is collected first
            self._pool_held = weakref.finalize(self, _ARROW_POOL.give_back)
            self._pool_held.atexit = False  # nothing to give back to at exit
            self._cores_note = (
                f"pyarrow's CPU pool made {_ARROW_POOL.size} threads (was {before}; parquet_cores_left={left}) "
                "while this dataset's iterators run"
            )
            return self._cores_note

    def __fastload_unbind__(self, device: torch.device) -> None:
        """An iterator bound to this dataset ended: the last one gives pyarrow's pool back."""
        with _BINDING:
            if not self._bound:
                return
            self._bound -= 1
            if self._bound or self._pool_held is None:
                return
            hold, self._pool_held = self._pool_held, None
        hold()  # weakref.finalize: gives the hold back once

    def __fastload_delivered__(self, device, waited_seconds: float) -> None:
        """Counts the rows the loop has received: a checkpoint knows whether its epoch was done."""
        with _BOOKKEEPING:
            if self._fetched:
                self._delivered += heapq.heappop(self._fetched)[2]

    def __getitem__(self, i) -> dict:
        """Row ``i``: numbers as 0-d tensors, strings/lists as 1-D tensors of their bytes/values,
        fixed-size lists as 1-D, masks as 0-d bool (torch's DataLoader: ``collate_fn=dataset.collate``)."""
        batch = self.batch([i])
        row = {}
        for c in self.plan.columns:
            name = c.name
            if c.kind in ("bytes", "list"):
                row[name] = batch[name]
            elif c.kind == "dictionary":
                offsets = batch[name + "__dictionary_offsets"]
                code = int(batch[name][0])
                data = batch[name + "__dictionary"]
                row[name] = data[offsets[code] : offsets[code + 1]] if code >= 0 else data[:0]
            else:
                row[name] = batch[name][0]
            if c.masked:
                row[name + "__valid"] = batch[name + "__valid"][0]
        return row

    def collate(self, samples: list) -> dict:
        """The batch dict of rows from ``__getitem__``: what the loader's batches are."""
        out = {}
        for c in self.plan.columns:
            name = c.name
            values = [s[name] for s in samples]
            if c.kind in ("bytes", "list"):
                out[name] = torch.cat(values) if values else torch.empty(0, dtype=c.dtype)
                out[name + "__offsets"] = _offsets([len(v) for v in values])
            elif c.kind == "dictionary":
                valid = [bool(s[name + "__valid"]) if c.masked else True for s in samples]
                raw = pa.array([bytes(v.numpy()) if ok else None for v, ok in zip(values, valid)], pa.binary())
                encoded = pc.dictionary_encode(raw)
                codes = encoded.indices.fill_null(-1) if encoded.indices.null_count else encoded.indices
                out[name] = torch.from_numpy(codes.to_numpy(zero_copy_only=False).astype(np.int32))
                words = encoded.dictionary.to_pylist()
                out[name + "__dictionary"] = torch.frombuffer(
                    bytearray(b"".join(words)) or bytearray(1), dtype=torch.uint8
                )[: sum(map(len, words))]
                out[name + "__dictionary_offsets"] = _offsets([len(w) for w in words])
            elif values:
                out[name] = torch.stack(values)
            else:
                shape = (0, c.width) if c.kind == "fixed_list" else (0,)
                out[name] = torch.empty(shape, dtype=c.dtype)
            if c.masked:
                out[name + "__valid"] = (
                    torch.stack([s[name + "__valid"] for s in samples]) if samples else torch.empty(0, dtype=torch.bool)
                )
        return out

    def close(self) -> None:
        """Stop the decode threads and drop the decoded row groups."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def __getstate__(self):  # worker processes start their own threads and cache
        state = dict(self.__dict__)
        state["_cache"] = None
        state["_arena_decode"] = None  # the arena is this process's (mapped and registered here)
        state["_bound"], state["_pool_held"], state["_cores_note"] = 0, None, None  # this process's iterators
        return state

    def state_dict(self) -> dict:
        """What a loader checkpoint keeps of this dataset: its row groups' row counts and the
        settings of the epoch ``ParquetSampler`` was drawing (checked again at resume)."""
        return {
            "rows": len(self),
            "row_groups": len(self.plan.row_groups),
            "files": [os.path.basename(p) for p in self.paths],
            "sampler": dict(self._epoch) if self._epoch else None,
            "rows_delivered": self._delivered,
        }

    def load_state_dict(self, state: dict) -> None:
        """Check a checkpoint's dataset against this one; its epoch settings are compared with the
        sampler's when the next epoch begins (``ResumeError`` naming the value that differs)."""
        from ..resume import ResumeError

        mine = (len(self), len(self.plan.row_groups))
        if (state.get("rows"), state.get("row_groups")) != mine:
            raise ResumeError(
                f"the checkpoint's Parquet dataset had {state.get('rows')} rows in {state.get('row_groups')} "
                f"row groups, this one has {mine[0]} in {mine[1]} ({self.paths[0]!r}...)"
            )
        sampler = state.get("sampler")
        if sampler is not None and state.get("rows_delivered", 0) < sampler.get("rows", 0):
            self._resume = dict(sampler, rows_delivered=state["rows_delivered"])  # checked at iter()
        else:
            self._resume = None  # between epochs: the next one may be drawn any way

    def _set_schedule(self, groups: np.ndarray | None) -> None:
        with _BINDING:
            self._schedule = groups
            self._schedule_started = False
            self._position = {} if groups is None else {int(g): i for i, g in enumerate(groups.tolist())}
        self._start_epoch()  # where a loader is bound already (the sampler drawn on its fetch thread)


def _offsets(lengths: list) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return offsets
