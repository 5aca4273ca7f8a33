"""Parquet files opened once: footers checked and parsed, schemas compared, columns typed, and
the plan of every row group (its rows, and the byte range of each column chunk).

Footers are input. Before pyarrow parses one, its bytes are checked here (``PAR1`` at both
ends, a footer length that fits in the file), so a file that is not Parquet, truncated or still
being written gets a ``ParquetFormatError`` naming it instead of whatever the Thrift parser
makes of it; the parsed metadata is then checked against the file's size (every chunk's bytes
inside the data area, row counts that add up).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import ParquetFormatError, ParquetSchemaError
from .parquet_footer import check_footer

__all__ = ["ColumnSpec", "RowGroup", "ParquetPlan", "expand_paths", "read_footer", "column_spec", "open_plan"]

MAGIC = b"PAR1"
_MAX_FOOTER = 1 << 30  # a footer larger than this is corrupt, not a schema

# Arrow primitive types -> (torch dtype of the output, numpy dtype of the Arrow value buffer).
_FIXED = {
    pa.int8(): (torch.int8, np.int8),
    pa.int16(): (torch.int16, np.int16),
    pa.int32(): (torch.int32, np.int32),
    pa.int64(): (torch.int64, np.int64),
    pa.uint8(): (torch.uint8, np.uint8),
    pa.uint16(): (torch.uint16, np.uint16),
    pa.uint32(): (torch.uint32, np.uint32),
    pa.uint64(): (torch.uint64, np.uint64),
    pa.float16(): (torch.float16, np.float16),
    pa.float32(): (torch.float32, np.float32),
    pa.float64(): (torch.float64, np.float64),
}


@dataclass(frozen=True)
class ColumnSpec:
    """How one column becomes tensors (module docstring of ``parquet.py`` lists the kinds).

    kind: ``fixed`` (numbers, times: one value per row), ``bool``, ``decimal`` (int64 unscaled),
    ``bytes`` (string/binary: data + offsets), ``list`` (variable list of numbers: values +
    offsets), ``fixed_list`` (a 2-D tensor), ``dictionary`` (int32 codes + dictionary bytes).
    """

    name: str
    arrow_type: pa.DataType
    kind: str
    dtype: torch.dtype  # of the values (codes for ``dictionary``, bytes for ``bytes``)
    numpy_dtype: type | None  # of the Arrow value buffer (fixed kinds)
    width: int = 0  # fixed_list: values per row
    masked: bool = False  # a ``__valid`` mask is part of every batch
    unit: str = ""  # times: the unit of the int64 values; decimals: "scale=N"


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file: its rows in the dataset, and its column chunks' byte ranges."""

    file: int
    index: int  # within its file
    first_row: int  # dataset-global
    rows: int
    chunks: dict  # column name -> list of (offset, length), one per leaf column
    start: int  # the span of the selected chunks in the file
    end: int


@dataclass
class ParquetPlan:
    paths: list
    sizes: list
    metadata: list  # pyarrow FileMetaData per file
    schema: pa.Schema  # the selected columns, as Arrow reads them
    columns: list  # ColumnSpec
    row_groups: list  # RowGroup, in file then row-group order
    starts: np.ndarray  # int64 first row of every row group (+ the total at the end)
    leaves: list  # per file: column name -> indices of its leaf columns (names may hold dots)

    @property
    def rows(self) -> int:
        return int(self.starts[-1])


