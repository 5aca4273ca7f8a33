"""Where an object lives and how requests for it are signed.

``s3://bucket/key`` resolves against the S3 endpoint: ``config.get('s3_endpoint_url')``
(``TORCH_FASTLOAD_S3_ENDPOINT_URL``), else AWS's ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
(S3-compatible servers: MinIO, Ceph, R2, ...; path-style addressing), else AWS itself
(virtual-hosted addressing). Requests are signed with AWS Signature Version 4 using the
standard credential chain: botocore's resolver where botocore is installed (environment,
shared credentials and config files, SSO, container and instance roles), else the
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` variables; with no
credentials at all requests go unsigned (public buckets). ``http(s)://`` URLs are fetched as
given (a presigned URL carries its own signature).

Credentials are never printed, logged or put in a message: ``Credentials`` hides them in its
repr, and every message names an object by ``Location.display`` (no query string, no user
info).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import threading
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from .. import config

__all__ = ["is_url", "Location", "parse", "Credentials", "credentials", "region", "sign", "scrub", "SCHEMES"]

SCHEMES = ("s3://", "http://", "https://")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def is_url(path) -> bool:
    """Whether ``path`` names a remote object (``s3://``, ``http://``, ``https://``)."""
    return isinstance(path, str) and path[:8].lower().startswith(SCHEMES)


@dataclass(frozen=True)
class Location:
    """An object's address: the connection, the request target and a safe name for messages."""

    url: str  # as given (may hold a presigned query: never shown)
    scheme: str  # "http" or "https": the connection's
    host: str
    port: int
    target: str  # path (and query) of the request
    display: str  # what messages show
    bucket: str = ""  # s3 only: the request is signed
    key: str = ""

    @property
    def signed(self) -> bool:
        return bool(self.bucket)

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


def _endpoint() -> str:
    return (
        config.get("s3_endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3", "")
        or os.environ.get("AWS_ENDPOINT_URL", "")
    ).rstrip("/")


def region() -> str:
    """The signing region: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, botocore's config, else us-east-1."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if os.environ.get(name):
            return os.environ[name]
    session = _botocore_session()
    if session is not None:
        try:
            configured = session.get_config_variable("region")
        except Exception:
            configured = None
        if configured:
            return configured
    return "us-east-1"


def parse(url: str) -> Location:
    """The ``Location`` of ``url``; raises ValueError naming what is wrong (not the query)."""
    if not is_url(url):
        raise ValueError(f"not an s3:// or http(s):// URL: {url!r}")
    if url[:5].lower() == "s3://":
        bucket, _, key = url[5:].partition("/")
        if not bucket or not key:
            raise ValueError(f"an S3 URL is s3://bucket/key, got {url!r}")
        display = f"s3://{bucket}/{key}"
        quoted = quote(key, safe="/~")
        endpoint = _endpoint()
        if endpoint:
            parts = urlsplit(endpoint)
            base = parts.path.rstrip("/")
            return _located(url, parts, f"{base}/{bucket}/{quoted}", display, bucket, key)
        name = f"s3.{region()}.amazonaws.com"
        if "." in bucket:  # a dotted bucket breaks TLS on virtual hosts
            return _located(url, urlsplit(f"https://{name}"), f"/{bucket}/{quoted}", display, bucket, key)
        return _located(url, urlsplit(f"https://{bucket}.{name}"), f"/{quoted}", display, bucket, key)
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"no host in URL {_safe(parts)!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _located(url, parts, target, _safe(parts))


def _safe(parts) -> str:
    """``scheme://host[:port]/path``, plus a marker where a query (maybe a signature) was left out."""
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return f"{parts.scheme}://{netloc}{parts.path}" + ("?<query hidden>" if parts.query else "")


def _located(url, parts, target, display, bucket="", key="") -> Location:
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"endpoint scheme must be http or https, got {scheme!r}")
    port = parts.port or (443 if scheme == "https" else 80)
    return Location(url, scheme, parts.hostname, port, target, display, bucket, key)


# ------------------------------------------------------------------------------------------
# credentials
# ------------------------------------------------------------------------------------------
class Credentials:
    """An access key, its secret and an optional session token; shown as ``<hidden>``."""

    __slots__ = ("access_key", "secret_key", "token")

    def __init__(self, access_key: str, secret_key: str, token: str | None = None):
        self.access_key = access_key
        self.secret_key = secret_key
        self.token = token or None

    def __repr__(self) -> str:
        return "Credentials(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled into a worker's dataset: workers resolve their own
        raise TypeError("Credentials are not picklable")


_session_lock = threading.Lock()
_session: list = []  # [botocore session or None, its credentials or None] once probed


def _botocore_session():
    with _session_lock:
        if not _session:
            try:
                import botocore.session

                _session.append(botocore.session.get_session())
            except Exception:  # not installed (the optional extra 'remote')
                _session.append(None)
        return _session[0]


def credentials() -> Credentials | None:
    """The standard chain's credentials now (botocore refreshes expiring ones), or None. The
    chain is resolved once per process (a miss included: it may probe instance metadata)."""
    session = _botocore_session()
    if session is not None:
        with _session_lock:
            if len(_session) == 1:
                try:
                    _session.append(session.get_credentials())
                except Exception:
                    _session.append(None)
            found = _session[1]
        if found is None:
            return None
        frozen = found.get_frozen_credentials()
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Credentials(key, secret, os.environ.get("AWS_SESSION_TOKEN"))
    return None


def scrub(text: str) -> str:
    """``text`` with the credentials in effect and URL query strings (presigned signatures) cut out."""
    creds = credentials()
    for secret in (creds.secret_key, creds.token, creds.access_key) if creds is not None else ():
        if secret:
            text = text.replace(secret, "<hidden>")
    return re.sub(r"(https?://[^\s?]*)\?\S*", r"\1?<query hidden>", text)


def reset() -> None:
    """Forget the probed botocore session and credentials (the environment changed)."""
    with _session_lock:
        _session.clear()


# ------------------------------------------------------------------------------------------
# AWS Signature Version 4 (S3 flavour: the path is not double-encoded, payload unsigned)
# ------------------------------------------------------------------------------------------
def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _canonical_query(query: str) -> str:
    if not query:
        return ""
    pairs = []
    for item in query.split("&"):
        name, _, value = item.partition("=")
        pairs.append((quote(unquote(name), safe="-_.~"), quote(unquote(value), safe="-_.~")))
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def sign(method: str, loc: Location, headers: dict, creds: Credentials, signing_region: str, now=None) -> None:
    """Add SigV4 headers (``authorization``, ``x-amz-date``, ...) for a bodiless request to ``headers``
    (lower-case names)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    headers["host"] = loc.host_header
    headers["x-amz-date"] = stamp
    headers["x-amz-content-sha256"] = EMPTY_SHA256
    if creds.token:
        headers["x-amz-security-token"] = creds.token
    path, _, query = loc.target.partition("?")
    names = sorted(headers)
    canonical = "\n".join(
        [
            method,
            path,
            _canonical_query(query),
            "".join(f"{n}:{' '.join(str(headers[n]).split())}\n" for n in names),
            ";".join(names),
            EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{signing_region}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + creds.secret_key).encode(), day), signing_region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
