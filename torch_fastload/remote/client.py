"""HTTP requests for objects: keep-alive connections per thread, bounded retries, checked answers.

Every request is retried on 429 / 5xx answers, timeouts, connection resets and short bodies,
``remote_retries`` times, after a random wait in ``[0, remote_backoff * 2**(attempt - 1)]``
("full jitter", capped at 10 s; a ``Retry-After`` the server sends is honoured up to that cap).
``remote_timeout`` bounds the connect and every wait for bytes. A range answer must name the
object's recorded version (ETag, else Last-Modified) and size, and exactly the bytes asked for:
a changed object raises ``ObjectChangedError``, a server that sends the whole object for a
range ``RangeNotSupportedError``; nothing is retried that would read another version.
"""

from __future__ import annotations

import http.client
import os
import random
import re
import socket
import ssl
import threading
import weakref
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import replace
from typing import Callable
from urllib.parse import quote

from .. import config
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
from .url import Location, credentials, region, sign

__all__ = ["Client", "counters", "version_of"]

MAX_BACKOFF = 10.0
_RETRY_STATUS = (408, 429, 500, 502, 503, 504)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

_counters: Counter = Counter()
_counters_lock = threading.Lock()


def counters() -> dict:
    """Process-wide counts: ``requests`` (attempts), ``retries``, ``bytes`` (received bodies),
    ``timeouts``, ``cache_hits`` / ``cache_fills`` / ``cache_bytes`` (the shard cache),
    ``cache_epochs`` (epochs read from cache entries as local files)."""
    with _counters_lock:
        return dict(_counters)


def count(**deltas: int) -> None:
    with _counters_lock:
        _counters.update(deltas)


def version_of(response) -> str | None:
    """The object version an answer names: its ETag, else its Last-Modified."""
    return response.getheader("ETag") or response.getheader("Last-Modified")


class _Retryable(Exception):
    """An answer worth asking again (429 / 5xx)."""

    def __init__(self, text: str, retry_after: float | None):
        self.retry_after = retry_after
        super().__init__(text)


