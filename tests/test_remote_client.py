"""The HTTP client's range reads against the loopback server: bodies received straight into
their destination keep the connection for the next request and leave the socket as found."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch

from torch_fastload import config
from torch_fastload.remote import RemoteReader
from torch_fastload.remote.client import Client
from torch_fastload.remote.errors import RemoteReadError
from torch_fastload.remote.loopback import LoopbackServer
from torch_fastload.remote.reader import MIN_PIECE, SPREAD, plan_requests
from torch_fastload.remote.url import parse

MiB = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("objects")
    payload = np.random.default_rng(3).integers(0, 256, 6 * MiB + 123, dtype=np.uint8)
    (root / "blob.bin").write_bytes(payload.tobytes())
    with LoopbackServer(root) as server:
        yield server, payload


@pytest.mark.parametrize("wake_bytes", [0, 256 << 10])
def test_large_ranges_arrive_exact_on_one_kept_connection(served, wake_bytes):
    server, payload = served
    loc = parse(server.url("blob.bin"))
    client = Client(timeout=10, retries=0, wake_bytes=wake_bytes)  # 0: http.client's reads; else straight in
    before = server.stats()
    spans = [(0, 3 * MiB), (3 * MiB, 3 * MiB + 123), (17, 5 * MiB + 1), (len(payload) - 1, 1), (1, 64)]
    try:
        for offset, length in spans:
            out = np.zeros(length, dtype=np.uint8)
            client.read_range(loc, len(payload), None, offset, out)
            np.testing.assert_array_equal(out, payload[offset : offset + length])
        (conn,) = client._local.conns.values()
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1  # headers never wait for more
    finally:
        client.close()
    after = server.stats()
    assert after["requests"] - before["requests"] == len(spans)
    assert after["connections"] - before["connections"] == 1  # every answer read to its end: reused


def test_server_counts_requests_in_flight(served):
    server, payload = served
    loc = parse(server.url("blob.bin"))
    client = Client(timeout=10, retries=0)
    server.control(latency=0.05)
    try:
        before = server.stats()
        client.read_range(loc, len(payload), None, 0, np.zeros(MiB, dtype=np.uint8))
        after = server.stats()
    finally:
        server.control(latency=0)
        client.close()
    assert after["in_flight"] == 0 and after["in_flight_max"] >= 1
    assert after["in_flight_seconds"] - before["in_flight_seconds"] >= 0.05  # one request, its latency at least


def test_a_server_of_several_processes_shares_its_switches_and_counts(tmp_path):
    payload = np.random.default_rng(5).integers(0, 256, 2 * MiB, dtype=np.uint8)
    (tmp_path / "blob.bin").write_bytes(payload.tobytes())
    with LoopbackServer(tmp_path, processes=3) as server:
        server.control(fail=2)
        clients = [Client(timeout=10, retries=0) for _ in range(6)]  # one connection each
        loc, failed = parse(server.url("blob.bin")), 0
        try:
            for client in clients:
                out = np.zeros(MiB, dtype=np.uint8)
                try:
                    client.read_range(loc, len(payload), None, 7, out)
                except RemoteReadError:
                    failed += 1
                    continue
                np.testing.assert_array_equal(out, payload[7 : 7 + MiB])
        finally:
            for client in clients:
                client.close()
        stats, pid = server.stats(), server.process.pid
        assert failed == 2 and stats["failed"] == 2  # the two 503s, whichever process answered
        assert stats["requests"] == 6 and stats["connections"] == 6 and stats["bytes"] == 4 * MiB
        children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == pid]
        assert len(children) == 2
    assert not any(os.path.exists(f"/proc/{p}") and _parent(p) == pid for p in children)  # ended with it


def _parent(pid) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_a_slow_body_is_not_a_timeout_while_bytes_keep_coming(served):
    """Waiting for a large wake-up threshold on a slow link must not turn "fewer bytes than the
    threshold within remote_timeout" into a timeout: only no byte at all is one."""
    server, payload = served
    loc = parse(server.url("blob.bin"))
    client = Client(timeout=0.5, retries=0, wake_bytes=MiB)  # above the server's 256 KiB paced sends
    conn = client._connection(loc)
    conn.connect()  # a large receive buffer: the wake-up threshold is not held down by it
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MiB)
    server.control(bandwidth=1.5e6)  # 1.5 MiB take ~1 s, the 1 MiB threshold ~0.7 s
    try:
        out = np.zeros(3 * MiB // 2, dtype=np.uint8)
        client.read_range(loc, len(payload), None, 5, out)
        np.testing.assert_array_equal(out, payload[5 : 5 + len(out)])
    finally:
        server.control(bandwidth=0)
        client.close()


def test_a_batch_smaller_than_concurrency_x_request_size_is_spread_over_connections():
    one = [np.array([v]) for v in (0, 0, 16 * MiB, 0)]  # one 16 MiB range
    assert len(plan_requests(*one, 16 * MiB)) == 1  # no concurrency given: request_size pieces
    spread = plan_requests(*one, 16 * MiB, 64)
    assert [r[2] for r in spread] == [MIN_PIECE] * (16 * MiB // MIN_PIECE)  # never below MIN_PIECE
    assert [r[1] for r in spread] == [r[3] for r in spread] == list(range(0, 16 * MiB, MIN_PIECE))
    wide = plan_requests(*[np.array([v]) for v in (0, 0, 1 << 30, 0)], 16 * MiB, 16)
    assert {r[2] for r in wide} == {16 * MiB}  # enough bytes for every connection: request_size stays
    many = plan_requests(*[np.array([v]) for v in (0, 0, 256 * MiB, 0)], 16 * MiB, 64)
    assert len(many) == SPREAD == 16 and {r[2] for r in many} == {16 * MiB}  # SPREAD requests: not cut to 64
    odd = plan_requests(*[np.array([v]) for v in (0, 5, 40 * MiB + 3, 7)], 16 * MiB, 4)
    assert [r[2] for r in odd] == [10 * MiB + (64 << 10)] * 3 + [40 * MiB + 3 - 3 * (10 * MiB + (64 << 10))]


def test_a_reader_spreads_one_range_over_its_connections(served):
    server, payload = served
    before = server.stats()
    out = torch.zeros(5 * MiB, dtype=torch.uint8)
    with RemoteReader(concurrency=8, request_size=16 * MiB, backend="http") as reader:
        zero = np.zeros(1, dtype=np.int64)
        reader.read(out, [server.url("blob.bin")], zero, np.array([9]), np.array([5 * MiB]), zero)
    np.testing.assert_array_equal(out.numpy(), payload[9 : 9 + 5 * MiB])
    after = server.stats()
    assert after["requests"] - before["requests"] == 1 + 2  # its HEAD at open, then 4 + 1 MiB


def test_the_wake_up_threshold_is_an_option_off_by_default():
    assert Client().wake_bytes == 0
    with config.override(remote_wake_bytes="256KiB"):
        assert Client().wake_bytes == 256 << 10
    with pytest.raises(ValueError, match="remote_wake_bytes"):
        with config.override(remote_wake_bytes="lots"):
            pass
