"""Typed errors, and the wrapper that carries a background thread's exception to ``next()``."""

from __future__ import annotations

import errno
import stat
import sys
import threading

__all__ = [
    "FastloadError",
    "BatchTooLargeError",
    "PoolError",
    "LoaderShutdownError",
    "ParquetError",
    "ParquetFormatError",
    "ParquetSchemaError",
    "ParquetDecodeError",
    "NotRegularFileError",
    "FileChangedError",
    "CapturedError",
    "capture",
    "wrap",
]


class FastloadError(RuntimeError):
    """Base class of torch_fastload's own errors."""


class BatchTooLargeError(FastloadError, ValueError):
    """A batch does not fit in a pinned slot and ``oversize='error'`` was asked for."""

    def __init__(self, batch_index: int, batch_bytes: int, slot_bytes: int):
        self.batch_index = batch_index
        self.batch_bytes = batch_bytes
        self.slot_bytes = slot_bytes
        super().__init__(
            f"batch {batch_index} needs {batch_bytes} bytes but pinned slots hold {slot_bytes} bytes; "
            f"pass slot_bytes>={batch_bytes} (or TORCH_FASTLOAD_SLOT_BYTES) or oversize='grow'"
        )


class PoolError(FastloadError):
    """The pinned pool could not be allocated, registered or waited on."""


class LoaderShutdownError(FastloadError):
    """The iterator was used after it was shut down, or a pipeline thread died unexpectedly."""


class ParquetError(FastloadError, ValueError):
    """A Parquet file that cannot be read as asked: names the file and, where known, the row
    group and the column (``path``, ``row_group``, ``column`` attributes)."""

    def __init__(self, path: str, problem: str, row_group: int | None = None, column: str | None = None):
        self.path = str(path)
        self.row_group = row_group
        self.column = column
        where = self.path
        if row_group is not None:
            where += f", row group {row_group}"
        if column is not None:
            where += f", column {column!r}"
        super().__init__(f"{where}: {problem}")


class ParquetFormatError(ParquetError):
    """Not Parquet, truncated, still being written, or a footer/page that does not parse."""


class ParquetSchemaError(ParquetError):
    """A missing column, schemas that differ across files, or a type with no tensor form."""


class ParquetDecodeError(ParquetFormatError):
    """A row group whose pages fail to decode when a batch needs it (raised by that batch's next())."""


class NotRegularFileError(FastloadError, OSError):
    """A path that should be a regular file is a FIFO, a socket, a device (``/dev/zero``), ..."""

    def __init__(self, path: str, mode: int = 0):
        kind = stat.S_IFMT(mode)
        what = _KINDS.get(kind, "not a regular file")
        OSError.__init__(self, errno.EINVAL, f"{what}, not a regular file: refused", path)
        self.path = path

    def __str__(self) -> str:
        return f"{self.path!r}: {self.strerror}"


class FileChangedError(FastloadError, OSError):
    """A file was replaced or rewritten after a source opened it: its rows are no longer the
    ones its header (or a pack's index) described, so the batch is refused."""

    def __init__(self, path: str, change: str):
        OSError.__init__(
            self, errno.ESTALE, f"{change} since it was opened; reopen the dataset to read the new file", path
        )
        self.path = path
        self.change = change

    def __str__(self) -> str:
        return f"{self.path!r}: {self.strerror}"


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class CapturedError:
    """An exception raised in a pipeline thread, re-raised as itself by the consumer's ``next()``.

    Re-raising the original object keeps its type, its attributes and its traceback (the
    thread's frames come first); a note names the stage, the thread and the batch.
    """

    def __init__(self, exc: BaseException, where: str):
        self.exc = exc
        self.where = where

    def reraise(self):
        note = f"[torch_fastload] raised in {self.where}"
        if hasattr(self.exc, "add_note") and note not in getattr(self.exc, "__notes__", ()):
            self.exc.add_note(note)
        raise self.exc


def wrap(exc: BaseException, stage: str, batch_index: int | None = None) -> CapturedError:
    """Wrap ``exc`` (its traceback kept), naming the stage, the batch and the current thread."""
    where = f"the {stage} stage (thread {threading.current_thread().name!r}"
    if batch_index is not None:
        where += f", batch {batch_index}"
    return CapturedError(exc, where + ")")


def capture(stage: str, batch_index: int | None = None) -> CapturedError:
    """Wrap the exception being handled."""
    return wrap(sys.exc_info()[1], stage, batch_index)
