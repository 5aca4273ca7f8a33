"""Typed errors of remote reads. Each names the object by its display URL (no query string,
no user info: those can hold credentials) and never carries a request header or signature."""

from __future__ import annotations

from ..errors import FastloadError

__all__ = [
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteAccessError",
    "RemoteReadError",
    "RemoteTimeoutError",
    "ObjectChangedError",
    "RangeNotSupportedError",
    "RemoteProtocolError",
]


class RemoteError(FastloadError, OSError):
    """A read of an object in object storage (or an HTTP server) failed; ``url`` names it."""

    def __init__(self, url: str, problem: str):
        self.url = url
        self.problem = problem
        super().__init__(f"{url}: {problem}")

    def __reduce__(self):  # OSError's pickling would call __init__ with the wrong arguments
        return (_rebuild, (type(self), self.__dict__))

    def __str__(self) -> str:
        return f"{self.url}: {self.problem}"


def _rebuild(cls, state):
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = (str(error),)
    return error


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The object (or its bucket) does not exist (HTTP 404)."""


class RemoteAccessError(RemoteError, PermissionError):
    """The server refused the request (HTTP 401/403): missing or wrong credentials, or no permission."""


class RemoteReadError(RemoteError):
    """Every attempt of a request failed (5xx, 429, resets); ``attempts`` were made."""

    def __init__(self, url: str, problem: str, attempts: int):
        self.attempts = attempts
        super().__init__(url, problem)


class RemoteTimeoutError(RemoteReadError, TimeoutError):
    """The server stalled past ``remote_timeout`` on every attempt."""


class ObjectChangedError(RemoteError):
    """The object's size or version (ETag) differs from the one recorded when it was opened: it
    was replaced, and reading on would mix two versions in one batch."""


class RangeNotSupportedError(RemoteError):
    """The server answered a range request with the whole object (it ignores ``Range``)."""


class RemoteProtocolError(RemoteError):
    """An answer that does not describe the bytes asked for (wrong Content-Range, length, status)."""
