"""Remote read-ahead (torch_fastload/remote/ahead.py): the loader requests the ranges of the
batches it has fetched before their turn, on a real loopback object server. The batches must be
the local files' byte for byte, a read-ahead batch's error must be raised by that batch's
``next()`` (the batches before it delivered), and a loader shut down while read-ahead requests
are in flight must cancel them and leave no thread. No timing assertions: the server's injected
latency only orders events (a request cannot be answered before it waits out the latency)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from remote_helpers import ROWS, assert_no_threads_left, make_data, remote_threads

from torch_fastload import ArrayDataset, DataLoader, RecordDataset, config, remote
from torch_fastload.remote import ObjectChangedError
from torch_fastload.remote.loopback import LoopbackServer

LATENCY = 0.5  # seconds every answer waits: far longer than the loader's own steps


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("objects")
    make_data(str(root / "data"))
    return root


@pytest.fixture(scope="module")
def server(data):
    with LoopbackServer(data) as running:
        yield running


@pytest.fixture(autouse=True)
def clean(server):
    with config.override(remote_backoff=0.01, remote_timeout=5.0):
        yield
    server.control(fail=0, stall=0, ignore_range=False, reset=0, refuse_head=False, latency=0, bandwidth=0)
    remote.reset()
    assert_no_threads_left()


def url(server, name: str) -> str:
    return server.url(f"data/{name}")


def remote_reader(loader):
    """The loader's RemoteReader (made by its first batch)."""
    readers = [r._remote for r in loader.resources.readers() if r._remote is not None]
    assert len(readers) == 1
    return readers[0]