class _Response(http.client.HTTPResponse):
    """Keeps its socket: a range body is received straight into its destination."""

    def __init__(self, sock, *args, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self.sock = sock

    def read_body_into(self, view: memoryview, wake_bytes: int) -> None:
        """Exactly ``len(view)`` body bytes into ``view``: with ``wake_bytes``, what the header
        read buffered, then ``recv_into`` the rest, each wait for at least ``wake_bytes`` (or
        what is left): with many requests in flight a wake-up per arriving segment (a GIL
        hand-off and a context switch) costs more than its copy."""
        length = len(view)
        # no declared length, or a connection closed after this answer (its socket is closed,
        # only the buffered file still reads it): read through the file until the bytes are there
        if self.length is None or self.chunked or self.will_close or wake_bytes <= 0:
            got = 0
            while got < length:
                n = self.readinto(view[got:])
                if not n:
                    raise http.client.IncompleteRead(b"", length - got)
                got += n
            return
        if length != self.length or self.fp is None:
            raise http.client.HTTPException(f"a {length}-byte body was expected, {self.length} declared")
        got = self.readinto(view[: len(self.fp.peek(1)[:length])])  # the bytes buffered with the headers
        plain = wake_bytes > 1 and not isinstance(self.sock, ssl.SSLSocket)
        try:
            while got < length:
                if plain:  # below a quarter of the receive buffer: the kernel then leaves the window alone
                    room = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4
                    self.sock.setsockopt(
                        socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, min(wake_bytes, room, length - got))
                    )
                try:
                    n = self.sock.recv_into(view[got:])
                except TimeoutError:
                    if not plain:
                        raise
                    n, plain = self._arrived(view[got:]), False  # a slow link: one wake per arrival from here
                if not n:
                    raise http.client.IncompleteRead(b"", length - got)
                got += n
        finally:
            if plain:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        self.length = 0
        self.close()  # done: the connection takes the next request

    def _arrived(self, view: memoryview) -> int:
        """The bytes that came during a timed-out wait for ``wake_bytes`` (fewer came): the
        timeout means no byte at all came, as everywhere else."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        try:
            return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            raise TimeoutError("no body bytes within the timeout") from None


class _HTTPConnection(http.client.HTTPConnection):
    """With TCP_NODELAY (set on every reconnect): a request is one small write, never held back."""

    response_class = _Response

    def connect(self):
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _HTTPSConnection(http.client.HTTPSConnection):
    response_class = _Response

    def connect(self):
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


_clients: weakref.WeakSet = weakref.WeakSet()


def _forget_connections_after_fork() -> None:
    """A forked child (a DataLoader worker) must not talk on its parent's sockets: it forgets
    them (without shutting them down: the parent still uses them) and opens its own."""
    for client in list(_clients):
        client._local = threading.local()
        client._open = set()
        client._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_connections_after_fork)


class Client:
    """Requests for objects with retries. One per reader (``close`` aborts its requests in
    flight); the sample path shares one without threads of its own."""

    def __init__(
        self,
        timeout: float | None = None,
        retries: int | None = None,
        backoff: float | None = None,
        wake_bytes: int | None = None,
    ):
        self.timeout = config.resolve("remote_timeout", timeout)
        self.wake_bytes = config.resolve("remote_wake_bytes", wake_bytes)
        self.retries = config.resolve("remote_retries", retries)
        self.backoff = config.resolve("remote_backoff", backoff)
        self.region = region()
        self.stop = threading.Event()
        self._local = threading.local()
        self._open: set = set()
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        _clients.add(self)

    # -- connections ---------------------------------------------------------------------
    def _connection(self, loc: Location) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        key = (loc.scheme, loc.host, loc.port)
        conn = conns.get(key)
        if conn is None:
            if loc.scheme == "https":
                if self._tls is None:  # loading the CA store takes milliseconds: once per client
                    self._tls = ssl.create_default_context()
                conn = _HTTPSConnection(loc.host, loc.port, timeout=self.timeout, context=self._tls)
            else:
                conn = _HTTPConnection(loc.host, loc.port, timeout=self.timeout)
            conns[key] = conn
            with self._lock:
                self._open.add(conn)
        return conn

    def _drop(self, loc: Location) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((loc.scheme, loc.host, loc.port), None)
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def close(self) -> None:
        """Abort requests in flight (their sockets are shut down) and refuse new ones."""
        self.stop.set()
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()

    # -- one request, retried ------------------------------------------------------------
    def request(self, method: str, loc: Location, headers: dict, handle: Callable, what: str):
        """``handle(response)`` of ``method loc``, retried; raises typed errors naming ``loc.display``."""
        attempts = self.retries + 1
        last: BaseException | None = None
        for attempt in range(1, attempts + 1):
            self._check_open(loc)
            try:
                return self._attempt(method, loc, headers, handle)
            except RemoteError:
                raise
            except (_Retryable, OSError, http.client.HTTPException, ValueError) as exc:
                # ValueError: http.client on a socket another thread shut down; OSError: resets,
                # refusals and timeouts (socket.timeout is TimeoutError)
                last = exc
            self._drop(loc)
            self._check_open(loc)
            if isinstance(last, TimeoutError):
                count(timeouts=1)
            if attempt < attempts:
                count(retries=1)
                delay = random.uniform(0, min(MAX_BACKOFF, self.backoff * 2 ** (attempt - 1)))
                retry_after = getattr(last, "retry_after", None)
                if retry_after is not None:
                    delay = max(delay, min(MAX_BACKOFF, retry_after))
                self.stop.wait(delay)
        if isinstance(last, TimeoutError):
            raise RemoteTimeoutError(
                loc.display,
                f"{what}: no answer within {self.timeout:g} s (remote_timeout) on all {attempts} attempts",
                attempts,
            )
        raise RemoteReadError(
            loc.display, f"{what} failed on all {attempts} attempts; last: {_describe(last)}", attempts
        )

    def _check_open(self, loc: Location) -> None:
        if self.stop.is_set():
            raise RemoteError(loc.display, "the reader was closed while a request was in flight")

    def _attempt(self, method: str, loc: Location, headers: dict, handle: Callable):
        headers = dict(headers)
        if loc.signed:
            creds = credentials()
            if creds is not None:
                sign(method, loc, headers, creds, self.region)
        conn = self._connection(loc)
        count(requests=1)
        conn.request(method, loc.target, headers=headers)
        response = conn.getresponse()
        try:
            result = handle(response)
        except BaseException:
            self._drop(loc)
            raise
        if response.will_close or (response.length or 0) > 0:  # closed early: body bytes still on the wire
            self._drop(loc)
        return result

    # -- what the readers ask ------------------------------------------------------------
    def head(self, loc: Location) -> tuple[int, str | None]:
        """``(size, version)`` of the object. An http(s) URL whose server refuses HEAD (a
        presigned URL is signed for GET only) is asked for its first byte instead."""

        def handle(response):
            if response.status != 200:
                _status_error(response, loc)
            response.read()
            length = response.getheader("Content-Length")
            if length is None or not length.isdigit():
                raise RemoteProtocolError(loc.display, f"HEAD answered without a Content-Length ({length!r})")
            return int(length), version_of(response)

        try:
            return self.request("HEAD", loc, {}, handle, "HEAD")
        except (RemoteAccessError, RemoteProtocolError):
            if loc.signed:
                raise
            return self.request("GET", loc, {"range": "bytes=0-0"}, _first_byte_size(loc), "GET bytes 0-0")

    def read_range(self, loc: Location, size: int, version: str | None, offset: int, out) -> None:
        """``len(out)`` bytes at ``offset`` of the object (``size`` bytes, ``version``) into
        ``out`` (a writable contiguous buffer)."""
        view = memoryview(out).cast("B")
        length = len(view)
        if length == 0:
            return
        headers = {"range": f"bytes={offset}-{offset + length - 1}"}
        if version is not None and version.startswith(('"', 'W/"')):
            headers["if-match"] = version

        def handle(response):
            if response.status not in (200, 206):
                _status_error(response, loc)
            _check_range(response, loc, size, version, offset, length)
            response.read_body_into(view, self.wake_bytes)
            count(bytes=length)

        self.request("GET", loc, headers, handle, f"GET bytes {offset}-{offset + length - 1}")

    def list(self, loc: Location) -> list[str]:
        """Keys under ``loc``'s key (a prefix) in its bucket, as ``s3://`` URLs (ListObjectsV2)."""
        if not loc.signed:
            raise ValueError(f"listing needs an s3:// prefix, got {loc.display}")
        base = loc.target[: len(loc.target) - len(quote(loc.key, safe="/~"))].rstrip("/") or "/"
        keys, token = [], None
        while True:
            query = f"list-type=2&prefix={quote(loc.key, safe='')}"
            if token:
                query += f"&continuation-token={quote(token, safe='')}"
            page = replace(loc, target=f"{base}?{query}")

            def handle(response, page=page):
                if response.status != 200:
                    _status_error(response, page)
                return response.read()

            root = ET.fromstring(self.request("GET", page, {}, handle, "ListObjectsV2"))
            names = {el.tag.rsplit("}", 1)[-1]: el for el in root}
            keys += [el.text for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "Key"]
            truncated = names.get("IsTruncated")
            token_el = names.get("NextContinuationToken")
            if truncated is None or truncated.text != "true" or token_el is None:
                break
            token = token_el.text
        return [f"s3://{loc.bucket}/{key}" for key in keys]


