"""Arrow columns as the batch's tensors, with no per-row Python.

Three routes: ``columns_to_tensors`` turns any table (a shuffled batch's rows taken by Arrow)
into tensors chunk by chunk; ``prepare_row_group`` makes each decoded row group's tensors and
numpy views once, on its decode thread, ``range_tensors`` cuts a batch of consecutive rows
from them with a slice per row group, so the serial fetch of an unshuffled batch does no Arrow
work and moves no bytes, and ``gather_tensors`` cuts a shuffled batch's rows from them in one
C++ call without the GIL. The first two leave string/list offsets as ``PendingOffsets``: the
stager rebases and widens them to int64 as it writes the slot, in C++ without the GIL.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..errors import ParquetDecodeError
from ..staging import ALIGN, PendingConcat, PendingOffsets, PlannedBatch
from .parquet_plan import ColumnSpec

__all__ = [
    "columns_to_tensors",
    "prepare_row_group",
    "range_descriptor",
    "range_tensors",
    "planned_range",
    "can_plan_ranges",
    "RowsGather",
    "gather_tensors",
    "can_gather",
]

try:  # the C++ extension's one-call gather; without it shuffled batches take pyarrow's route
    from .._C import gather_rows as _gather_rows
except ImportError:
    _gather_rows = None
try:  # its planner of consecutive rows; without it those batches take range_tensors' route
    from .._C import plan_range as _plan_range
except ImportError:
    _plan_range = None


_read_only_warned = False


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A tensor over ``values`` without a copy. Arrow's buffers are read-only; the loader only
    reads them (the stager copies them into the pinned slot). torch warns about that once a
    process: only the first read-only array's call hides it. ``catch_warnings`` on every call cost the decode
    threads ~5 us of GIL each (and swaps the process's filters under the other threads)."""
    global _read_only_warned
    values = np.ascontiguousarray(values)
    if _read_only_warned or values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(values)
    _read_only_warned = True
    return tensor


def _buffer_view(buf, numpy_dtype, offset: int, length: int) -> np.ndarray:
    if buf is None or length == 0:
        return np.zeros(length, dtype=numpy_dtype)
    return np.frombuffer(buf, dtype=numpy_dtype)[offset : offset + length]


