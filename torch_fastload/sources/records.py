"""Packed records: variable-length samples (JPEG bytes, token sequences, blobs) in shard files.

Layout of a pack (written by ``torch_fastload.pack`` / ``python -m torch_fastload pack``)::

    meta.json        format, version, record count, shard files, sizes and CRC-32s, class names
    index.npy        int64 (N, 3): shard, offset, length of every record
    labels.npy       int64 (N,), when the records are labelled
    names.txt        one source name per record, when the writer knew them (error messages)
    shard-00000.bin  records back to back (optionally padded to an alignment)

A batch of records is one read plan: every record's byte range goes back to back into one
slab (pinned, or device memory on the GDS path), so a batch costs one engine call, and the
batch arrives as ``RecordBatch(data, offsets, labels)``: record ``i`` is
``data[offsets[i]:offsets[i + 1]]``.

The index is input: it is checked against the shard files when the pack is opened (every
range inside its shard, no shard listed twice) and again by the engine at read time. Shards
are pinned as opened: one replaced or rewritten later fails the batch that reads it with
``FileChangedError``. Their sizes are checked against meta.json on open; with ``verify=
"checksum"`` (option ``pack_verify``, ``TORCH_FASTLOAD_PACK_VERIFY``) their CRC-32s too, which
reads every shard once. Packs written before checksums were recorded open all the same
(sizes only).
A pack may live in object storage (``RecordDataset("s3://bucket/pack")``): its metadata is
read at open, its shards' sizes and versions pinned, and batches read by the remote reader.
"""

from __future__ import annotations

import io
import json
import os
import tokenize
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import config, fileio
from ..errors import FastloadError, NotRegularFileError
from ..remote import is_url
from ..remote import objects as files
from ..staging import ALIGN, PendingRead
from .protocol import MemoryRows, NativeLayout, Records

__all__ = ["RecordDataset", "RecordBatch", "RecordFormatError", "FORMAT", "VERSION", "largest_batch_bytes"]

FORMAT = "torch_fastload.records"
VERSION = 1


class RecordFormatError(FastloadError, ValueError):
    """A pack whose metadata, index or shards do not describe readable records."""

    def __init__(self, path: str, problem: str):
        self.path = files.shown(path)
        super().__init__(f"{self.path}: {problem}")