def _first_byte_size(loc: Location):
    """The handler of a ``bytes=0-0`` probe: ``(size, version)`` from its Content-Range."""

    def handle(response):
        if response.status == 206:
            response.read()
            match = _CONTENT_RANGE.fullmatch((response.getheader("Content-Range") or "").strip())
            if match is None or match.group(3) == "*":
                raise RemoteProtocolError(loc.display, "HTTP 206 without the object's size in Content-Range")
            return int(match.group(3)), version_of(response)
        if response.status == 200:  # the whole object is coming: its length is the size
            length = response.getheader("Content-Length")
            response.close()
            if length is None or not length.isdigit():
                raise RemoteProtocolError(loc.display, "HTTP 200 without a Content-Length")
            return int(length), version_of(response)
        _status_error(response, loc)

    return handle


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "nothing"
    text = str(exc) or repr(exc)
    return text if isinstance(exc, _Retryable) else f"{type(exc).__name__}: {text}"


def _check_range(response, loc: Location, size: int, version: str | None, offset: int, length: int) -> None:
    """The answer is ``length`` bytes at ``offset`` of the recorded version, or raise."""
    got_version = version_of(response)
    if version is not None and got_version != version:
        raise ObjectChangedError(
            loc.display,
            f"the object changed since it was opened (version {version}, now {got_version}); "
            "re-open the dataset to read the new one",
        )
    declared = response.getheader("Content-Length")
    if response.status == 200:
        if offset != 0 or length != size:
            raise RangeNotSupportedError(
                loc.display,
                f"asked for bytes {offset}-{offset + length - 1} of {size}, the server sent the whole object "
                f"(HTTP 200, {declared} bytes): it ignores Range requests",
            )
        if declared is not None and int(declared) != size:
            raise ObjectChangedError(loc.display, f"the object now has {declared} bytes, {size} when it was opened")
        return
    match = _CONTENT_RANGE.fullmatch((response.getheader("Content-Range") or "").strip())
    if match is None:
        raise RemoteProtocolError(loc.display, f"HTTP 206 without a usable Content-Range ({match!r})")
    first, last, total = match.groups()
    if total != "*" and int(total) != size:
        raise ObjectChangedError(loc.display, f"the object now has {total} bytes, {size} when it was opened")
    if (int(first), int(last)) != (offset, offset + length - 1) or (declared is not None and int(declared) != length):
        raise RemoteProtocolError(
            loc.display,
            f"asked for bytes {offset}-{offset + length - 1}, the server sent {first}-{last} "
            f"(Content-Length {declared})",
        )


