"""Opened objects (size and version pinned at open), and file helpers that take paths or URLs.

``open_object(url)`` asks the server for the object's size and version once; every later read
of that URL is checked against them (``client.read_range``). A source keeps the
``RemoteObject`` records of what it opened: pickled into a DataLoader worker they register
themselves again, so the worker checks reads against the versions the dataset was built on.

``size``, ``read`` and ``join`` take a local path or a URL, so a source reads its metadata
the same way from either.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from .. import config, fileio
from ..engine import RangeError
from .client import Client, count
from .url import is_url, parse

__all__ = [
    "RemoteObject",
    "check_ranges",
    "open_object",
    "opened",
    "shared_client",
    "size",
    "load",
    "read",
    "join",
    "shown",
    "list_objects",
    "expand",
]

_registry: dict = {}
_lock = threading.Lock()
_clients: dict = {}


@dataclass(frozen=True)
class RemoteObject:
    """An object as opened: its URL, size and version (ETag or Last-Modified; None where the
    server gives neither), and the shard cache its reads may use (``cache_dir`` "" = none)."""

    url: str
    size: int
    version: str | None
    cache_dir: str = ""
    cache_limit: int = 0

    def __reduce__(self):
        return (_restore, (self.url, self.size, self.version, self.cache_dir, self.cache_limit))

    @property
    def display(self) -> str:
        return parse(self.url).display

    def cache(self):
        """Its ``ShardCache``, or None."""
        if not self.cache_dir:
            return None
        from .cache import cache_for

        return cache_for(self.cache_dir, self.cache_limit)


def _restore(url, size, version, cache_dir, cache_limit) -> RemoteObject:
    obj = RemoteObject(url, size, version, cache_dir, cache_limit)
    with _lock:
        _registry[url] = obj
    return obj


def shared_client() -> Client:
    """A client for the sample path and metadata (no threads; one per setting in effect)."""
    key = tuple(config.get(n) for n in ("remote_timeout", "remote_retries", "remote_backoff"))
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Client()
        return client


def open_object(url: str, cache_dir: str | None = None, cache_limit: int | str | None = None) -> RemoteObject:
    """Ask for ``url``'s size and version now and record them for every later read."""
    loc = parse(url)
    size_, version = shared_client().head(loc)
    cache_dir = config.resolve("remote_cache_dir", cache_dir)
    limit = config.resolve("remote_cache_limit", cache_limit) if cache_dir else 0
    obj = RemoteObject(url, size_, version, os.path.abspath(cache_dir) if cache_dir else "", limit)
    with _lock:
        _registry[url] = obj
    return obj


def opened(url: str) -> RemoteObject:
    """The record of ``url`` (opened now if no source opened it yet)."""
    with _lock:
        obj = _registry.get(url)
    return obj if obj is not None else open_object(url)


# ------------------------------------------------------------------------------------------
# path-or-URL helpers for the sources
# ------------------------------------------------------------------------------------------
def size(path, cache_dir: str | None = None) -> int:
    """Bytes in a file, or in an object opened now (its size and version pinned for later reads)."""
    return open_object(path, cache_dir).size if is_url(path) else os.stat(path).st_size


def load(path) -> bytes:
    """A whole file, or a whole object opened now (metadata: meta.json, index.npy, ...)."""
    if is_url(path):
        open_object(path)
    return read(path)


def read(path, offset: int = 0, length: int | None = None) -> bytes:
    """``length`` bytes at ``offset`` (default: to the end) of a file or object. Fewer bytes
    only where a local file ends early; an object is read whole-range or raises. Objects in a
    shard cache are read from it."""
    if not is_url(path):
        return fileio.read_file(path, offset, length)  # regular files only: a FIFO never blocks
    obj = opened(path)
    length = obj.size - offset if length is None else length
    if offset < 0 or length < 0 or offset + length > obj.size:
        raise EOFError(f"{obj.display}: bytes {offset}-{offset + length} lie past its end ({obj.size} bytes)")
    cache = obj.cache()
    local = cache.lookup(obj) if cache is not None else None
    if local is not None:
        count(cache_hits=1)
        return read(local, offset, length)
    out = np.empty(length, dtype=np.uint8)
    shared_client().read_range(parse(path), obj.size, obj.version, offset, out)
    return out.tobytes()


def shown(path) -> str:
    """How messages name a path: URLs without query or user info (they can hold credentials)."""
    return parse(path).display if is_url(path) else os.fspath(path)


def join(root: str, *names: str) -> str:
    """``os.path.join`` for paths, ``/``-joined for URLs."""
    if not is_url(root):
        return os.path.join(root, *names)
    return "/".join([root.rstrip("/"), *names])


def list_objects(prefix: str) -> list[str]:
    """URLs of the objects under an ``s3://bucket/prefix`` (sorted)."""
    return sorted(shared_client().list(parse(prefix)))


def expand(paths) -> list[str]:
    """A URL, a list of URLs or paths, or an ``s3://bucket/prefix/`` ending in ``/`` (every
    object under it), as a list."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list = []
    for path in paths:
        path = os.fspath(path)
        if is_url(path) and path.lower().startswith("s3://") and path.endswith("/"):
            out += list_objects(path)
        else:
            out.append(path)
    return out


def check_ranges(objects, file_index, offsets, lengths) -> None:
    """``RangeError`` for the first range that reads past its object's end (or is negative)."""
    sizes = np.array([o.size for o in objects], dtype=np.int64)
    bad = (offsets < 0) | (lengths < 0) | (offsets + lengths > sizes[file_index])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RangeError(
            f"range #{i} (offset={int(offsets[i])}, length={int(lengths[i])}) of "
            f"'{objects[file_index[i]].display}': reads past the end of the object ({int(sizes[file_index[i]])} bytes)"
        )
