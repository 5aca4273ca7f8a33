"""A loopback object server for tests and benchmarks: files under a root directory served at
``http://127.0.0.1:<port>/<relative path>`` (also path-style S3: ``/bucket/key``) with GET and
HEAD, single ranges, ETag / Last-Modified / If-Match, and switches that make it misbehave.

    python -m torch_fastload.remote.loopback --root DIR [--latency 0.01] [--bandwidth 1G]

It runs in its own process (asyncio, bodies sent with sendfile), so the reader under test
does not share a GIL with it. ``LoopbackServer`` starts one and drives it::

    with LoopbackServer(root, latency=0.01, bandwidth=500e6) as server:
        server.url("bucket/x.bin")        # http://127.0.0.1:port/bucket/x.bin
        server.control(fail=3)            # the next 3 requests answer 503
        server.control(stall=1, stall_seconds=5)   # the next request waits 5 s before answering
        server.control(ignore_range=True) # ranges answered with the whole object (HTTP 200)
        server.stats()                    # requests, failed, stalled, in_flight_seconds, ...

Latency is added before each answer; the bandwidth cap paces every body through one shared
token bucket. An object replaced on disk (``os.replace``) gets a new ETag; an answer in
progress keeps sending the file it opened.
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import http.client
import json
import os
import subprocess
import sys
import time
from urllib.parse import unquote

__all__ = ["LoopbackServer", "serve"]

CHUNK = 256 << 10  # bytes per paced send


class _State:
    def __init__(self, root: str, latency: float, bandwidth: float):
        self.root = os.path.realpath(root)
        self.switches = {"latency": latency, "bandwidth": bandwidth, "fail": 0, "fail_status": 503}
        self.switches.update(stall=0, stall_seconds=0.0, ignore_range=False, reset=0, refuse_head=False)
        self.stats = {"connections": 0, "requests": 0, "failed": 0, "stalled": 0, "reset": 0, "bytes": 0}
        # requests being answered (from the request line to the last byte handed to the kernel):
        # now, the most at once, and their integral over time (its change over an interval,
        # divided by the interval, is the mean number in flight: what a client kept busy)
        self.stats.update(in_flight=0, in_flight_max=0, in_flight_seconds=0.0)
        self._since = time.monotonic()
        self.sent_until = 0.0  # the token bucket: when the bytes sent so far may have left

    def in_flight(self, delta: int) -> None:
        now = time.monotonic()
        self.stats["in_flight_seconds"] += self.stats["in_flight"] * (now - self._since)
        self._since = now
        self.stats["in_flight"] += delta
        self.stats["in_flight_max"] = max(self.stats["in_flight_max"], self.stats["in_flight"])

    async def pace(self, nbytes: int) -> None:
        rate = self.switches["bandwidth"]
        if rate <= 0:
            return
        now = time.monotonic()
        self.sent_until = max(self.sent_until, now) + nbytes / rate
        if self.sent_until - now > 0.002:
            await asyncio.sleep(self.sent_until - now)

    def take(self, name: str) -> bool:
        if self.switches[name] > 0:
            self.switches[name] -= 1
            self.stats[{"fail": "failed", "stall": "stalled"}.get(name, name)] += 1
            return True
        return False


def _head(status: int, headers: dict) -> bytes:
    lines = [f"HTTP/1.1 {status} {http.client.responses.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _error(status: int, code: str) -> bytes:
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code></Error>".encode()
    return _head(status, {"Content-Type": "application/xml", "Content-Length": len(body)}) + body


async def _serve_object(state: _State, method: str, target: str, headers: dict, writer) -> None:
    path = os.path.realpath(os.path.join(state.root, unquote(target.split("?", 1)[0]).lstrip("/")))
    if not path.startswith(state.root + os.sep):
        writer.write(_error(403, "AccessDenied"))
        return
    try:
        f = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        writer.write(_error(404, "NoSuchKey"))
        return
    with f:
        info = os.fstat(f.fileno())
        etag = f'"{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}"'
        common = {
            "ETag": etag,
            "Last-Modified": email.utils.formatdate(info.st_mtime, usegmt=True),
            "Accept-Ranges": "bytes",
        }
        if headers.get("if-match") not in (None, etag):
            writer.write(_error(412, "PreconditionFailed"))
            return
        size, start, end, status = info.st_size, 0, info.st_size, 200
        wanted = headers.get("range", "")
        if wanted.startswith("bytes=") and not state.switches["ignore_range"]:
            first, _, last = wanted[6:].partition("-")
            start = int(first)
            end = min(size, int(last) + 1) if last else size
            if start >= size or end <= start:
                writer.write(_error(416, "InvalidRange"))
                return
            status = 206
            common["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        common["Content-Length"] = end - start
        writer.write(_head(status, common))
        if method == "HEAD":
            return
        if state.take("reset"):
            writer.transport.abort()
            return
        loop = asyncio.get_running_loop()
        at = start
        if state.switches["bandwidth"] <= 0:  # no cap: the whole range in one sendfile (no pacing)
            await loop.sendfile(writer.transport, f, at, end - at)
            at = end
        while at < end:
            n = min(CHUNK, end - at)
            await state.pace(n)
            await writer.drain()
            await loop.sendfile(writer.transport, f, at, n)
            at += n
        state.stats["bytes"] += end - start


async def _answer(state: _State, method: str, target: str, headers: dict, writer) -> None:
    if state.switches["latency"] > 0:
        await asyncio.sleep(state.switches["latency"])
    if state.take("stall"):
        await asyncio.sleep(state.switches["stall_seconds"])
    if state.take("fail"):
        status = int(state.switches["fail_status"])
        writer.write(_error(status, "SlowDown" if status == 503 else "InternalError"))
    elif method == "HEAD" and state.switches["refuse_head"]:  # as S3 does for a GET-presigned URL
        writer.write(_error(403, "SignatureDoesNotMatch"))
    elif method in ("GET", "HEAD"):
        await _serve_object(state, method, target, headers, writer)
    else:
        writer.write(_error(405, "MethodNotAllowed"))
    await writer.drain()


async def _handle(state: _State, reader, writer) -> None:
    served = 0  # object requests on this connection (control requests not counted)
    try:
        while True:
            line = await reader.readline()
            if not line.strip():
                return
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers = {}
            while True:
                header = await reader.readline()
                if header in (b"\r\n", b"\n", b""):
                    break
                name, _, value = header.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            if target.startswith("/__control__"):
                state.switches.update(json.loads(body or b"{}"))
                state.in_flight(0)  # the integral up to now
                reply = json.dumps({"switches": state.switches, "stats": state.stats}).encode()
                writer.write(_head(200, {"Content-Length": len(reply)}) + reply)
                await writer.drain()
                continue
            state.stats["requests"] += 1
            state.stats["connections"] += not served
            served += 1
            state.in_flight(1)
            try:
                await _answer(state, method, target, headers, writer)
            finally:
                state.in_flight(-1)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def serve(root: str, port: int = 0, latency: float = 0.0, bandwidth: float = 0.0) -> None:
    """Serve ``root`` until cancelled; prints ``listening on <port>`` once ready."""
    state = _State(root, latency, bandwidth)
    server = await asyncio.start_server(lambda r, w: _handle(state, r, w), "127.0.0.1", port, backlog=1024)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


class LoopbackServer:
    """A ``serve`` process on a free loopback port; a context manager."""

    def __init__(self, root, latency: float = 0.0, bandwidth: float = 0.0):
        self.root = os.fspath(root)
        command = [sys.executable, "-m", "torch_fastload.remote.loopback", "--root", self.root]
        command += ["--latency", str(latency), "--bandwidth", str(bandwidth)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if not line.startswith("listening on "):
            self.process.kill()
            raise RuntimeError(f"the loopback server did not start (printed {line!r})")
        self.port = int(line.split()[-1])
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def url(self, relative: str) -> str:
        return f"{self.endpoint}/{relative.lstrip('/')}"

    def control(self, **switches) -> dict:
        """Change switches (fail, fail_status, stall, stall_seconds, ignore_range, reset,
        refuse_head, latency, bandwidth); returns the switches and stats now."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", "/__control__", body=json.dumps(switches))
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def stats(self) -> dict:
        return self.control()["stats"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    from ..config import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added before each answer")
    parser.add_argument("--bandwidth", default="0", help="bytes/s cap over all connections (e.g. 1e9, 500M); 0: none")
    args = parser.parse_args(argv)
    try:
        bandwidth = float(args.bandwidth)
    except ValueError:
        bandwidth = float(parse_size(args.bandwidth))
    try:
        asyncio.run(serve(args.root, args.port, args.latency, bandwidth))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
