"""Write packed-record shards: ``torch_fastload.pack(...)`` and ``python -m torch_fastload pack``.

Any iterable (or map-style dataset) of byte strings, or of ``(bytes, label)`` pairs, becomes a
pack that ``sources.RecordDataset`` reads; ``pack_image_folder`` packs an ImageFolder tree
(``root/<class>/<image>``) with torchvision's class order. The pack is finished only once
``meta.json`` is written, last and atomically: an interrupted write is never mistaken for data.

A pack is built in a new temporary directory beside ``out_dir`` (same parent, so the same
file system) and renamed into place once finished; with ``overwrite`` the old pack is
swapped out only then (``renameat2(RENAME_EXCHANGE)`` where the kernel has it, else two
renames). A run that fails or is killed leaves the old pack as it was (a killed run may leave
its hidden ``.<name>.packing-*`` directory behind, never a half-written pack at ``out_dir``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import fileio
from .config import parse_size
from .sources.records import FORMAT, VERSION, RecordDataset

__all__ = ["pack", "pack_image_folder", "find_images", "IMAGE_EXTENSIONS", "main"]

#: torchvision's ImageFolder extensions (lower-case; matched case-insensitively).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
DEFAULT_SHARD_SIZE = 1 << 30


def _progress(total: int | None, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


def _as_bytes(item: Any, i: int) -> memoryview:
    if hasattr(item, "numpy") and hasattr(item, "dtype"):  # a torch tensor
        item = item.detach().cpu().contiguous().numpy()
    if isinstance(item, np.ndarray):
        item = np.ascontiguousarray(item).view(np.uint8).reshape(-1)
    try:
        return memoryview(item).cast("B")
    except TypeError:
        raise TypeError(
            f"item {i}: records must be bytes-like (bytes, bytearray, a uint8 array or tensor), "
            f"got {type(item).__name__}"
        ) from None


def pack(
    items: Iterable,
    out_dir: str | os.PathLike,
    *,
    labels: Sequence[int] | None = None,
    classes: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    align: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> RecordDataset:
    """Pack ``items`` (bytes-like, or ``(bytes, label)`` pairs) into shards under ``out_dir``.

    ``labels`` (one int per item) may be given instead of pairs; ``classes`` names the labels;
    ``names`` (one per item) are kept for error messages. A shard is closed once the next
    record would take it past ``shard_size`` bytes. ``align`` pads every record's start to a
    multiple (4096 makes O_DIRECT reads of whole records bounce-free). Returns the dataset.
    """
    given = os.fspath(out_dir)
    out_dir = os.path.abspath(given)
    if shard_size < 1 or align < 1:
        raise ValueError(f"shard_size and align must be >= 1, got {shard_size} and {align}")
    _check_out_dir(out_dir, overwrite)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    building = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.packing-", dir=os.path.dirname(out_dir))
    try:
        _build(items, building, out_dir, labels, classes, names, shard_size, align, progress)
        _move_into_place(building, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return RecordDataset(given)


def _build(items, out_dir, final_dir, labels, classes, names, shard_size, align, progress) -> None:
    """Every file of the pack into ``out_dir`` (a new private directory), meta.json last."""
    started = time.perf_counter()
    total = len(items) if hasattr(items, "__len__") else None
    if hasattr(items, "__getitem__") and hasattr(items, "__len__") and not isinstance(items, (list, tuple)):
        items = (items[i] for i in range(len(items)))  # a map-style dataset
    bar = _progress(total, f"packing {os.path.basename(final_dir)}", progress)
    try:
        written = _write_shards(items, out_dir, shard_size, align, bar)
    finally:
        if bar is not None:
            bar.close()
    found_labels = _check_labels(written.labels, labels, names, len(written.index))
    _write_tables(out_dir, written.index, found_labels, names)
    _write_meta(
        out_dir,
        {
            "format": FORMAT,
            "version": VERSION,
            "num_records": len(written.index),
            "shards": written.shards,
            "labels": bool(found_labels),
            "classes": list(classes) if classes is not None else None,
            "align": align,
            "bytes": int(sum(s["bytes"] for s in written.shards)),
            "seconds": round(time.perf_counter() - started, 3),
        },
    )


class PackExistsError(FileExistsError):
    """``out_dir`` holds entries and ``overwrite`` was not asked for."""

    def __init__(self, out_dir: str, entries: int):
        super().__init__(f"{out_dir!r} is not empty ({entries} entries); pass overwrite=True")
        self.out_dir = out_dir
        self.entries = entries


def _is_pack_file(name: str) -> bool:
    return name == "meta.json" or name.startswith("shard-") or name in ("index.npy", "labels.npy", "names.txt")


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse an ``out_dir`` with entries unless ``overwrite`` (before any record is packed)."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise NotADirectoryError(f"{out_dir!r} exists and is not a directory")
    existing = [name for name in os.listdir(out_dir) if not name.startswith(".")]
    if existing and not overwrite:
        raise PackExistsError(out_dir, len(existing))


def _move_into_place(building: str, out_dir: str, overwrite: bool) -> None:
    """Rename the finished pack ``building`` to ``out_dir``; an old pack there is exchanged for it
    in one step where the kernel can (else moved aside first) and only then removed. Entries of
    the old directory that are not pack files are carried over into the new one."""
    os.chmod(building, 0o755)  # mkdtemp made it private
    try:
        os.rename(building, out_dir)  # out_dir missing or empty: one atomic step
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    _check_out_dir(out_dir, overwrite)  # filled while we packed?
    for name in os.listdir(out_dir):
        if not _is_pack_file(name):
            os.rename(os.path.join(out_dir, name), os.path.join(building, name))
    fileio.replace_dir(building, out_dir, aside_prefix=f".{os.path.basename(out_dir)}.old-")


@dataclass
class _Written:
    """What ``_write_shards`` wrote."""

    index: list = field(default_factory=list)  # per record: (shard, offset, length)
    labels: list = field(default_factory=list)  # per record, where items were (bytes, label) pairs
    shards: list = field(default_factory=list)  # per shard: {"file": name, "bytes": size, "crc32": crc}


def _write_shards(items: Iterable, out_dir: str, shard_size: int, align: int, bar) -> _Written:
    """Every record into ``shard-NNNNN.bin`` files, a new shard once the next record would pass
    ``shard_size``; the last shard is fsynced."""
    written = _Written()
    shard_file = None
    shard_name = ""
    shard_bytes = 0
    crc = 0
    try:
        for i, item in enumerate(items):
            if isinstance(item, tuple) and len(item) == 2:
                item, label = item
                written.labels.append(int(label))
            data = _as_bytes(item, i)
            pad = (-shard_bytes) % align
            if shard_file is None or (shard_bytes and shard_bytes + pad + len(data) > shard_size):
                if shard_file is not None:
                    shard_file.close()
                    written.shards.append({"file": shard_name, "bytes": shard_bytes, "crc32": crc})
                shard_name = f"shard-{len(written.shards):05d}.bin"
                shard_file = open(os.path.join(out_dir, shard_name), "xb")
                shard_bytes, pad, crc = 0, 0, 0
            if pad:
                shard_file.write(b"\0" * pad)
                crc = zlib.crc32(b"\0" * pad, crc)
                shard_bytes += pad
            shard_file.write(data)
            crc = zlib.crc32(data, crc)
            written.index.append((len(written.shards), shard_bytes, len(data)))
            shard_bytes += len(data)
            if bar is not None:
                bar.update(1)
        if shard_file is not None:
            shard_file.flush()
            os.fsync(shard_file.fileno())
            shard_file.close()
            written.shards.append({"file": shard_name, "bytes": shard_bytes, "crc32": crc})
            shard_file = None
    finally:
        if shard_file is not None:
            shard_file.close()
    return written


def _check_labels(found: list, labels: Sequence[int] | None, names: Sequence[str] | None, count: int) -> list:
    """The records' labels (from pairs or ``labels=``; [] for none), every count checked."""
    if found and len(found) != count:
        raise ValueError(f"{len(found)} of {count} items were (bytes, label) pairs: all or none must be")
    if labels is not None:
        if found:
            raise ValueError("labels given both as (bytes, label) items and as labels=")
        found = [int(v) for v in labels]
        if len(found) != count:
            raise ValueError(f"labels has {len(found)} entries for {count} records")
    if names is not None and len(names) != count:
        raise ValueError(f"names has {len(names)} entries for {count} records")
    return found


