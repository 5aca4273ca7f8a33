"""A loopback object server for tests and benchmarks: files under a root directory served at
``http://127.0.0.1:<port>/<relative path>`` (also path-style S3: ``/bucket/key``) with GET and
HEAD, single ranges, ETag / Last-Modified / If-Match, and switches that make it misbehave.

    python -m torch_fastload.remote.loopback --root DIR [--latency 0.01] [--bandwidth 1G]

It runs in its own process (asyncio, bodies sent with sendfile), so the reader under test
does not share a GIL with it; ``processes=N`` runs N event loops (forked) on one listening
socket, their switches, bandwidth bucket and counters in shared memory. ``LoopbackServer`` starts one and drives it::

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
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import unquote

__all__ = ["LoopbackServer", "serve"]

CHUNK = 256 << 10  # bytes per paced send, at least
# ...or this long at the cap: each paced send costs the server's event loop ~0.1 ms of Python, so
# fixed 256 KiB sends at ~8 GB/s (30k a second over a few processes) made the server the wall
PACE_SECONDS = float(os.environ.get("TORCH_FASTLOAD_LOOPBACK_PACE_S", "0.0005"))


_SWITCHES = ("latency", "bandwidth", "fail", "fail_status", "stall", "stall_seconds", "ignore_range", "reset")
_SWITCHES += ("refuse_head",)
_FLAGS = ("ignore_range", "refuse_head")
_STATS = ("connections", "requests", "failed", "stalled", "reset", "bytes", "in_flight", "in_flight_max")
_STATS += ("in_flight_seconds",)


class _State:
    """Switches and counters in shared memory under one lock: every process of a server (see
    ``serve``'s ``processes``) sees the same switches, bucket and counts."""

    def __init__(self, root: str, latency: float, bandwidth: float):
        self.root = os.path.realpath(root)
        names = [f"switch.{n}" for n in _SWITCHES] + [f"stat.{n}" for n in _STATS] + ["since", "sent_until"]
        self._at = {name: i for i, name in enumerate(names)}
        self._values = multiprocessing.RawArray("d", len(names))
        self._lock = multiprocessing.Lock()
        self.update({"latency": latency, "bandwidth": bandwidth, "fail_status": 503})
        self._set("since", time.monotonic())

    def _get(self, name: str) -> float:
        return self._values[self._at[name]]

    def _set(self, name: str, value: float) -> None:
        self._values[self._at[name]] = value

    def switch(self, name: str) -> float:
        return self._get(f"switch.{name}")

    def update(self, switches: dict) -> None:
        unknown = set(switches) - set(_SWITCHES)
        if unknown:
            raise ValueError(f"unknown switches {sorted(unknown)}")
        with self._lock:
            for name, value in switches.items():
                self._set(f"switch.{name}", float(value))

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._set(f"stat.{name}", self._get(f"stat.{name}") + n)

    def snapshot(self) -> dict:
        with self._lock:
            self._in_flight(0)
            switches = {n: self.switch(n) for n in _SWITCHES}
            stats = {n: self._get(f"stat.{n}") for n in _STATS}
        switches = {
            n: bool(v) if n in _FLAGS else v if n.endswith(("seconds", "latency", "bandwidth")) else int(v)
            for n, v in switches.items()
        }
        return {"switches": switches, "stats": {n: v if n.endswith("seconds") else int(v) for n, v in stats.items()}}

    def in_flight(self, delta: int) -> None:
        with self._lock:
            self._in_flight(delta)

    def _in_flight(self, delta: int) -> None:
        """Requests being answered (from the request line to the last byte handed to the
        kernel): now, the most at once, and their integral over time (its change over an
        interval, divided by the interval, is the mean number in flight: what a client kept busy)."""
        now, now_in = time.monotonic(), self._get("stat.in_flight")
        self._set("stat.in_flight_seconds", self._get("stat.in_flight_seconds") + now_in * (now - self._get("since")))
        self._set("since", now)
        self._set("stat.in_flight", now_in + delta)
        self._set("stat.in_flight_max", max(self._get("stat.in_flight_max"), now_in + delta))

    async def pace(self, nbytes: int) -> None:
        """The shared token bucket: wait until ``nbytes`` more may leave under the cap."""
        rate = self.switch("bandwidth")
        if rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            until = max(self._get("sent_until"), now) + nbytes / rate
            self._set("sent_until", until)
        if until - now > 0.002:
            await asyncio.sleep(until - now)

    def take(self, name: str) -> bool:
        with self._lock:
            if self.switch(name) > 0:
                self._set(f"switch.{name}", self.switch(name) - 1)
                stat = {"fail": "failed", "stall": "stalled"}.get(name, name)
                self._set(f"stat.{stat}", self._get(f"stat.{stat}") + 1)
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
        if wanted.startswith("bytes=") and not state.switch("ignore_range"):
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
        if state.switch("bandwidth") <= 0:  # no cap: the whole range in one sendfile (no pacing)
            await loop.sendfile(writer.transport, f, at, end - at)
            at = end
        chunk = max(CHUNK, int(state.switch("bandwidth") * PACE_SECONDS))
        while at < end:
            n = min(chunk, end - at)
            await state.pace(n)
            await writer.drain()
            await loop.sendfile(writer.transport, f, at, n)
            at += n
        state.count("bytes", end - start)


async def _answer(state: _State, method: str, target: str, headers: dict, writer) -> None:
    if state.switch("latency") > 0:
        await asyncio.sleep(state.switch("latency"))
    if state.take("stall"):
        await asyncio.sleep(state.switch("stall_seconds"))
    if state.take("fail"):
        status = int(state.switch("fail_status"))
        writer.write(_error(status, "SlowDown" if status == 503 else "InternalError"))
    elif method == "HEAD" and state.switch("refuse_head"):  # as S3 does for a GET-presigned URL
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
                try:
                    state.update(json.loads(body or b"{}"))
                    reply, status = json.dumps(state.snapshot()).encode(), 200
                except ValueError as exc:
                    reply, status = str(exc).encode(), 400
                writer.write(_head(status, {"Content-Length": len(reply)}) + reply)
                await writer.drain()
                continue
            state.count("requests")
            if not served:
                state.count("connections")
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


def serve(root: str, port: int = 0, latency: float = 0.0, bandwidth: float = 0.0, processes: int = 1) -> None:
    """Serve ``root`` until terminated; prints ``listening on <port>`` once ready. ``processes``
    > 1 forks that many event loops in all onto one listening socket and one shared state, so a
    benchmark's uncapped rates are the clients' and not one server thread's (sendfile and the
    loopback's TCP work on the sending side cost ~0.2 core-seconds per GB)."""
    state = _State(root, latency, bandwidth)
    listener = socket.create_server(("127.0.0.1", port), backlog=1024)
    children = []
    for _ in range(processes - 1):
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(_accept(state, listener, parent=os.getppid()))
            finally:
                os._exit(0)
        children.append(pid)
    if children:  # terminated (LoopbackServer.stop): the forked loops end with it

        def stop(signum, frame):
            for pid in children:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
    print(f"listening on {listener.getsockname()[1]}", flush=True)
    asyncio.run(_accept(state, listener))


async def _accept(state: _State, listener: socket.socket, parent: int | None = None) -> None:
    """One process's event loop on the shared listener; a forked one ends with its parent."""
    server = await asyncio.start_server(lambda r, w: _handle(state, r, w), sock=listener)
    async with server:
        if parent is None:
            await server.serve_forever()
        while os.getppid() == parent:
            await asyncio.sleep(0.5)


class LoopbackServer:
    """A ``serve`` process on a free loopback port; a context manager."""

    def __init__(self, root, latency: float = 0.0, bandwidth: float = 0.0, processes: int = 1):
        self.root = os.fspath(root)
        command = [sys.executable, "-m", "torch_fastload.remote.loopback", "--root", self.root]
        command += ["--latency", str(latency), "--bandwidth", str(bandwidth), "--processes", str(processes)]
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
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise ValueError(body.decode())
            return json.loads(body)
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
    parser.add_argument("--processes", type=int, default=1, help="event loops (processes) on one listener [1]")
    args = parser.parse_args(argv)
    try:
        bandwidth = float(args.bandwidth)
    except ValueError:
        bandwidth = float(parse_size(args.bandwidth))
    try:
        serve(args.root, args.port, args.latency, bandwidth, args.processes)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