def expand_paths(source) -> list:
    """One file, a directory (its ``*.parquet`` files, sorted), a glob, or a list of these."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    paths = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "*.parquet")) + glob.glob(os.path.join(item, "*.parq")))
            if not found:
                raise FileNotFoundError(f"no *.parquet files in directory {item!r}")
            paths += found
        elif any(c in item for c in "*?["):
            found = sorted(glob.glob(item))
            if not found:
                raise FileNotFoundError(f"no files match {item!r}")
            paths += found
        else:
            if not os.path.exists(item):
                raise FileNotFoundError(f"Parquet file {item!r} does not exist")
            paths.append(item)
    if not paths:
        raise ValueError("ParquetDataset needs at least one file")
    return paths


def read_footer(path: str) -> tuple[int, pq.FileMetaData, list]:
    """``(file size, metadata, the top-level column of each leaf column)`` of a Parquet file,
    its footer bytes checked before parsing."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not os.path.isfile(path):
            raise ParquetFormatError(path, "not a regular file")
        if size < 12:
            raise ParquetFormatError(path, f"{size} bytes is too short for Parquet (at least 12)")
        head = os.pread(f.fileno(), 4, 0)
        tail = os.pread(f.fileno(), 8, size - 8)
        if head != MAGIC:
            raise ParquetFormatError(path, f"not a Parquet file (starts with {head!r}, not {MAGIC!r})")
        if tail[4:] != MAGIC:
            raise ParquetFormatError(path, f"no {MAGIC!r} at the end ({tail[4:]!r}): truncated, or still being written")
        length = int.from_bytes(tail[:4], "little")
        if length <= 0 or length > min(size - 12, _MAX_FOOTER):
            raise ParquetFormatError(path, f"footer length {length} does not fit in the file's {size} bytes")
        footer = os.pread(f.fileno(), length, size - 8 - length)
    if len(footer) != length:
        raise ParquetFormatError(path, "the file shrank while its footer was read")
    owners = check_footer(path, footer)  # pyarrow can abort the process on some corrupt footers
    try:  # parsed from memory: a footer alone, framed as a file
        metadata = pq.read_metadata(pa.BufferReader(MAGIC + footer + tail))
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise ParquetFormatError(path, f"corrupt footer ({exc})") from None
    if metadata.num_columns != len(owners):
        raise ParquetFormatError(
            path, f"pyarrow reads {metadata.num_columns} leaf columns, the footer lists {len(owners)}"
        )
    return size, metadata, owners


def _unit(arrow_type) -> str:
    if pa.types.is_timestamp(arrow_type) or pa.types.is_duration(arrow_type):
        return arrow_type.unit
    if pa.types.is_time(arrow_type):
        return arrow_type.unit
    if pa.types.is_date32(arrow_type):
        return "days"
    if pa.types.is_date64(arrow_type):
        return "ms"
    return ""


def column_spec(path: str, field: pa.Field, masked: bool, dictionary: bool) -> ColumnSpec:
    """The tensor form of ``field``, or ``ParquetSchemaError`` naming the column and its type."""
    t, name = field.type, field.name
    if pa.types.is_dictionary(t):  # a file written with the Arrow schema stored: decode as values
        t = t.value_type
    if t in _FIXED:
        return ColumnSpec(name, t, "fixed", *_FIXED[t], masked=masked)
    if pa.types.is_boolean(t):
        return ColumnSpec(name, t, "bool", torch.bool, None, masked=masked)
    if pa.types.is_timestamp(t) or pa.types.is_duration(t) or pa.types.is_time64(t) or pa.types.is_date64(t):
        return ColumnSpec(name, t, "fixed", torch.int64, np.int64, masked=masked, unit=_unit(t))
    if pa.types.is_time32(t) or pa.types.is_date32(t):  # widened to int64 (the unit is kept)
        return ColumnSpec(name, t, "fixed", torch.int64, np.int32, masked=masked, unit=_unit(t))
    if pa.types.is_decimal128(t) and t.precision <= 18:
        return ColumnSpec(name, t, "decimal", torch.int64, None, masked=masked, unit=f"scale={t.scale}")
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        kind = "dictionary" if dictionary else "bytes"
        return ColumnSpec(name, t, kind, torch.int32 if dictionary else torch.uint8, None, masked=masked)
    if pa.types.is_fixed_size_list(t) and t.value_type in _FIXED:
        dtype, numpy_dtype = _FIXED[t.value_type]
        return ColumnSpec(name, t, "fixed_list", dtype, numpy_dtype, width=t.list_size, masked=masked)
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and t.value_type in _FIXED:
        dtype, numpy_dtype = _FIXED[t.value_type]
        return ColumnSpec(name, t, "list", dtype, numpy_dtype, masked=masked)
    why = " (precision > 18 does not fit int64)" if pa.types.is_decimal(t) else ""
    raise ParquetSchemaError(
        path, f"type {field.type} has no tensor form{why}; leave it out with columns=", column=name
    )


def _may_hold_nulls(metadata, leaves: list, field: pa.Field) -> bool:
    """Whether a column needs a validity mask: optional in the schema, and some row group's
    statistics report nulls or report no null count at all."""
    if not field.nullable:
        return False
    for r in range(metadata.num_row_groups):
        group = metadata.row_group(r)
        if group.num_rows == 0:
            continue
        for j in leaves:
            stats = group.column(j).statistics
            if stats is None or not stats.has_null_count or stats.null_count > 0:
                return True
    return False