def _write_tables(out_dir: str, index: list, labels: list, names: Sequence[str] | None) -> None:
    """index.npy, labels.npy (where labelled) and names.txt (where named)."""
    np.save(os.path.join(out_dir, "index.npy"), np.asarray(index, dtype=np.int64).reshape(len(index), 3))
    if labels:
        np.save(os.path.join(out_dir, "labels.npy"), np.asarray(labels, dtype=np.int64))
    if names is not None:
        with open(os.path.join(out_dir, "names.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(str(n).replace("\n", " ") for n in names))


def _write_meta(out_dir: str, meta: dict) -> None:
    """meta.json, last and atomically: the pack is finished only once it exists."""
    fileio.write_atomic(os.path.join(out_dir, "meta.json"), lambda f: json.dump(meta, f, indent=1))


def find_images(root: str | os.PathLike, extensions: Sequence[str] = IMAGE_EXTENSIONS):
    """``(classes, [(path, class_index)])`` in torchvision ImageFolder's order."""
    root = os.fspath(root)
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders in {root!r} (expected root/<class>/<image>)")
    extensions = tuple(e.lower() for e in extensions)
    samples = []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            for file in sorted(files):
                if file.lower().endswith(extensions):
                    samples.append((os.path.join(folder, file), label))
    if not samples:
        raise FileNotFoundError(f"no files with extensions {extensions} under {root!r}")
    return classes, samples


def pack_image_folder(
    root: str | os.PathLike, out_dir: str | os.PathLike, *, extensions: Sequence[str] = IMAGE_EXTENSIONS, **kwargs
) -> RecordDataset:
    """Pack an ImageFolder tree: encoded file bytes as records, class indices as labels."""
    root = os.fspath(root)
    classes, samples = find_images(root, extensions)

    def records():
        for path, label in samples:
            yield fileio.read_file(path), label  # regular files only: a FIFO or /dev/zero is refused

    class _Sized:  # a generator with a length, for the progress bar
        def __len__(self):
            return len(samples)

        def __iter__(self):
            return records()

    return pack(
        _Sized(), out_dir, classes=classes, names=[os.path.relpath(path, root) for path, _ in samples], **kwargs
    )


def main(argv: list[str] | None = None, prog: str = "python -m torch_fastload pack") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Pack an image folder (root/<class>/<file>) or a "
        "flat folder of files into torch_fastload record shards.",
    )
    parser.add_argument("src", help="an ImageFolder root, or with --flat any folder of files")
    parser.add_argument("out", help="output directory (created; must be empty unless --overwrite)")
    parser.add_argument("--flat", action="store_true", help="pack every file under src, unlabelled")
    parser.add_argument(
        "--extensions",
        default=",".join(IMAGE_EXTENSIONS),
        help="comma-separated file extensions for image folders (default: torchvision's)",
    )
    parser.add_argument("--shard-size", default="1GiB", help="bytes per shard, e.g. 512MiB (default 1GiB)")
    parser.add_argument("--align", type=int, default=1, help="align record starts (4096: O_DIRECT-friendly)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        shard_size = parse_size(args.shard_size)
    except ValueError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    common = dict(shard_size=shard_size, align=args.align, overwrite=args.overwrite, progress=not args.no_progress)
    try:
        if args.flat:
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(args.src) for f in fs)
            if not files:
                raise FileNotFoundError(f"no files under {args.src!r}")

            class _Files:
                def __len__(self):
                    return len(files)

                def __iter__(self):
                    for path in files:
                        yield fileio.read_file(path)

            dataset = pack(_Files(), args.out, names=[os.path.relpath(p, args.src) for p in files], **common)
        else:
            dataset = pack_image_folder(args.src, args.out, extensions=tuple(args.extensions.split(",")), **common)
    except PackExistsError as exc:
        print(f"{prog}: error: {exc.out_dir!r} is not empty ({exc.entries} entries); pass --overwrite", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    meta = dataset.meta
    print(
        f"packed {meta['num_records']} records, {meta['bytes'] / 1e6:.1f} MB in {len(meta['shards'])} shard(s)"
        + (f", {len(meta['classes'])} classes" if meta.get("classes") else "")
        + f" -> {args.out} ({seconds:.1f} s, {meta['bytes'] / 1e6 / max(seconds, 1e-9):.0f} MB/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
