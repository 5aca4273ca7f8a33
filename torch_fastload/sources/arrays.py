"""Array files (.npy, or raw fixed-size records) as a Dataset whose batches are byte-range reads.

A sample is row ``i`` of every file; a batch becomes one ``PendingRead`` per file, which the
stager hands to the C++ engine: rows are read straight into the pinned slot (neighbouring
rows coalesce into one read), with no per-sample Python. ``__getitem__`` still works row by
row through a memmap, so torch's own DataLoader gives the same batches (the tests check it).

Headers are input: a .npy header is validated against the file's size before any read.
Files may be ``s3://`` / ``http(s)://`` URLs: the header is read with a range request, the
object's size and version are pinned (``remote.open_object``) and batches are read remotely.
"""

from __future__ import annotations

import io
import math
import os
import tokenize
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import fileio
from ..errors import FastloadError
from ..remote import RemoteObject, is_url, open_object
from ..remote import objects as files
from ..staging import PendingRead
from .protocol import FileRows, NativeLayout

__all__ = ["ArrayFile", "ArrayDataset", "ArrayFormatError", "read_npy_header"]

_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex


class ArrayFormatError(FastloadError, ValueError):
    """An array file whose header or size cannot describe the rows it claims."""

    def __init__(self, path: str, problem: str):
        self.path = files.shown(path)
        super().__init__(f"{self.path}: {problem}")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class _DtypeTable(dict):
    """numpy -> torch dtypes, worked out once each (batches ask for them on the hot path)."""

    def __missing__(self, dtype):
        value = self[dtype] = _torch_dtype(dtype)
        return value


_TORCH_DTYPES = _DtypeTable()


def _check_dtype(path: str, dtype: np.dtype) -> np.dtype:
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in _NUMERIC_KINDS:
        raise ArrayFormatError(path, f"dtype {dtype.str!r} is not a plain numeric dtype")
    if dtype.byteorder == ">" and dtype.itemsize > 1:
        raise ArrayFormatError(path, f"dtype {dtype.str!r} is big-endian; only little-endian is read")
    try:
        _torch_dtype(dtype)
    except TypeError:
        raise ArrayFormatError(path, f"dtype {dtype.str!r} has no torch equivalent") from None
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def _open_header(path: str, obj: RemoteObject | None):
    """``(stream, size)``: the file, or the first bytes of the object (enough for its header)."""
    if obj is None:
        f = fileio.open_binary(path)  # FileNotFoundError / IsADirectoryError / NotRegularFileError
        return f, os.fstat(f.fileno()).st_size
    head = files.read(path, 0, min(obj.size, 1 << 16))
    if len(head) >= 12 and head[6] >= 2:  # format 2.0+: a 4-byte header length
        needed = 12 + int.from_bytes(head[8:12], "little")
        if needed > len(head):
            head = files.read(path, 0, min(obj.size, needed))
    return io.BytesIO(head), obj.size


def read_npy_header(path: str, remote: RemoteObject | None = None) -> tuple[np.dtype, tuple, int]:
    """(dtype, shape, data offset) of a .npy file, checked against the file's size. A URL is
    read as the object ``remote`` (opened now if not given)."""
    dtype, shape, offset, _ = _read_npy_header(path, remote)
    return dtype, shape, offset


def _read_npy_header(path: str, remote: RemoteObject | None):
    """``read_npy_header`` plus the identity of the local file the header was read from."""
    if is_url(path) and remote is None:
        remote = open_object(path)
    f, size = _open_header(path, remote)
    pinned = None if remote is not None else fileio.identity_of(os.fstat(f.fileno()))
    with f:
        try:
            version = np.lib.format.read_magic(f)
            readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in readers:
                raise ValueError(f"format version {version} is not supported")
            shape, fortran_order, dtype = readers[version](f)
        except (ValueError, OSError, EOFError, SyntaxError, TypeError, RecursionError, tokenize.TokenError) as exc:
            # TokenError: a header length that cuts the header's dict short
            raise ArrayFormatError(path, f"not a valid .npy header ({type(exc).__name__}: {exc})") from None
        offset = f.tell()
    if fortran_order:
        raise ArrayFormatError(path, "Fortran-ordered arrays are not supported (save it C-contiguous)")
    if len(shape) == 0:
        raise ArrayFormatError(path, "a 0-d array has no rows")
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ArrayFormatError(path, f"header shape {tuple(shape)} has a negative or non-integer dimension")
    dtype = _check_dtype(path, dtype)
    needed = offset + math.prod(shape) * dtype.itemsize
    if needed > size:
        raise ArrayFormatError(
            path,
            f"header says shape {tuple(shape)} of {dtype.str} = {needed - offset} bytes "
            f"from offset {offset}, but the file has only {size} bytes",
        )
    return dtype, tuple(shape), offset, pinned


