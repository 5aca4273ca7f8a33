"""An on-disk cache of whole objects, so later epochs read shards as local files.

An entry is the object's bytes in ``<cache_dir>/<hash>-<name>``, the hash of its URL, version
(ETag) and size: a replaced object misses, and the file must hold exactly ``size`` bytes to
count. Entries are written atomically: the bytes go to a temporary file made by ``mkstemp`` in
the cache directory (``.partial-<pid>-*``), which is fsynced and only then renamed into place
(and the directory fsynced), so a process killed mid-write leaves at most a partial file that
no lookup reads; partial files of dead processes are removed when a cache opens. Entries are
evicted least recently used first (a hit touches its mtime) to keep the directory under the
size limit; an object larger than the limit is never cached. Several processes (DDP ranks) may
share a directory: a double fill renames identical bytes over each other.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
from typing import Callable

import numpy as np

from .. import fileio
from .client import count

__all__ = ["ShardCache", "cache_for"]

log = logging.getLogger("torch_fastload")

_PARTIAL = re.compile(r"\.partial-(\d+)-.*\.tmp")
_caches: dict = {}
_caches_lock = threading.Lock()


def cache_for(directory: str, limit: int) -> ShardCache:
    """The process's ``ShardCache`` for ``directory`` (one per directory and limit)."""
    key = (os.path.abspath(directory), int(limit))
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = ShardCache(*key)
        return cache


class ShardCache:
    """Whole objects on local disk, LRU under ``limit`` bytes."""

    def __init__(self, directory: str, limit: int):
        self.directory = os.path.abspath(directory)
        self.limit = int(limit)
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._remove_dead_partials()

    def __repr__(self) -> str:
        return f"ShardCache('{self.directory}', limit={self.limit / 2**30:.1f} GiB)"

    def path_for(self, obj) -> str:
        digest = hashlib.sha256(f"{obj.url}\0{obj.version}\0{obj.size}".encode()).hexdigest()[:32]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", obj.url.rsplit("/", 1)[-1].split("?", 1)[0])[-80:]
        return os.path.join(self.directory, f"{digest}-{name}")

    def lookup(self, obj) -> str | None:
        """The entry's path if it holds the object (and marks it recently used), else None."""
        path = self.path_for(obj)
        try:
            if os.stat(path).st_size != obj.size:
                return None
            os.utime(path)
        except OSError:
            return None
        return path

    def fill(self, obj, fetch: Callable[[np.ndarray], None]) -> str | None:
        """Write the object into the cache: ``fetch(buffer)`` fills a writable mapping of the
        temporary file with all ``obj.size`` bytes. Returns the entry, or None where the object
        exceeds the limit."""
        if obj.size > self.limit:
            return None
        final = self.path_for(obj)
        with self._lock:
            self._make_room(obj.size)
        fd, temporary = tempfile.mkstemp(prefix=f".partial-{os.getpid()}-", suffix=".tmp", dir=self.directory)
        try:
            if obj.size:
                os.ftruncate(fd, obj.size)
                mapping = np.memmap(temporary, dtype=np.uint8, mode="r+", shape=(obj.size,))
                try:
                    fetch(mapping)
                    mapping.flush()
                finally:
                    del mapping
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(temporary, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        self._fsync_directory()
        count(cache_fills=1, cache_bytes=obj.size)
        return final

    def entries(self) -> list[tuple[float, int, str]]:
        """``(mtime, size, path)`` of every entry, oldest first."""
        found = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.startswith(".") or not entry.is_file():
                    continue
                try:
                    info = entry.stat()
                except OSError:
                    continue
                found.append((info.st_mtime, info.st_size, entry.path))
        return sorted(found)

    def _make_room(self, nbytes: int) -> None:
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total + nbytes <= self.limit:
                break
            try:
                os.unlink(path)
                log.info("torch_fastload cache: evicted %s (%d bytes, least recently used)", path, size)
            except FileNotFoundError:
                pass
            total -= size

    def _remove_dead_partials(self) -> None:
        with os.scandir(self.directory) as it:
            for entry in it:
                match = _PARTIAL.fullmatch(entry.name)
                if match and not fileio.process_alive(int(match.group(1))):
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
