"""Opening user paths safely: regular files only, never blocking, pinned against replacement.

Every open of a path a user handed us (array files, a pack's metadata and shards, images, the
tuning file, ``pack`` sources) goes through ``open_regular``: it opens with ``O_NONBLOCK`` (a
FIFO never blocks the open), ``fstat``s the descriptor and refuses anything but a regular file
(a FIFO, a socket, ``/dev/zero``) with ``NotRegularFileError`` naming the path.

Sources record the ``FileIdentity`` (device, inode, size, mtime) of each file they opened and
the readers check it after every batch read (``check_unchanged``): a file replaced
(``os.replace``) or rewritten since it was opened is a ``FileChangedError`` naming it, raised by
the ``next()`` whose batch read it, never rows of another file.

Writers (``pack``, benchmark JSON) create their temporary files with ``mkstemp`` in the target
directory and rename them into place (``write_atomic``): a symlink planted at a predictable
name never redirects the write. Whole directories built beside their target (a pack, the sample
image set) replace it with ``replace_dir``; ``process_alive`` tells the staging leftovers of a
killed process from those of a live one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import stat
import tempfile
import zlib
from typing import NamedTuple

from .errors import FileChangedError, NotRegularFileError

__all__ = [
    "FileIdentity",
    "open_regular",
    "open_binary",
    "read_file",
    "identity_of",
    "pin",
    "check_unchanged",
    "check_pins",
    "crc32",
    "write_atomic",
    "replace_dir",
    "exchange_paths",
    "process_alive",
]


class FileIdentity(NamedTuple):
    """What changes when a file is replaced or rewritten (compared after each batch read).
    ``host``: where it was taken; a dataset pickled to another machine (its own copy of the
    files, or another mount of them) pins its files afresh there on first use."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    host: str = ""


_HOST = socket.gethostname()
_PINNED_HERE: dict = {}  # (path, a pin taken on another host) -> the pin taken on this one


def identity_of(info: os.stat_result) -> FileIdentity:
    return FileIdentity(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, _HOST)


def _here(path, pinned: FileIdentity) -> FileIdentity:
    """``pinned``, or for a pin taken on another host the file as first seen on this one."""
    if pinned.host == _HOST:
        return pinned
    key = (os.fspath(path), pinned)
    if key not in _PINNED_HERE:
        _PINNED_HERE[key] = pin(path)
    return _PINNED_HERE[key]


def _refuse_special(path, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fspath(path))
    if not stat.S_ISREG(info.st_mode):
        raise NotRegularFileError(os.fspath(path), info.st_mode)


def open_regular(path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``path`` (blocking mode restored); anything else raises
    (``NotRegularFileError``, ``IsADirectoryError``, ``FileNotFoundError``, ...) naming it."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _refuse_special(path, os.fstat(fd))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path):
    """``open(path, "rb")`` for regular files only."""
    return os.fdopen(open_regular(path), "rb")


def read_file(path, offset: int = 0, length: int | None = None) -> bytes:
    """``length`` bytes at ``offset`` (default: to the end) of the regular file ``path``."""
    fd = open_regular(path)
    try:
        if length is None:
            length = max(0, os.fstat(fd).st_size - offset)
        parts, got = [], 0
        while got < length:
            data = os.pread(fd, length - got, offset + got)
            if not data:
                break  # the file ends early: the caller checks the length
            parts.append(data)
            got += len(data)
        return b"".join(parts)
    finally:
        os.close(fd)


def pin(path) -> FileIdentity:
    """The identity of the regular file ``path`` now (refusing special files)."""
    fd = open_regular(path)
    try:
        return identity_of(os.fstat(fd))
    finally:
        os.close(fd)


def check_unchanged(path, pinned: FileIdentity, cause: BaseException | None = None) -> None:
    """Raise ``FileChangedError`` (from ``cause``, the read error it explains) where ``path`` is
    no longer the file pinned as ``pinned``."""
    try:
        pinned = _here(path, pinned)
        now = identity_of(os.stat(path))
    except FileNotFoundError:
        raise FileChangedError(os.fspath(path), "was removed") from cause
    if now != pinned:
        raise FileChangedError(os.fspath(path), _what_changed(pinned, now)) from cause


def check_pins(pins) -> None:
    """``check_unchanged`` for every ``(path, identity)`` of ``pins`` (a dict or pairs)."""
    for path, pinned in pins.items() if isinstance(pins, dict) else pins:
        if pinned is not None:
            check_unchanged(path, pinned)


def _what_changed(old: FileIdentity, new: FileIdentity) -> str:
    if (old.device, old.inode) != (new.device, new.inode):
        return "was replaced by another file"
    if old.size != new.size:
        return f"changed size from {old.size} to {new.size} bytes"
    return "was rewritten (its modification time changed)"


def crc32(path, pinned: FileIdentity | None = None, chunk: int = 8 << 20) -> int:
    """The CRC-32 (zlib) of the regular file ``path``; with ``pinned``, the file read must be it."""
    fd = open_regular(path)
    try:
        pinned = _here(path, pinned) if pinned is not None else None
        if pinned is not None and identity_of(os.fstat(fd)) != pinned:
            raise FileChangedError(os.fspath(path), _what_changed(pinned, identity_of(os.fstat(fd))))
        crc = 0
        while data := os.read(fd, chunk):
            crc = zlib.crc32(data, crc)
        return crc
    finally:
        os.close(fd)


def write_atomic(path, write, mode: str = "w") -> None:
    """Call ``write(file)`` on a new temporary file beside ``path`` (``mkstemp``: O_EXCL, a
    random name), fsync it and rename it onto ``path``; on failure the temporary goes away."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def replace_dir(new: str, target: str, aside_prefix: str) -> None:
    """Put the finished directory ``new`` where the existing ``target`` is: the two are exchanged
    in one step where the kernel can (``exchange_paths``), else ``target`` is first moved into a
    private directory (``mkdtemp(prefix=aside_prefix)`` beside it); the old one is removed last,
    so a killed process never leaves ``target`` missing or half written."""
    if exchange_paths(new, target):
        shutil.rmtree(new, ignore_errors=True)  # now the old one
        return
    old = tempfile.mkdtemp(prefix=aside_prefix, dir=os.path.dirname(os.path.abspath(target)))
    os.rename(target, os.path.join(old, "previous"))
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def exchange_paths(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):
        return False  # the file system (or the kernel) cannot exchange: the two-rename fallback
    raise OSError(err, os.strerror(err), b)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