def _leaf_columns(owners: list) -> dict:
    """Top-level column name -> indices of its leaf columns in the row groups."""
    leaves: dict = {}
    for j, name in enumerate(owners):
        leaves.setdefault(name, []).append(j)
    return leaves


def _check_chunks(path: str, size: int, metadata, r: int, names: list, leaves: dict) -> tuple[dict, int, int]:
    group = metadata.row_group(r)
    data_end = size - 8 - metadata.serialized_size
    chunks, start, end = {}, size, 0
    for name in names:
        ranges = []
        for j in leaves[name]:
            col = group.column(j)
            offset = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset is not None and col.dictionary_page_offset > 0:
                offset = min(offset, col.dictionary_page_offset)
            length = col.total_compressed_size
            if offset < 4 or length < 0 or offset + length > data_end:
                raise ParquetFormatError(
                    path,
                    f"column chunk at offset {offset}, {length} bytes lies outside the data area "
                    f"[4, {data_end}) (corrupt footer or truncated file)",
                    row_group=r,
                    column=name,
                )
            ranges.append((offset, length))
            start, end = min(start, offset), max(end, offset + length)
        chunks[name] = ranges
    return chunks, start, end


def open_plan(paths: list, columns, masks: str, dictionary_columns) -> ParquetPlan:
    """Read every footer, compare the schemas, type the columns and plan the row groups."""
    sizes, metas, owners, schema = [], [], [], None
    for path in paths:
        size, meta, leaf_owners = read_footer(path)
        owners.append(leaf_owners)
        try:
            arrow_schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, ValueError) as exc:
            raise ParquetFormatError(path, f"schema cannot be read as Arrow ({exc})") from None
        if schema is None:
            schema, first = arrow_schema, path
        names = columns if columns is not None else schema.names
        for name in names:
            if arrow_schema.get_field_index(name) < 0:
                raise ParquetSchemaError(path, f"no such column (the file has {arrow_schema.names})", column=name)
            if schema.get_field_index(name) < 0 or not arrow_schema.field(name).type.equals(schema.field(name).type):
                theirs = schema.field(name).type if schema.get_field_index(name) >= 0 else "no such column"
                raise ParquetSchemaError(
                    path,
                    f"type {arrow_schema.field(name).type} differs from {theirs} in {first!r} "
                    "(schemas are compared before the epoch)",
                    column=name,
                )
        if columns is None and arrow_schema.names != schema.names:
            raise ParquetSchemaError(path, f"columns {arrow_schema.names} differ from {schema.names} in {first!r}")
        sizes.append(size)
        metas.append(meta)
    names = list(columns) if columns is not None else list(schema.names)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"columns must be distinct and not empty, got {names}")
    dictionary = set(dictionary_columns or ())
    unknown = dictionary - set(names)
    if unknown:
        raise ValueError(f"dictionary_columns {sorted(unknown)} are not among the columns read")
    specs, row_groups, starts, total = [], [], [], 0
    leaves_of = [_leaf_columns(o) for o in owners]
    for name in names:
        field = schema.field(name)
        if masks == "always":
            masked = field.nullable
        elif masks == "never":
            masked = False
        else:
            masked = any(_may_hold_nulls(m, lv[name], field) for m, lv in zip(metas, leaves_of))
        specs.append(column_spec(paths[0], field, masked, name in dictionary))
    for f, (path, size, meta) in enumerate(zip(paths, sizes, metas)):
        counted = 0
        for r in range(meta.num_row_groups):
            rows = meta.row_group(r).num_rows
            if rows < 0:
                raise ParquetFormatError(path, f"negative row count {rows}", row_group=r)
            if rows == 0:  # nothing to read (writers leave empty chunks at offset 0)
                continue
            chunks, start, end = _check_chunks(path, size, meta, r, names, leaves_of[f])
            row_groups.append(RowGroup(f, r, total, rows, chunks, start, end))
            starts.append(total)
            total += rows
            counted += rows
        if counted != meta.num_rows:
            raise ParquetFormatError(path, f"row groups hold {counted} rows, the footer says {meta.num_rows}")
    starts.append(total)
    selected = pa.schema([schema.field(n) for n in names])
    starts = np.asarray(starts, dtype=np.int64)
    return ParquetPlan(paths, sizes, metas, selected, specs, row_groups, starts, leaves_of)