@pytest.mark.parametrize("budget", [256 << 20, 3 * 64 * 33 * 4])  # every batch ahead; only ~3 at a time
def test_read_ahead_batches_equal_the_local_files(data, server, budget):
    x = np.load(data / "data" / "x.npy")

    def epoch(path: str) -> tuple[list, DataLoader]:
        generator = torch.Generator().manual_seed(5)
        loader = DataLoader(ArrayDataset(path), batch_size=64, shuffle=True, device="cpu", generator=generator)
        return list(loader), loader

    theirs, local_loader = epoch(str(data / "data" / "x.npy"))
    local_loader.close()
    before = remote.counters().get("read_ahead", 0)
    with config.override(remote_read_ahead=budget):
        ours, loader = epoch(url(server, "x.npy"))
        try:
            assert len(ours) == len(theirs) == -(-ROWS // 64)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
            assert loader.stats().io_bytes["remote-http"] == x.nbytes
            assert remote_reader(loader).ahead.held == 0  # every entry taken
        finally:
            loader.close()
    started = remote.counters().get("read_ahead", 0) - before
    if budget >= x.nbytes:  # every batch fits: every one came from its read-ahead entry
        assert started == len(ours)
    else:  # some batches came from read-ahead entries, others were read in their turn
        assert 0 < started <= len(ours)


def test_a_read_ahead_batch_fails_at_its_own_next(data, server):
    """The last shard of a record pack is replaced after the dataset opened it: the batches
    before the first one touching it arrive intact, that batch's next() raises, although its
    requests were sent (and answered with the new version) while earlier batches were read."""
    shutil.copytree(data / "data" / "pack", data / "data" / "pack-ahead")
    try:
        local = RecordDataset(str(data / "data" / "pack-ahead"))
        dataset = RecordDataset(url(server, "pack-ahead"))
        shards = sorted((data / "data" / "pack-ahead").glob("shard-*.bin"))
        last = shards[-1]
        fresh = last.with_suffix(".new")
        fresh.write_bytes(bytes(255 - b for b in last.read_bytes()))
        os.replace(fresh, last)
        batch = 10
        first_bad = _first_batch_reading(local, last.name, batch)
        assert first_bad >= 2  # the failing batch is fetched (and read ahead) before its turn
        before = remote.counters().get("read_ahead", 0)
        loader = DataLoader(dataset, batch_size=batch, device="cpu", prefetch=4)
        delivered = []
        try:
            with pytest.raises(ObjectChangedError, match=last.name) as info:
                for got in loader:
                    delivered.append(got)
        finally:
            loader.close()
        assert len(delivered) == first_bad
        for k, got in enumerate(delivered):
            expected = [local[i][0] for i in range(k * batch, (k + 1) * batch)]
            assert [bytes(r.numpy()) for r in got.split()] == [bytes(e.numpy()) for e in expected]
        assert any(f"batch {first_bad})" in note for note in info.value.__notes__)  # raised at its own next()
        assert remote.counters().get("read_ahead", 0) - before > first_bad  # the failing one was ahead too
    finally:
        shutil.rmtree(data / "data" / "pack-ahead")


def _first_batch_reading(local, shard: str, batch: int) -> int:
    """The first batch (unshuffled) whose records lie in ``shard`` of the pack."""
    k = 0
    while True:
        read = local.__fastload_batch__(list(range(k * batch, min(len(local), (k + 1) * batch))))
        reads = [f for f in (read if isinstance(read, (tuple, list)) else [read]) if hasattr(f, "paths")]
        if any(os.path.basename(str(read.paths[i])) == shard for read in reads for i in np.unique(read.file_index)):
            return k
        k += 1


def test_next_batches_are_requested_before_the_first_is_returned(data, server):
    """With every answer waiting LATENCY, the first next() returns once one answer came; by
    then the read-ahead has requested every batch fetched ahead: with the default prefetch the
    iterator fetches as many as the read-ahead budget holds (NOTE [remote depth]), here all 24.
    Without read-ahead only the two stage threads' batches (and at most the next of each) had
    been requested; with prefetch=0 torch's own depth (one batch) is kept."""

    def requests_by_first_batch(budget: int, prefetch: int = 2) -> int:
        with config.override(remote_read_ahead=budget):
            dataset = ArrayDataset(url(server, "x.npy"))  # opened (HEAD) before the latency
            server.control(latency=LATENCY)
            before = remote.counters()["requests"]
            loader = DataLoader(dataset, batch_size=64, device="cpu", prefetch=prefetch)
            try:
                next(iter(loader))
                return remote.counters()["requests"] - before  # one request a batch (8 KiB)
            finally:
                loader.close()
                server.control(latency=0)

    assert -(-ROWS // 64) == 24
    assert requests_by_first_batch(256 << 20) >= 12  # past prefetch + 1: deepened
    assert requests_by_first_batch(0) <= 4  # the control: read-ahead off, two stage threads
    assert requests_by_first_batch(256 << 20, prefetch=0) <= 2  # exactly torch's fetch depth


def test_shutdown_mid_read_ahead_cancels_requests_and_leaves_no_thread(data, server):
    dataset = ArrayDataset(url(server, "x.npy"))
    server.control(latency=LATENCY)
    loader = DataLoader(dataset, batch_size=64, device="cpu", prefetch=8)
    try:
        iterator = iter(loader)
        next(iterator)
        ahead = remote_reader(loader).ahead
        assert ahead.held > 0  # later batches' requests in flight or queued
        del iterator  # the iterator's shutdown cancels its entries
        assert ahead.held == 0
        assert any(name.startswith("fastload-remote") for name in remote_threads())
    finally:
        loader.close()
    assert_no_threads_left()


def test_closing_the_loader_with_the_iterator_alive_drains_read_ahead(data, server):
    dataset = ArrayDataset(url(server, "x.npy"))
    server.control(latency=LATENCY)
    loader = DataLoader(dataset, batch_size=64, device="cpu", prefetch=8)
    iterator = iter(loader)
    try:
        next(iterator)
        ahead = remote_reader(loader).ahead
        assert ahead.held > 0
    finally:
        loader.close()
    assert ahead.held == 0
    assert_no_threads_left()
    del iterator


@pytest.mark.cuda
def test_read_ahead_into_gpu_memory_equals_the_local_files(data, server):
    """Reads that go to the GPU: entries in pinned buffers, copied on the loader's stream."""

    def epoch(path: str) -> list:
        loader = DataLoader(ArrayDataset(path), batch_size=64, shuffle=True, device="cuda", generator=gen())
        try:
            return [batch.cpu() for batch in loader]
        finally:
            loader.close()

    def gen():
        return torch.Generator().manual_seed(9)

    theirs = epoch(str(data / "data" / "x.npy"))
    before = remote.counters().get("read_ahead", 0)
    ours = epoch(url(server, "x.npy"))
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert remote.counters().get("read_ahead", 0) - before == len(ours)