def _status_error(response, loc: Location):
    """Raise what an unexpected status means: retryable, or a typed error. Only the S3 error
    code is quoted from the body (its other fields can echo the request's signing details)."""
    declared = response.getheader("Content-Length")
    body = response.read() if declared is not None and declared.isdigit() and int(declared) <= 65536 else b""
    if not body and declared not in (None, "0"):
        response.close()
    match = re.search(rb"<Code>([A-Za-z0-9.]{1,64})</Code>", body)
    status = response.status
    text = f"HTTP {status}" + (f" ({match.group(1).decode()})" if match else "")
    if status in _RETRY_STATUS or status >= 500:
        after = response.getheader("Retry-After")
        raise _Retryable(text, float(after) if after and after.isdigit() else None)
    if status == 404:
        raise RemoteNotFoundError(loc.display, f"{text}: no such object (or bucket)")
    code = match.group(1) if match else b""
    if status in (401, 403) or b"Token" in code or b"Authorization" in code:
        raise RemoteAccessError(
            loc.display,
            f"{text}: access denied. Check the credentials the AWS chain resolves (AWS_ACCESS_KEY_ID / "
            "AWS_PROFILE / ~/.aws), the region and the endpoint (TORCH_FASTLOAD_S3_ENDPOINT_URL / AWS_ENDPOINT_URL)",
        )
    if match and (b"Redirect" in match.group(1) or b"IllegalLocationConstraint" in match.group(1)):
        raise RemoteAccessError(loc.display, f"{text}: the bucket is in another region; set AWS_REGION to it")
    if status in (412, 416):
        raise ObjectChangedError(
            loc.display, f"the object changed since it was opened ({text}); re-open the dataset to read the new one"
        )
    raise RemoteProtocolError(loc.display, f"unexpected answer {text}")
