"""Object storage: ``s3://bucket/key`` and ``http(s)://`` objects as sources' files.

Sources take URLs where they take paths (``ArrayDataset("s3://b/x.npy")``,
``RecordDataset("s3://b/pack")``, ``PackedImageFolder``, ``FeatureStore``); a batch's
``PendingRead`` ranges then name URLs, and the loader's reader (``io.py``) hands them to a
``RemoteReader``: many concurrent range requests of a configured size, retried with backoff
and jitter, each answer checked against the object's size and version recorded at open.
``remote_backend='kvikio'`` uses kvikio's ``RemoteFile`` instead (CUDA hosts). With a
``cache_dir`` whole objects are kept on local disk (LRU, atomic); an epoch that starts with
all of them cached checks each once (HEAD) and reads the entries as local files.

    url.py        URLs, endpoints, the AWS credential chain, SigV4 signing
    client.py     one request: keep-alive connections, retries, checked answers
    objects.py    opened objects (size + version pinned), path-or-URL helpers for sources
    reader.py     the concurrent range reader used by io.py and FeatureStore
    pool.py       its request threads (batch reads before cache fills)
    cache.py      the on-disk shard cache
    epoch.py      epochs whose objects are all cached: checked at the start, read as local files
    kvikio_backend.py   kvikio's RemoteFile as the backend
    sweep.py      ``doctor --url``: concurrency x request size, recommended setting
    loopback.py   a loopback object server (latency, bandwidth cap, faults) for tests and benchmarks
"""

from __future__ import annotations

from . import objects as _objects
from . import url as _url
from .client import counters
from .errors import (
    ObjectChangedError,
    RangeNotSupportedError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
    RemoteProtocolError,
    RemoteReadError,
    RemoteTimeoutError,
)
from .objects import RemoteObject, expand, list_objects, open_object
from .reader import RemoteReader, backend_in_effect, describe_settings
from .url import is_url

__all__ = [
    "is_url",
    "open_object",
    "list_objects",
    "expand",
    "cache_objects",
    "counters",
    "reset",
    "urls_of",
    "RemoteObject",
    "RemoteReader",
    "describe_settings",
    "backend_in_effect",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteAccessError",
    "RemoteReadError",
    "RemoteTimeoutError",
    "ObjectChangedError",
    "RangeNotSupportedError",
    "RemoteProtocolError",
]


def cache_objects(urls, cache_dir: str | None = None, cache_limit=None) -> list:
    """Download objects into the shard cache now (warm it before training); their entries
    (None for one larger than the limit). ``urls``: URLs, a list, or an ``s3://`` prefix."""
    paths = [open_object(u, cache_dir, cache_limit) for u in expand(urls)]
    with RemoteReader() as reader:
        return [reader.fill(obj) for obj in paths]


def reset() -> None:
    """Forget opened objects, clients and resolved credentials (after the environment or the
    endpoint changed)."""
    with _objects._lock:
        _objects._registry.clear()
        clients, _objects._clients = list(_objects._clients.values()), {}
    for c in clients:
        c.close()
    _url.reset()


def urls_of(dataset) -> list:
    """The objects a source opened (``dataset.remote_objects``), [] for local sources."""
    return list(getattr(dataset, "remote_objects", None) or [])
