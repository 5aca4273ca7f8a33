"""kvikio's ``RemoteFile`` as the remote backend (``remote_backend='kvikio'``).

kvikio reads a range with its own thread pool (``num_threads`` x ``task_size`` requests,
libcurl, its own retries on 429/5xx); it needs libcuda even for host buffers. It does not check
the object's version per request, so after a batch every object the batch read is asked for
its size and version again (a HEAD): a change that happened before the last of them raises
``ObjectChangedError`` and the batch is not delivered.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from .. import config
from .errors import ObjectChangedError, RemoteReadError
from .url import credentials, parse, scrub

__all__ = ["KvikioRemote", "unavailable_reason"]


def unavailable_reason() -> str:
    """Why kvikio's RemoteFile cannot read here ("" where it can)."""
    try:
        import kvikio
    except Exception as exc:
        return f"kvikio does not import ({type(exc).__name__}); pip install kvikio-cu12 or kvikio-cu13"
    if not hasattr(kvikio, "RemoteFile"):
        return f"kvikio {getattr(kvikio, '__version__', '?')} has no RemoteFile (25.02 or later needed)"
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "libcuda.so.1 is not loadable (kvikio's remote reads need the CUDA driver)"
    return ""


class KvikioRemote:
    """Ranges of remote objects through kvikio, versions checked after each batch."""

    def __init__(self, client, concurrency: int, request_size: int):
        import kvikio
        import kvikio.defaults

        self.kvikio = kvikio
        self.client = client
        settings = {
            "num_threads": concurrency,
            "task_size": request_size,
            "http_max_attempts": client.retries + 1,
            "http_timeout": max(1, int(round(client.timeout))),
        }
        for name, value in settings.items():  # process-wide: kvikio has one pool
            if kvikio.defaults.get(name) != value:
                kvikio.defaults.set(name, value)
        self._files: dict = {}
        self._lock = threading.Lock()

    def _file(self, obj):
        with self._lock:
            handle = self._files.get(obj.url)
            if handle is None:
                handle = self._files[obj.url] = self._open(obj)
            return handle

    def _open(self, obj):
        loc = parse(obj.url)
        remote = self.kvikio.RemoteFile
        if not loc.signed:
            return remote.open_http(obj.url, nbytes=obj.size)
        creds = credentials()
        if creds is None:
            return remote.open_http(f"{loc.scheme}://{loc.host_header}{loc.target}", nbytes=obj.size)
        endpoint = f"{loc.scheme}://{loc.host_header}" if config.get("s3_endpoint_url") or _env_endpoint() else None
        return remote.open_s3(
            loc.bucket,
            loc.key,
            nbytes=obj.size,
            aws_region_name=self.client.region,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=creds.secret_key,
            aws_endpoint_url=endpoint,
            aws_session_token=creds.token,
        )

    def read(self, host: np.ndarray, objects, file_index, offsets, lengths, dst_offsets) -> None:
        from .. import readers

        futures, error = [], None
        try:
            for fi, off, n, at in zip(*readers.coalesce(file_index, offsets, lengths, dst_offsets)):
                view = host[at : at + n]
                futures.append((objects[fi], int(n), self._file(objects[fi]).pread(view, int(n), int(off))))
        except Exception as exc:
            error = exc
        for obj, n, future in futures:  # every read in flight ends before the buffer is handed back
            try:
                got = future.get()
            except Exception as exc:
                error = error or exc
                continue
            if got != n and error is None:
                error = RemoteReadError(obj.display, f"kvikio read {got} of {n} bytes", self.client.retries + 1)
        if error is not None:
            if isinstance(error, RemoteReadError):
                raise error
            name = objects[0].display if objects else "?"
            text = scrub(str(error).splitlines()[0] if str(error) else "")
            raise RemoteReadError(
                name, f"kvikio's read failed ({type(error).__name__}: {text})", self.client.retries + 1
            )
        for fi in np.unique(file_index).tolist():
            obj = objects[fi]
            size, version = self.client.head(parse(obj.url))
            if size != obj.size or version != obj.version:
                raise ObjectChangedError(
                    obj.display,
                    f"the object changed during the batch (version {obj.version}, {obj.size} bytes; now "
                    f"{version}, {size} bytes)",
                )

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for handle in files:
            handle.close()


def _env_endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3", "") or os.environ.get("AWS_ENDPOINT_URL", "")