def _bits(buf, offset: int, length: int) -> np.ndarray:
    """Arrow's bitmap ``buf`` (LSB first) from bit ``offset``, ``length`` bits, as numpy bools."""
    if length == 0 or buf is None:
        return np.zeros(length, dtype=bool)
    packed = np.frombuffer(buf, dtype=np.uint8, count=(offset + length + 7) // 8)
    return np.unpackbits(packed, count=offset + length, bitorder="little")[offset:].view(bool)


def _validity(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return _bits(arr.buffers()[0], arr.offset, len(arr))


def _bools(arr: pa.Array) -> torch.Tensor:
    """A boolean array's values, False where null, unpacked with numpy. Not ``fill_null``:
    its fill scalar makes pyarrow import pandas where pandas is installed, a fraction of a
    second holding the GIL on a decode thread inside the first epoch (H100 machine)."""
    values = _bits(arr.buffers()[1], arr.offset, len(arr))
    if arr.null_count:
        values &= _validity(arr)
    return torch.from_numpy(values)


def _fixed(spec: ColumnSpec, arr: pa.Array) -> torch.Tensor:
    values = _buffer_view(arr.buffers()[1], spec.numpy_dtype, arr.offset, len(arr))
    if spec.numpy_dtype != np.int64 and spec.dtype == torch.int64:
        values = values.astype(np.int64)
    return _tensor(_zero_nulls(values, arr))


def _zero_nulls(values: np.ndarray, arr: pa.Array) -> np.ndarray:
    """Zeros where ``arr`` is null (Arrow leaves those values unspecified), in numpy: torch has
    no masked_fill for its unsigned types."""
    if not arr.null_count:
        return values
    return np.where(_validity(arr), values, values.dtype.type(0))


def _offsets_field(offsets: np.ndarray) -> PendingOffsets:
    """Arrow's ``offsets`` (n + 1 values) rebased to start at 0 and widened to int64 as the
    stager writes them into the slot: no array made or pass run on the fetch thread."""
    offsets = np.ascontiguousarray(offsets)
    return PendingOffsets([offsets], [0], [len(offsets)], [-int(offsets[0]) if len(offsets) else 0])


def _chained(fields: list) -> PendingOffsets:
    """The offsets of several chunks' ``PendingOffsets`` (each from 0) as one field: each
    chunk's after the first without its leading 0, shifted by the values before it."""
    sources, starts, counts, shifts, at = [], [], [], [], 0
    for k, field in enumerate(fields):
        for i, (source, start, count, shift) in enumerate(zip(field.sources, field.starts, field.counts, field.shifts)):
            skip = 1 if k and not i else 0
            sources.append(source)
            starts.append(start + skip)
            counts.append(count - skip)
            shifts.append(shift + at)
        last = len(field.sources) - 1
        at += int(field.sources[last][field.starts[last] + field.counts[last] - 1]) + field.shifts[last]
    return PendingOffsets(sources, starts, counts, shifts)


def _bytes(arr: pa.Array) -> tuple[torch.Tensor, PendingOffsets]:
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    _, offsets_buf, data_buf = arr.buffers()
    offsets = _buffer_view(offsets_buf, np.int64 if large else np.int32, arr.offset, len(arr) + 1)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    base, end = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    return _tensor(data[base:end]), _offsets_field(offsets)


def columns_to_tensors(path: str, specs: list, table: pa.Table) -> dict:
    """The batch dict of ``table`` (module docstring of ``parquet.py`` names the keys). A column
    of several chunks (a batch across row groups) is not joined here: its values are a
    ``PendingConcat`` of the chunks' buffers, which the stager copies once, into the slot."""
    out = {}
    for spec, column in zip(specs, table.columns):
        out.update(_column_tensors(path, spec, column))
    return out


def _column_tensors(path: str, spec: ColumnSpec, column: pa.ChunkedArray) -> dict:
    chunks = [chunk for chunk in column.chunks if len(chunk)] or column.chunks[:1]
    if spec.kind == "dictionary" and len(chunks) > 1:
        chunks = [column.combine_chunks()]  # one dictionary for the whole batch
    if not chunks:
        chunks = [pa.array([], type=column.type)]
    parts = [_array_tensors(path, spec, arr) for arr in chunks]
    return parts[0] if len(parts) == 1 else _join(parts)


def _join(parts: list) -> dict:
    """The tensors of one column's chunks as one field each: values and masks as a
    ``PendingConcat``, offsets rebased onto one another as the stager writes them."""
    out = {}
    for key in parts[0]:
        pieces = [part[key] for part in parts]
        out[key] = _chained(pieces) if isinstance(pieces[0], PendingOffsets) else PendingConcat(pieces)
    return out


def _array_tensors(path: str, spec: ColumnSpec, arr: pa.Array) -> dict:
    """The tensors of one Arrow array (a chunk of a column)."""
    out = {}
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if arr.null_count and not spec.masked:
        raise ParquetDecodeError(
            path, "holds nulls that its statistics did not report; open with masks='always'", column=spec.name
        )
    name = spec.name
    if spec.kind == "fixed":
        out[name] = _fixed(spec, arr)
    elif spec.kind == "bool":
        out[name] = _bools(arr)
    elif spec.kind == "decimal":
        words = np.frombuffer(arr.buffers()[1], dtype=np.int64).reshape(-1, 2)
        out[name] = _tensor(_zero_nulls(words[arr.offset : arr.offset + len(arr), 0], arr))
    elif spec.kind == "bytes":
        out[name], out[name + "__offsets"] = _bytes(arr)
    elif spec.kind == "dictionary":
        encoded = pc.dictionary_encode(arr)
        codes = encoded.indices.fill_null(-1) if encoded.indices.null_count else encoded.indices
        out[name] = _tensor(codes.to_numpy().astype(np.int32, copy=False))
        out[name + "__dictionary"], out[name + "__dictionary_offsets"] = _bytes(encoded.dictionary)
    elif spec.kind in ("list", "fixed_list"):
        _list_tensors(path, spec, arr, out)
    if spec.masked:
        out[name + "__valid"] = torch.from_numpy(_validity(arr))
    return out


def _list_tensors(path: str, spec: ColumnSpec, arr: pa.Array, out: dict) -> None:
    child = arr.values
    if spec.kind == "fixed_list":
        k = spec.width
        values = child.slice(arr.offset * k, len(arr) * k)
    else:
        large = pa.types.is_large_list(arr.type)
        offsets = _buffer_view(arr.buffers()[1], np.int64 if large else np.int32, arr.offset, len(arr) + 1)
        values = child.slice(int(offsets[0]), int(offsets[-1] - offsets[0])) if len(arr) else child.slice(0, 0)
    if values.null_count:
        raise ParquetDecodeError(path, "a list holds null elements (no tensor form)", column=spec.name)
    flat = _buffer_view(values.buffers()[1], spec.numpy_dtype, values.offset, len(values))
    tensor = _tensor(flat)
    if spec.kind == "fixed_list":
        out[spec.name] = tensor.view(len(arr), spec.width)
    else:
        out[spec.name], out[spec.name + "__offsets"] = tensor, _offsets_field(offsets)


def _fixed_source(values: torch.Tensor) -> tuple:
    """``gather_rows``' description of a tensor of fixed-size rows (no offsets)."""
    row_bytes = values.element_size() * math.prod(values.shape[1:])
    return (None, values.data_ptr(), len(values) * row_bytes, row_bytes, len(values))


# -- a decoded row group's columns, made once; batches of consecutive rows cut from them ---
class _Column(NamedTuple):
    """One column of a decoded row group: ``values`` (rows, or the bytes/list values back to
    back when ``offsets`` is set: the Arrow offsets, not rebased, contiguous), ``valid`` (None:
    no nulls) and ``mask``, the same as a tensor (or None)."""

    values: torch.Tensor
    offsets: np.ndarray | None
    valid: np.ndarray | None
    mask: torch.Tensor | None
    source: tuple | None = None  # ``gather_rows``' description of the values, made once
    mask_source: tuple | None = None  # and of the mask


def prepare_row_group(specs: list, table: pa.Table) -> tuple[list, int]:
    """(each column of a decoded row group as a ``_Column``, or None where its batches go
    through Arrow (dictionary columns, several chunks, list values with nulls); the bytes
    made beyond the table's own). Runs on the decode thread: the fetch only slices these."""
    columns, extra = [], 0
    for spec, column in zip(specs, table.columns):
        try:
            prepared = _prepare_column(spec, column) if column.num_chunks == 1 else None
        except (pa.ArrowException, ValueError, TypeError, IndexError):
            prepared = None  # the batches that read it go through Arrow, and raise there, typed
        columns.append(prepared)
        if prepared is not None:
            extra += prepared.valid.nbytes if prepared.valid is not None else 0
            extra += prepared.values.nbytes if spec.kind == "bool" else 0
    return columns, extra


def _prepare_column(spec: ColumnSpec, column: pa.ChunkedArray) -> _Column | None:
    arr = column.chunk(0)
    if spec.kind == "dictionary":
        return None  # a dictionary of each batch's own values: pyarrow encodes the batch's rows
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    valid = _validity(arr) if arr.null_count else None
    offsets = None
    if spec.kind == "fixed":
        values = _fixed(spec, arr)
    elif spec.kind == "bool":
        values = _bools(arr)
    elif spec.kind == "decimal":
        words = np.frombuffer(arr.buffers()[1], dtype=np.int64).reshape(-1, 2)
        values = _tensor(_zero_nulls(words[arr.offset : arr.offset + len(arr), 0], arr))
    elif spec.kind == "bytes":
        large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
        _, offsets_buf, data_buf = arr.buffers()
        offsets = _buffer_view(offsets_buf, np.int64 if large else np.int32, arr.offset, len(arr) + 1)
        values = _tensor(np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8))
    elif spec.kind in ("list", "fixed_list"):
        child = arr.values
        if child.null_count:
            return None  # raised by the batches whose rows hold them (Arrow's route)
        flat = _tensor(_buffer_view(child.buffers()[1], spec.numpy_dtype, child.offset, len(child)))
        if spec.kind == "fixed_list":
            k = spec.width
            values = flat[arr.offset * k : (arr.offset + len(arr)) * k].view(len(arr), k)
        else:
            large = pa.types.is_large_list(arr.type)
            offsets = _buffer_view(arr.buffers()[1], np.int64 if large else np.int32, arr.offset, len(arr) + 1)
            values = flat
    else:
        return None
    if offsets is not None:
        offsets = np.ascontiguousarray(offsets)
    mask = torch.from_numpy(valid) if valid is not None else None
    if offsets is None:
        source = _fixed_source(values)
    else:
        item = values.element_size()
        source = (offsets, values.data_ptr(), values.numel() * item, item, len(offsets) - 1)
    return _Column(values, offsets, valid, mask, source, _fixed_source(mask) if mask is not None else None)


_ONES = torch.ones(0, dtype=torch.bool)


def _ones(n: int) -> torch.Tensor:
    """``n`` True values: a slice of one shared tensor (the loader only reads it)."""
    global _ONES
    if len(_ONES) < n:
        _ONES = torch.ones(max(n, 2 * len(_ONES)), dtype=torch.bool)
    return _ONES[:n]


def range_tensors(path: str, specs: list, spans: list, table_of) -> dict:
    """The batch dict of consecutive rows: ``spans`` is (prepared columns of a row group, first
    row, end row) for each row group they span, in order; ``table_of()`` the same rows in Arrow,
    for the columns not prepared (made only for those). Same keys and values as
    ``columns_to_tensors(table)``: values and masks as ``PendingConcat``, offsets as
    ``PendingOffsets``, rebased in the slot. The fetch itself does a few Python operations a
    column: the bytes are moved by the stager, without the GIL, several fetches at once."""
    out, table = {}, None
    for j, spec in enumerate(specs):
        parts = [(columns[j], start, stop) for columns, start, stop in spans if stop > start]
        if not parts or any(column is None for column, _, _ in parts):
            table = table_of() if table is None else table
            out.update(_column_tensors(path, spec, table.column(j)))
            continue
        name = spec.name
        for column, start, stop in parts:
            if column.valid is not None and not spec.masked and not column.valid[start:stop].all():
                raise ParquetDecodeError(
                    path, "holds nulls that its statistics did not report; open with masks='always'", column=name
                )
        if parts[0][0].offsets is None:
            pieces = [column.values[start:stop] for column, start, stop in parts]
            out[name] = pieces[0] if len(pieces) == 1 else PendingConcat(pieces)
        else:
            pieces, offsets = _ragged_range(parts)
            out[name] = pieces[0] if len(pieces) == 1 else PendingConcat(pieces)
            out[name + "__offsets"] = offsets
        if spec.masked:
            masks = [
                column.mask[start:stop] if column.mask is not None else _ones(stop - start)
                for column, start, stop in parts
            ]
            out[name + "__valid"] = PendingConcat(masks)  # never a view of shared ones or the row group's
    return out


def can_plan_ranges() -> bool:
    """Whether ``planned_range`` can run here (the extension built with its planner)."""
    return _plan_range is not None


_DESCRIPTOR_WIDTH = 7  # int64 values a column takes in a row group's descriptor (range_plan.h)


def range_descriptor(columns: list) -> tuple | None:
    """A decoded row group's prepared columns (``prepare_row_group``) as ``plan_range`` reads
    them: (int64 array of ``_DESCRIPTOR_WIDTH`` values a column, the columns' (dtype, row shape,
    ragged) signature); None where a column is not prepared (its batches go through Arrow).
    Made once, on the decode thread; the addresses stay valid while ``columns`` lives."""
    if not columns or any(column is None for column in columns):
        return None
    values = np.zeros((len(columns), _DESCRIPTOR_WIDTH), dtype=np.int64)
    signature = []
    for j, column in enumerate(columns):
        offsets, pointer, nbytes, item, rows = column.source
        if offsets is not None:
            values[j, 0], values[j, 1] = offsets.ctypes.data, offsets.itemsize
        values[j, 2:6] = (pointer, nbytes, item, rows)
        if column.valid is not None:
            values[j, 6] = column.valid.ctypes.data
        signature.append((column.values.dtype, tuple(column.values.shape[1:]), offsets is not None))
    return values.reshape(-1), tuple(signature)


def planned_range(path: str, specs: list, spans: list, direct_regions: np.ndarray, row_groups: list | None = None):
    """The batch of consecutive rows ``spans`` ((decoded row group, first row, end row) for each
    row group they span, in order; ``row_groups``: their indices in the file, for errors) planned
    in one C++ call without the GIL (``_C.plan_range``): a ``PlannedBatch`` the stager copies
    into the slot and on to the device in one more call. None where a row group has a column not
    prepared, or the row groups' columns differ in layout: ``range_tensors`` takes those. Keys,
    dtypes and bytes are those of ``range_tensors``."""
    parts = [(k, group, start, stop) for k, (group, start, stop) in enumerate(spans) if stop > start]
    if not parts or any(group.ranged is None for _, group, _, _ in parts):
        return None
    signature = parts[0][1].ranged[1]
    if any(group.ranged[1] != signature for _, group, _, _ in parts[1:]):
        return None
    flat_spans = []
    for k, (_, _, start, stop) in enumerate(parts):
        flat_spans += (k, start, stop)
    masked = [1 if spec.masked else 0 for spec in specs]

    def row_group(k: int) -> int | None:
        at = parts[k][0] if 0 <= k < len(parts) else None
        return row_groups[at] if row_groups is not None and at is not None and at < len(row_groups) else None

    try:
        plan = _plan_range([group.ranged[0] for _, group, _, _ in parts], flat_spans, masked, ALIGN, direct_regions)
    except ValueError as exc:  # RangeError: rows or offsets outside a row group (a corrupt page)
        column, k = _named_by(str(exc))
        raise ParquetDecodeError(
            path,
            f"a batch's rows cannot be cut: {exc}",
            row_group=row_group(k) if k is not None else None,
            column=specs[column].name if column is not None and column < len(specs) else None,
        ) from None
    if plan.bad_column >= 0:
        raise ParquetDecodeError(
            path,
            "holds nulls that its statistics did not report; open with masks='always'",
            row_group=row_group(plan.bad_group),
            column=specs[plan.bad_column].name,
        )
    keys, dtypes, tails = _planned_fields(specs, signature)
    return PlannedBatch(plan, keys, dtypes, tails, keep=[group for _, group, _, _ in parts])


def _named_by(message: str) -> tuple:
    """(column position, span's row group) a planner error names ("column #j ... row group #k")."""

    def number(marker: str) -> int | None:
        tail = message.split(marker, 1)
        digits = "".join(itertools.takewhile(str.isdigit, tail[1])) if len(tail) == 2 else ""
        return int(digits) if digits else None

    return number("column #"), number("row group #")


_FIELDS: dict = {}  # (column names and masks, signature) -> the batch dict's keys, dtypes, row shapes


def _planned_fields(specs: list, signature: tuple) -> tuple:
    key = (tuple((spec.name, spec.masked) for spec in specs), signature)
    fields = _FIELDS.get(key)
    if fields is None:
        keys, dtypes, tails = [], [], []
        for spec, (dtype, tail, ragged) in zip(specs, signature):
            keys.append(spec.name), dtypes.append(dtype), tails.append(tail)
            if ragged:
                keys.append(spec.name + "__offsets"), dtypes.append(torch.int64), tails.append(())
            if spec.masked:
                keys.append(spec.name + "__valid"), dtypes.append(torch.bool), tails.append(())
        fields = _FIELDS[key] = (keys, dtypes, tails)
    return fields


def _ragged_range(parts: list) -> tuple[list, PendingOffsets]:
    """The values of each row group's rows, and their offsets rebased onto one another and
    widened to int64 as the stager writes them (``PendingOffsets``)."""
    pieces, sources, starts, counts, shifts = [], [], [], [], []
    at = 0  # values of the batch before this row group's
    for column, start, stop in parts:
        low, high = int(column.offsets[start]), int(column.offsets[stop])
        pieces.append(column.values[low:high])
        first = start if not sources else start + 1  # the batch's leading 0 comes from the first
        sources.append(column.offsets)
        starts.append(first)
        counts.append(stop + 1 - first)
        shifts.append(at - low)
        at += high - low
    return pieces, PendingOffsets(sources, starts, counts, shifts)


# -- a shuffled batch's rows cut from its decoded row groups' columns, in one C++ call -------
class RowsGather(NamedTuple):
    """A batch's rows (int64, in batch order) within its decoded row groups, counted through
    them back to back, and each row group's prepared columns (``prepare_row_group``)."""

    groups: list  # per row group: its prepared columns
    sizes: list  # per row group: its rows
    rows: np.ndarray


def can_gather() -> bool:
    """Whether ``gather_tensors`` can run here (the extension built)."""
    return _gather_rows is not None


def _owned_tensor(buffer, dtype: torch.dtype, tail: tuple) -> torch.Tensor:
    """The C++ buffer ``buffer`` (``OwnedBytes``) as a tensor of ``dtype``, rows of ``tail``,
    without a copy (the tensor keeps the buffer alive)."""
    if not len(buffer):
        return torch.empty((0,) + tail, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
    return flat.view((-1,) + tail)


def gather_tensors(path: str, specs: list, gather: RowsGather, table_of, threads: int) -> dict:
    """The batch dict of ``gather.rows``: every column prepared in all the batch's row groups
    has its rows (values, offsets, masks) gathered by one ``gather_rows`` call without the GIL;
    the same keys and values as ``columns_to_tensors`` of the same rows. pyarrow's take, the
    route before, made a Python call a column, appended each string on its own and joined a
    column's row groups first (4-5 ms of a 16K-row alert batch on the H200, most of the
    loader's time a batch). ``table_of()``: the rows in Arrow, for the other columns (made only
    for those)."""
    rows = gather.rows
    n = len(rows)
    firsts = np.cumsum([0] + list(gather.sizes))
    out: dict = {}
    table = None
    descriptors, places = [], []  # places: (key, dtype, row shape, ragged) of each descriptor
    held: list = []  # tensors the descriptors point into that nothing else keeps alive
    for j, spec in enumerate(specs):
        parts = [group[j] for group in gather.groups]
        if any(part is None for part in parts):
            table = table_of() if table is None else table
            out.update(_column_tensors(path, spec, table.column(j)))
            continue
        name = spec.name
        if not spec.masked:
            for g, part in enumerate(parts):
                if part.valid is None:
                    continue
                mine = rows[(rows >= firsts[g]) & (rows < firsts[g + 1])] - firsts[g]
                if not part.valid[mine].all():
                    raise ParquetDecodeError(
                        path, "holds nulls that its statistics did not report; open with masks='always'", column=name
                    )
        first = parts[0]
        descriptors.append([part.source for part in parts])
        places.append((name, first.values.dtype, tuple(first.values.shape[1:]), first.offsets is not None))
        out[name] = None  # the key's place in the batch, as columns_to_tensors orders them
        if first.offsets is not None:
            out[name + "__offsets"] = None
        if spec.masked:
            if all(part.mask is None for part in parts):
                out[name + "__valid"] = PendingConcat([_ones(n)])  # never a view of the shared ones
            else:
                ones = [_ones(size) for part, size in zip(parts, gather.sizes) if part.mask is None]
                held.extend(ones)  # alive through the call: another fetch may grow the shared ones
                fill = iter(ones)
                descriptors.append(
                    [part.mask_source if part.mask is not None else _fixed_source(next(fill)) for part in parts]
                )
                places.append((name + "__valid", torch.bool, (), False))
                out[name + "__valid"] = None
    if descriptors:
        results = _gather_rows(descriptors, np.ascontiguousarray(rows, dtype=np.int64), threads)
        for (key, dtype, tail, ragged), (offsets, values) in zip(places, results):
            out[key] = _owned_tensor(values, dtype, tail)
            if ragged:
                out[key + "__offsets"] = _owned_tensor(offsets, torch.int64, ())
    return out
