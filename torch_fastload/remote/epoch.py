"""Epochs read from the shard cache as local files, with the objects checked at the epoch's start.

Once every object a source reads is whole in its shard cache, an epoch reads the cache entries
through the local-file path (the native C++ loop, page-cache copies, the engine) instead of the
Python pipeline's remote reader: no per-batch URL routing, cache lookups or locks.

The guarantee that replaces the per-read ETag check on this path: at the start of every epoch
(``iter(loader)``) each object is asked for its size and version once (HEAD requests, several at
a time, on a thread while the loader reads its first batches ahead); an object that differs
from what the source opened raises ``ObjectChangedError`` from the epoch's first ``next()``,
before any batch is delivered. During the epoch batches come from the entries, whose names hold
the opened version (``cache.py``): a batch never mixes two versions, and an object replaced
mid-epoch is read as it was at the epoch's start and refused at the next one.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from .. import config
from .client import Client, count
from .errors import ObjectChangedError
from .objects import RemoteObject
from .url import is_url, parse

__all__ = ["start_epoch", "cached_entries", "check_unchanged", "EpochCheck", "local_paths", "CACHE_PATH_NOTE"]

#: what ``loader.io`` / ``stats().io`` say about remote objects on this path
CACHE_PATH_NOTE = "every object whole in the shard cache and unchanged at the epoch's start: read as local files"


def cached_entries(objects: list[RemoteObject]) -> dict[str, str] | None:
    """URL -> cache entry for each of a source's ``objects`` where all are whole in their
    caches (marked recently used), else None (the epoch then reads remotely, each read checked)."""
    entries = {}
    for obj in objects:
        cache = obj.cache()
        path = cache.lookup(obj) if cache is not None else None
        if path is None:
            return None
        entries[obj.url] = path
    return entries


class EpochCheck:
    """``check_unchanged`` of a cached epoch's objects on a thread; ``wait`` re-raises its error."""

    def __init__(self, objects: list[RemoteObject]):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(objects,), name="fastload-remote-check", daemon=True)
        self._thread.start()

    def _run(self, objects) -> None:
        try:
            check_unchanged(objects)
        except BaseException as exc:
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def start_epoch(objects: list[RemoteObject]) -> tuple[dict[str, str] | None, EpochCheck | None]:
    """``(entries, check)`` for an epoch over a source's ``objects``: where all are cached, their
    entries and the running check of their versions (wait on it before the first batch); else
    ``(None, None)``."""
    objects = list({o.url: o for o in objects}.values())
    entries = cached_entries(objects) if objects else None
    if entries is None:
        return None, None
    count(cache_epochs=1)
    return entries, EpochCheck(objects)


def check_unchanged(objects: list[RemoteObject]) -> None:
    """Ask the server for each object's size and version now (``remote_concurrency`` at a
    time); raise ``ObjectChangedError`` for the first that differs from the opened one."""
    if not objects:
        return
    client = Client()
    try:
        threads = max(1, min(len(objects), config.get("remote_concurrency")))
        if threads == 1:
            found = [client.head(parse(o.url)) for o in objects]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="fastload-remote-check-pool") as pool:
                found = list(pool.map(lambda o: client.head(parse(o.url)), objects))
    finally:
        client.close()
    for obj, (size, version) in zip(objects, found):
        if (size, version) != (obj.size, obj.version):
            raise ObjectChangedError(
                obj.display,
                f"the object changed since it was opened ({obj.size} bytes, version {obj.version}; now {size} "
                f"bytes, version {version}); no batch of its cached copy is delivered; "
                "re-open the dataset to read the new one",
            )


def local_paths(paths, entries: dict[str, str] | None) -> list | None:
    """``paths`` with every URL replaced by its cache entry; None where one has none."""
    if entries is None:
        return None
    out = []
    for path in paths:
        if is_url(path):
            path = entries.get(path)
            if path is None:
                return None
        out.append(path)
    return out