class RecordBatch(NamedTuple):
    """A batch of records in one slab: record ``i`` is ``data[offsets[i]:offsets[i + 1]]``."""

    data: torch.Tensor  # uint8, every record's bytes back to back
    offsets: torch.Tensor  # int64, len(batch) + 1 offsets into ``data``
    labels: torch.Tensor | None  # int64 per record, or None for unlabelled packs

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def split(self) -> list[torch.Tensor]:
        """One uint8 view per record (reads ``offsets`` on the host: a sync if it is on a GPU)."""
        bounds = self.offsets.tolist()
        return [self.data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def largest_batch_bytes(sizes: np.ndarray, batch_size: int) -> int:
    """The bytes of the ``batch_size`` largest items: what any batch of variable-size items
    fits in (sizes a pinned pool once)."""
    k = min(batch_size, len(sizes))
    return int(np.partition(sizes, len(sizes) - k)[len(sizes) - k :].sum()) if k else 0


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _load_json(path: str) -> dict:
    try:
        meta = json.loads(files.load(path), parse_constant=_refuse_constant)  # no Infinity / NaN
    except FileNotFoundError:
        raise RecordFormatError(path, "missing: not a finished pack (the writer writes meta.json last)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordFormatError(path, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise RecordFormatError(path, "not valid pack metadata (nested too deeply)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RecordFormatError(
            path, f"not a {FORMAT} pack (format={meta.get('format') if isinstance(meta, dict) else meta!r})"
        )
    if meta.get("version") != VERSION:
        raise RecordFormatError(path, f"version {meta.get('version')!r} is not supported (this reader: {VERSION})")
    return meta


def _load_int64(path: str, shape_ok, what: str) -> np.ndarray:
    try:
        array = np.load(io.BytesIO(files.load(path)), allow_pickle=False)
    except FileNotFoundError:
        raise
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, RecursionError, tokenize.TokenError) as exc:
        raise RecordFormatError(path, f"not a readable .npy {what} ({type(exc).__name__}: {exc})") from None
    if array.dtype != np.int64 or not shape_ok(array.shape):
        raise RecordFormatError(path, f"{what} must be int64 of the documented shape, got {array.dtype} {array.shape}")
    return array


class RecordDataset(Dataset):
    """A pack of records: ``ds[i]`` is ``(uint8 tensor, label)`` (just the tensor when unlabelled).

    With torch_fastload's DataLoader a batch is read straight into one slab and arrives as a
    ``RecordBatch``; with torch's own DataLoader pass ``collate_fn=dataset.collate`` to get
    the same ``RecordBatch`` (the tests check they are equal). ``root`` may be an
    ``s3://`` / ``http(s)://`` URL of the pack's directory (``cache_dir``: the shard cache).
    """

    def __init__(self, root: str | os.PathLike, cache_dir: str | None = None, verify: str | None = None):
        self.root = os.fspath(root)
        remote = is_url(self.root)
        self.root = self.root.rstrip("/") if remote else self.root
        if not remote and not os.path.isdir(self.root):
            raise (FileNotFoundError if not os.path.exists(self.root) else NotADirectoryError)(
                f"pack directory {self.root!r} does not exist"
                if not os.path.exists(self.root)
                else f"{self.root!r} is not a pack directory"
            )
        meta_path = files.join(self.root, "meta.json")
        meta = _load_json(meta_path)
        verify = config.resolve("pack_verify", verify)
        try:
            count = int(meta["num_records"])
            shards = [(str(s["file"]), int(s["bytes"])) for s in meta["shards"]]
            checksums = [s.get("crc32") for s in meta["shards"]]
            if any(c is not None and not isinstance(c, int) for c in checksums):
                raise ValueError("crc32 must be an integer")
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise RecordFormatError(meta_path, f"missing or malformed field ({exc!r})") from None
        if count < 0 or any(os.sep in name or name in ("", ".", "..") for name, _ in shards):
            raise RecordFormatError(meta_path, "negative record count or a shard name that is a path")
        names = [name for name, _ in shards]
        if len(set(names)) != len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise RecordFormatError(meta_path, f"shard {twice!r} is listed {names.count(twice)} times")
        self.meta = meta
        self.classes = meta.get("classes")
        self.shard_paths = [files.join(self.root, name) for name, _ in shards]
        index_path = files.join(self.root, "index.npy")
        self.index = _load_int64(index_path, lambda s: len(s) == 2 and s[1] == 3, "index (N, 3)")
        if len(self.index) != count:
            raise RecordFormatError(index_path, f"holds {len(self.index)} records, meta.json says {count}")
        labels_path = files.join(self.root, "labels.npy")
        self.labels = (
            _load_int64(labels_path, lambda s: s == (count,), f"labels ({count},)")
            if meta.get("labels", False)
            else None
        )
        self.remote_objects = [files.open_object(p, cache_dir) for p in self.shard_paths] if remote else []
        self._check_ranges(index_path, shards)
        if verify == "checksum" and not remote:
            self._verify_checksums(checksums)
        self._names: list | None = None

    def _check_ranges(self, index_path: str, shards) -> None:
        """Every record inside its shard as the shard is now (hostile or stale index => error)."""
        sizes = []
        self.shard_pins = [None] * len(self.shard_paths)  # local shards: checked after each batch read
        for i, (path, (_, recorded)) in enumerate(zip(self.shard_paths, shards)):
            if self.remote_objects:
                size = self.remote_objects[i].size
            else:
                try:
                    self.shard_pins[i] = fileio.pin(path)  # FileNotFoundError names the shard
                except (NotRegularFileError, IsADirectoryError) as exc:
                    raise RecordFormatError(path, f"shard is not a regular file ({exc.strerror})") from None
                size = self.shard_pins[i].size
            if size != recorded:
                raise RecordFormatError(
                    path,
                    f"shard has {size} bytes, meta.json recorded {recorded} "
                    "(truncated or rewritten since it was packed)",
                )
            sizes.append(size)
        if not len(self.index):
            return
        shard, offset, length = self.index.T
        sizes = np.asarray(sizes, dtype=np.int64)
        bad = (shard < 0) | (shard >= len(sizes)) | (offset < 0) | (length < 0)
        end_ok = np.zeros(len(shard), dtype=bool)
        ok = ~bad
        end_ok[ok] = offset[ok] <= sizes[shard[ok]] - length[ok]  # no int64 overflow
        bad |= ~end_ok
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            s, o, n = (int(v) for v in self.index[i])
            where = (
                f"shard {s} ('{files.shown(self.shard_paths[s])}', {int(sizes[s])} bytes)"
                if 0 <= s < len(sizes)
                else f"shard {s} (the pack has {len(sizes)} shards)"
            )
            raise RecordFormatError(
                index_path,
                f"record {i}: offset={o}, length={n} in {where} lies outside "
                f"its shard ({int(bad.sum())} bad record(s) in all)",
            )

    def _verify_checksums(self, checksums: list) -> None:
        """Every shard's CRC-32 against meta.json (shards of packs without them: skipped)."""
        for path, pinned, expected in zip(self.shard_paths, self.shard_pins, checksums):
            if expected is None:
                continue
            found = fileio.crc32(path, pinned)
            if found != expected:
                raise RecordFormatError(
                    path, f"shard's CRC-32 is {found:#010x}, meta.json recorded {expected:#010x} (corrupted)"
                )

    def __len__(self) -> int:
        return len(self.index)

    def _check(self, indices) -> np.ndarray:
        raw = np.asarray(indices, dtype=np.int64).reshape(-1)
        index = np.where(raw < 0, raw + len(self), raw)
        bad = (index < 0) | (index >= len(self))
        if bad.any():
            raise IndexError(
                f"record index {int(raw[bad][0])} is out of range for the pack "
                f"'{files.shown(self.root)}' ({len(self)} records)"
            )
        return index

    def name(self, i: int) -> str:
        """Where record ``i`` came from (its source file name), for error messages."""
        if self._names is None:
            path = files.join(self.root, "names.txt")
            try:
                self._names = files.load(path).decode("utf-8").split("\n")[: len(self)]
            except FileNotFoundError:
                self._names = []
            except UnicodeDecodeError as exc:
                raise RecordFormatError(path, f"not UTF-8 text ({exc})") from None
        i = int(self._check([i])[0])
        if i < len(self._names):
            return self._names[i]
        shard, offset, length = (int(v) for v in self.index[i])
        return f"record {i} ('{files.shown(self.shard_paths[shard])}' offset={offset} length={length})"

    def __getitem__(self, i):
        i = int(self._check([i])[0])
        shard, offset, length = (int(v) for v in self.index[i])
        path = self.shard_paths[shard]
        data = files.read(path, offset, length)
        if len(data) != length:
            raise EOFError(
                f"record {i}: file '{path}' ended at byte {offset + len(data)} while reading "
                f"offset={offset}, length={length} (truncated after the pack was opened?)"
            )
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        return tensor if self.labels is None else (tensor, int(self.labels[i]))

    def collate(self, samples: list) -> RecordBatch:
        """``RecordBatch`` of ``[ds[i] for i in batch]``: pass as torch DataLoader's ``collate_fn``."""
        tensors = samples if self.labels is None else [t for t, _ in samples]
        lengths = torch.tensor([len(t) for t in tensors], dtype=torch.int64)
        offsets = torch.zeros(len(tensors) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        data = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.uint8)
        labels = None if self.labels is None else torch.tensor([label for _, label in samples], dtype=torch.int64)
        return RecordBatch(data, offsets, labels)

    __fastload_collate__ = collate  # the loader's collate when none is passed (protocol.py)

    def __fastload_batch__(self, indices) -> RecordBatch:
        """The batch ``collate`` would make, its bytes left as one read plan for the loader."""
        index = self._check(indices)
        rows = self.index[index]
        lengths = rows[:, 2]
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = PendingRead(
            self.shard_paths,
            rows[:, 1],
            lengths,
            (int(offsets[-1]),),
            torch.uint8,
            file_index=rows[:, 0],
            pins=self.shard_pins,
        )
        labels = None if self.labels is None else torch.from_numpy(self.labels[index])
        return RecordBatch(data, torch.from_numpy(offsets), labels)

    def __fastload_native__(self) -> NativeLayout:
        """Records listed in the (already checked) index, labels from memory: planned in C++."""
        fields = (Records(self.shard_paths, self.index, f"the pack {self.root!r}", self.shard_pins),)
        if self.labels is not None:
            fields += (MemoryRows(torch.from_numpy(self.labels)),)
        return NativeLayout(fields, _record_batch)

    def __fastload_slot_bytes__(self, batch_size: int) -> int:
        """Bytes that any batch of ``batch_size`` records fits in (sizes the pool once)."""
        return largest_batch_bytes(self.index[:, 2], batch_size) + 2 * (batch_size + 1) * 8 + 3 * ALIGN


def _record_batch(fields: list) -> RecordBatch:
    """The loader's output fields (slab, offsets[, labels]) as the batch ``collate`` makes."""
    return RecordBatch(fields[0], fields[1], fields[2] if len(fields) > 2 else None)