@dataclass(frozen=True)
class ArrayFile:
    """Where the rows of one array live in one file."""

    path: str
    dtype: np.dtype
    shape: tuple  # (rows, *row_shape)
    offset: int  # byte offset of row 0
    remote: RemoteObject | None = field(default=None, compare=False)  # a URL's size and version
    pin: fileio.FileIdentity | None = field(default=None, compare=False)  # a local file as opened

    @classmethod
    def npy(cls, path: str | os.PathLike, cache_dir: str | None = None) -> ArrayFile:
        """A .npy file or URL (``cache_dir``: the shard cache for a URL; None: configured)."""
        path = os.fspath(path)
        remote = open_object(path, cache_dir) if is_url(path) else None
        dtype, shape, offset, pinned = _read_npy_header(path, remote)
        return cls(path, dtype, shape, offset, remote, pinned)

    @classmethod
    def raw(
        cls, path: str | os.PathLike, dtype, row_shape=(), offset: int = 0, cache_dir: str | None = None
    ) -> ArrayFile:
        """A headerless file (or URL) of fixed-size records (``row_shape`` of ``dtype`` each)."""
        path = os.fspath(path)
        dtype = _check_dtype(path, np.dtype(dtype))
        row_bytes = math.prod(row_shape) * dtype.itemsize
        if row_bytes <= 0:
            raise ArrayFormatError(path, f"records of shape {tuple(row_shape)} hold no bytes")
        remote = open_object(path, cache_dir) if is_url(path) else None
        pinned = None if remote is not None else fileio.pin(path)
        size = remote.size if remote is not None else pinned.size
        if offset < 0 or offset > size or (size - offset) % row_bytes:
            raise ArrayFormatError(
                path, f"{size} bytes from offset {offset} are not a whole number of {row_bytes}-byte records"
            )
        return cls(path, dtype, ((size - offset) // row_bytes, *row_shape), offset, remote, pinned)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    def memmap(self) -> np.memmap:
        if self.pin is not None:
            fileio.check_unchanged(self.path, self.pin)  # the map then holds the file as opened
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)

    def read_row(self, row: int) -> np.ndarray:
        """Row ``row`` (already range-checked) read on its own (a URL's sample path)."""
        data = files.read(self.path, self.offset + row * self.row_bytes, self.row_bytes)
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape[1:]).copy()

    def pending_rows(self, index: np.ndarray) -> PendingRead:
        """Rows ``index`` (already range-checked) as one read plan for the stager."""
        return PendingRead(
            self.path,
            self.offset + index * self.row_bytes,
            self.row_bytes,
            (len(index), *self.shape[1:]),
            self.torch_dtype,
            pins=[self.pin],
        )


def _as_file(item, cache_dir: str | None) -> ArrayFile:
    if isinstance(item, ArrayFile):
        return item
    return ArrayFile.npy(item, cache_dir)


class ArrayDataset(Dataset):
    """Sample ``i`` is row ``i`` of each file: a tensor for one file, a tuple for several.

    ``ArrayDataset("features.npy", "labels.npy")`` or with ``ArrayFile.raw(...)`` records;
    files may be ``s3://`` / ``http(s)://`` URLs (``cache_dir``: their shard cache).
    With torch_fastload's DataLoader (``num_workers=0``, default collate) batches are read
    straight into the pinned slot by the C++ engine (URLs by the remote reader).
    """

    def __init__(self, *files, cache_dir: str | None = None):
        if not files:
            raise ValueError("ArrayDataset needs at least one file")
        self.files = [_as_file(f, cache_dir) for f in files]
        self.remote_objects = [f.remote for f in self.files if f.remote is not None]
        rows = {f.rows for f in self.files}
        if len(rows) != 1:
            raise ValueError(f"array files differ in length: {[(f.path, f.rows) for f in self.files]}")
        self._rows = rows.pop()
        self._maps: list | None = None

    def __len__(self) -> int:
        return self._rows

    def _check(self, indices) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        index = np.where(index < 0, index + self._rows, index)
        bad = (index < 0) | (index >= self._rows)
        if bad.any():
            raw = np.asarray(indices, dtype=np.int64).reshape(-1)[bad][0]
            raise IndexError(f"index {raw} is out of range for {files.shown(self.files[0].path)} ({self._rows} rows)")
        return index

    def __getitem__(self, i):
        row = int(self._check([i])[0])
        if self._maps is None:
            self._maps = [None if f.remote is not None else f.memmap() for f in self.files]
        rows = tuple(
            torch.from_numpy(np.array(m[row]) if m is not None else f.read_row(row))
            for f, m in zip(self.files, self._maps)
        )
        return rows[0] if len(rows) == 1 else rows

    def __fastload_batch__(self, indices):
        """What default_collate would make of ``[self[i] for i in indices]``, as read plans."""
        index = self._check(indices)
        reads = [f.pending_rows(index) for f in self.files]
        return reads[0] if len(reads) == 1 else reads  # default_collate turns tuples into lists

    def __fastload_native__(self) -> NativeLayout:
        """Every field is fixed-size rows of a file: the loader's C++ loop plans batches itself."""
        fields = tuple(FileRows(f.path, f.offset, f.rows, f.torch_dtype, tuple(f.shape[1:]), f.pin) for f in self.files)
        return NativeLayout(fields, _first_or_list)

    def __getstate__(self):  # memmaps are reopened in each worker process
        state = dict(self.__dict__)
        state["_maps"] = None
        return state


def _first_or_list(fields: list):
    """The batch default_collate makes of one-file samples (a tensor) or of tuples (a list)."""
    return fields[0] if len(fields) == 1 else fields
