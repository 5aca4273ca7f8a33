"""Remote sources over HTTP: a loopback object server (torch_fastload.remote.loopback, its own
process) serving local files by range, switched to fail with 503s, stall, ignore Range or serve
a replaced object. Every source's batches must equal the local files' byte for byte, failures
must be typed errors naming the URL (never a partial or mixed batch), and the loader must shut
down without leaving a thread."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from remote_helpers import assert_no_threads_left, batches, check_every_source, make_data, remote_threads, sources
from test_loader import assert_same

from torch_fastload import ArrayDataset, DataLoader, RecordDataset, config, remote
from torch_fastload import io as fio
from torch_fastload.engine import RangeError
from torch_fastload.remote import (
    ObjectChangedError,
    RangeNotSupportedError,
    RemoteNotFoundError,
    RemoteTimeoutError,
)
from torch_fastload.remote.cache import ShardCache
from torch_fastload.remote.epoch import CACHE_PATH_NOTE
from torch_fastload.remote.loopback import LoopbackServer
from torch_fastload.remote.reader import plan_requests
from torch_fastload.sources import RecordFormatError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """Fast retries, a fresh registry, the server well-behaved again, and no thread left after."""
    with config.override(remote_backoff=0.01, remote_timeout=5.0):
        yield
    server.control(fail=0, stall=0, ignore_range=False, reset=0, refuse_head=False, latency=0, bandwidth=0)
    remote.reset()
    assert_no_threads_left()


def local(data):
    return lambda name: str(data / "data" / name)


def url(server):
    return lambda name: server.url(f"data/{name}")


def test_every_source_reads_the_same_bytes_as_local_files(data, server):
    stats = check_every_source(local(data), url(server))
    for name, snapshot in stats.items():
        assert snapshot.io_bytes.get("remote-http", 0) > 0, (name, snapshot.io_bytes)
        assert "remote-http" in str(snapshot), name


def test_worker_processes_read_urls_per_sample(data, server):
    dataset = RecordDataset(url(server)("pack"))
    ours = list(torch.utils.data.DataLoader(dataset, batch_size=50, num_workers=2, collate_fn=dataset.collate))
    theirs = list(
        torch.utils.data.DataLoader(RecordDataset(local(data)("pack")), batch_size=50, collate_fn=dataset.collate)
    )
    assert all(torch.equal(a.data, b.data) and torch.equal(a.offsets, b.offsets) for a, b in zip(ours, theirs))


def test_a_capped_server_sends_exact_bytes_in_paced_chunks_longer_than_the_minimum(data, server, tmp_path):
    """Under a high cap the loopback server paces sends of PACE_SECONDS at the cap (not 256 KiB):
    a range across several of them, at an odd offset, still comes back byte for byte."""
    import urllib.request

    from torch_fastload.remote import loopback

    payload = np.random.default_rng(7).integers(0, 256, 9 * (1 << 20) + 123, dtype=np.uint8).tobytes()
    (data / "data" / "paced.bin").write_bytes(payload)
    server.control(bandwidth=8e9)
    assert int(8e9 * loopback.PACE_SECONDS) > 2 * loopback.CHUNK  # the sends are the longer ones
    start, end = 77, len(payload) - 5
    request = urllib.request.Request(server.url("data/paced.bin"), headers={"Range": f"bytes={start}-{end - 1}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 206
        assert answer.read() == payload[start:end]


def test_ranges_join_across_small_gaps_and_split_long_ones():
    requests = plan_requests(
        np.array([0, 0, 0, 1]),
        np.array([0, 10, 5 << 20, 0]),
        np.array([5, 5, 3 << 20, 7]),
        np.array([0, 5, 10, 99]),
        2 << 20,
    )
    assert requests[0] == (0, 0, 15, None, [(0, 0, 5), (10, 5, 5)])  # one request, the gap dropped
    assert [r[2] for r in requests[1:3]] == [2 << 20, 1 << 20]  # 3 MiB in 2 MiB requests
    assert requests[3] == (1, 0, 7, 99, None)
    # 64 KiB rows 200 KiB apart: merging would read more gap than rows (+ slack): two requests
    k = 1 << 10
    apart = plan_requests(*(np.array(v) for v in ([0, 0], [0, 264 * k], [64 * k, 64 * k], [0, 64 * k])), 16 << 20)
    assert [r[1:4] for r in apart] == [(0, 64 * k, 0), (264 * k, 64 * k, 64 * k)]


def test_repeated_and_unordered_rows_in_a_batch(data, server):
    sampler = [3, 3, 1499, 0, 3, 700, 701, 2]
    ours, _ = batches(ArrayDataset(url(server)("x.npy")), batch_size=4, sampler=sampler)
    x = np.load(local(data)("x.npy"))
    assert torch.equal(torch.cat(ours), torch.from_numpy(x[sampler]))


def test_503s_are_retried_and_counted(data, server):
    before = remote.counters().get("retries", 0)
    server.control(fail=3, fail_status=503)
    ours, _ = batches(ArrayDataset(url(server)("x.npy")), batch_size=500)
    assert torch.equal(torch.cat(ours), torch.from_numpy(np.load(local(data)("x.npy"))))
    assert remote.counters()["retries"] - before == 3
    assert server.stats()["failed"] == 3


def test_503s_past_the_retries_raise_with_the_attempts(server):
    dataset = ArrayDataset(url(server)("x.npy"))
    server.control(fail=1000)
    loader = DataLoader(dataset, batch_size=100, device="cpu")
    with config.override(remote_retries=2), pytest.raises(remote.RemoteReadError) as info:
        next(iter(loader))
    assert info.value.attempts == 3 and "3 attempts" in str(info.value) and "HTTP 503 (SlowDown)" in str(info.value)
    assert url(server)("x.npy") in str(info.value)
    loader.close()
    assert_no_threads_left()


def test_a_stalled_server_times_out_with_the_url_and_attempts(server):
    dataset = ArrayDataset(url(server)("y.npy"))
    server.control(stall=1000, stall_seconds=30)
    with config.override(remote_timeout=0.3, remote_retries=2):
        loader = DataLoader(dataset, batch_size=100, device="cpu")
        started = time.monotonic()
        with pytest.raises(RemoteTimeoutError) as info:
            next(iter(loader))
    assert time.monotonic() - started < 10
    assert info.value.attempts == 3 and url(server)("y.npy") in str(info.value)
    assert "no answer within 0.3 s (remote_timeout) on all 3 attempts" in str(info.value)
    loader.close()
    assert_no_threads_left()


def test_a_server_ignoring_range_is_detected(server):
    dataset = ArrayDataset(url(server)("x.npy"))
    server.control(ignore_range=True)
    loader = DataLoader(dataset, batch_size=10, device="cpu")
    with pytest.raises(RangeNotSupportedError, match="ignores Range") as info:
        next(iter(loader))
    assert url(server)("x.npy") in str(info.value)
    loader.close()


def test_missing_objects_are_typed_errors(data, server, tmp_path):
    with pytest.raises(RemoteNotFoundError, match="nope.npy") as info:
        ArrayDataset(url(server)("nope.npy"))
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(RecordFormatError, match="no-pack/meta.json: missing: not a finished pack"):
        RecordDataset(url(server)("no-pack"))
    # a shard deleted after the pack was opened: the batch that reads it fails, naming it
    shutil.copytree(data / "data" / "pack", data / "data" / "pack-copy")
    try:
        dataset = RecordDataset(url(server)("pack-copy"))
        os.unlink(data / "data" / "pack-copy" / "shard-00001.bin")
        loader = DataLoader(dataset, batch_size=len(dataset), device="cpu")
        with pytest.raises(RemoteNotFoundError, match="shard-00001.bin"):
            next(iter(loader))
        loader.close()
    finally:
        shutil.rmtree(data / "data" / "pack-copy")


def test_ranges_past_the_end_of_an_object_raise_before_reading(server):
    dataset = ArrayDataset(url(server)("x.npy"))
    read = dataset.__fastload_batch__([0])
    read.offsets[0] = 10**9
    with remote.RemoteReader() as reader, pytest.raises(RangeError, match="x.npy"):
        reader.read(
            torch.empty(132, dtype=torch.uint8),
            read.paths,
            read.file_index,
            read.offsets,
            read.lengths,
            np.zeros(1, np.int64),
        )


def test_an_object_replaced_mid_epoch_is_an_error_never_a_mixed_batch(data, server):
    shutil.copytree(data / "data" / "pack", data / "data" / "pack-live")
    try:
        dataset = RecordDataset(url(server)("pack-live"))
        old = [bytes(dataset[i][0].numpy()) for i in range(len(dataset))]
        # no read-ahead: the later batches are read after the change (test_remote_ahead.py
        # has a read-ahead batch meet a replaced object)
        with config.override(remote_read_ahead=0):
            loader = DataLoader(dataset, batch_size=20, shuffle=True, device="cpu", prefetch=1)
            delivered = 0
            with pytest.raises(ObjectChangedError, match="shard-") as info:
                for batch in loader:
                    indices = [old.index(bytes(r.numpy())) for r in batch.split()]  # every record: the old version
                    assert all(i >= 0 for i in indices)
                    delivered += 1
                    if delivered == 2:  # replace every shard with different bytes of the same size
                        for shard in sorted((data / "data" / "pack-live").glob("shard-*.bin")):
                            fresh = shard.with_suffix(".new")
                            fresh.write_bytes(bytes(255 - b for b in shard.read_bytes()))
                            os.replace(fresh, shard)
            assert delivered < len(dataset) // 20
            assert "re-open the dataset" in str(info.value)
            loader.close()
    finally:
        shutil.rmtree(data / "data" / "pack-live")


def test_the_reported_read_path_names_the_remote_reader(server):
    loader = DataLoader(ArrayDataset(url(server)("y.npy")), batch_size=700, device="cpu")
    assert "remote objects: remote-http" in str(loader.io)  # said before the first batch
    list(loader)
    reader = loader.resources.file_reader()
    assert reader.path.remote.startswith("remote-http (64 requests x 16 MiB")
    assert "remote objects: remote-http" in loader.stats().io
    assert "remote objects: remote-http" in str(reader.path)
    assert "remote objects: remote-http" in str(fio.select(remote=True))
    loader.close()


# ------------------------------------------------------------------------------------------
# the shard cache
# ------------------------------------------------------------------------------------------
def test_cache_hit_epoch_reads_local_copies(data, server, tmp_path):
    cache_dir = str(tmp_path / "cache")
    dataset = RecordDataset(url(server)("pack"), cache_dir=cache_dir)
    loader = DataLoader(dataset, batch_size=50, device="cpu")
    first = list(loader)
    assert loader.stats(reset=True).io_bytes.get("remote-http", 0) > 0
    deadline = time.monotonic() + 30  # the first epoch's misses were queued for background fills
    while len(ShardCache(cache_dir, 1 << 40).entries()) < len(dataset.shard_paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ShardCache(cache_dir, 1 << 40).entries()) == len(dataset.shard_paths)
    before = server.stats()
    second = list(loader)
    stats = loader.stats()
    loader.close()
    after = server.stats()
    assert after["bytes"] == before["bytes"]  # no body read from the server
    assert after["requests"] == before["requests"] + len(dataset.shard_paths)  # one HEAD per object
    assert stats.path == "native loop -> cpu (remote objects from the shard cache)"
    assert set(stats.io_bytes) <= {"engine-posix", "mapped"}
    assert sum(stats.io_bytes.values()) == int(dataset.index[:, 2].sum())
    for a, b in zip(first, second):
        assert torch.equal(a.data, b.data)
    # the sample path reads the cache too, and every source does through the loader
    assert bytes(dataset[5][0].numpy()) == bytes(RecordDataset(local(data)("pack"))[5][0].numpy())
    check_every_source(local(data), url(server), cache_dir=cache_dir)


def test_cache_hit_epoch_gives_the_local_files_batches_on_the_local_path(data, server, tmp_path):
    cache_dir = str(tmp_path / "cache")
    remote.cache_objects([url(server)("x.npy"), url(server)("y.npy")], cache_dir)
    cached = ArrayDataset(url(server)("x.npy"), url(server)("y.npy"), cache_dir=cache_dir)
    ours, stats = batches(cached, batch_size=64, shuffle=True)
    theirs, local_stats = batches(ArrayDataset(local(data)("x.npy"), local(data)("y.npy")), batch_size=64, shuffle=True)
    assert_same(ours, theirs, "cached arrays")
    assert stats.path == "native loop -> cpu (remote objects from the shard cache)"
    assert local_stats.path == "native loop -> cpu"
    assert stats.io.startswith(local_stats.io.split(";")[0])  # the local file's read path...
    assert stats.io.endswith(f"remote objects: {CACHE_PATH_NOTE}")  # ...with what it reads
    loader = DataLoader(cached, batch_size=64)
    assert f"shard cache {cache_dir}: {CACHE_PATH_NOTE}" in str(loader.io)  # said before the first batch
    loader.close()
    assert set(stats.io_bytes) == set(local_stats.io_bytes) and sum(stats.io_bytes.values()) == sum(
        local_stats.io_bytes.values()
    )


def test_an_object_replaced_between_cached_epochs_is_refused_at_the_next_epochs_start(data, server, tmp_path):
    """Cached epochs check each object once, at the epoch's start: a replacement during an
    epoch leaves that epoch on the version it started with, and the next one raises."""
    shutil.copytree(data / "data" / "pack", data / "data" / "pack-cached")
    try:
        cache_dir = str(tmp_path / "cache")
        dataset = RecordDataset(url(server)("pack-cached"), cache_dir=cache_dir)
        remote.cache_objects(dataset.shard_paths, cache_dir)
        old = [bytes(dataset[i][0].numpy()) for i in range(len(dataset))]
        loader = DataLoader(dataset, batch_size=20, shuffle=True, device="cpu", prefetch=1)
        delivered = 0
        for batch in loader:
            assert all(bytes(r.numpy()) in old for r in batch.split())  # every record: the opened version
            delivered += 1
            if delivered == 2:  # replace every shard with different bytes of the same size
                for shard in sorted((data / "data" / "pack-cached").glob("shard-*.bin")):
                    fresh = shard.with_suffix(".new")
                    fresh.write_bytes(bytes(255 - b for b in shard.read_bytes()))
                    os.replace(fresh, shard)
        assert delivered == -(-len(dataset) // 20)
        assert loader.stats().path.endswith("(remote objects from the shard cache)")
        with pytest.raises(ObjectChangedError, match="shard-") as info:
            next(iter(loader))  # the epoch's first batch waits for the check of its objects
        assert "re-open the dataset" in str(info.value) and "no batch of its cached copy is delivered" in str(
            info.value
        )
        loader.close()
    finally:
        shutil.rmtree(data / "data" / "pack-cached")


def test_cache_evicts_least_recently_used_and_skips_objects_over_the_limit(server, tmp_path):
    names = ["pack/shard-00000.bin", "pack/shard-00001.bin", "pack/shard-00002.bin"]
    size = remote.open_object(url(server)(names[0])).size
    limit = int(size * 2.5)
    a, b, c = (remote.open_object(url(server)(n), str(tmp_path), limit) for n in names)
    cache = a.cache()
    with remote.RemoteReader() as reader:
        reader.fill(a)
        time.sleep(0.01)
        reader.fill(b)
        time.sleep(0.01)
        assert cache.lookup(a) is not None  # a is now the most recently used
        time.sleep(0.01)
        reader.fill(c)
    assert cache.lookup(b) is None and cache.lookup(a) and cache.lookup(c)
    assert sum(s for _, s, _ in cache.entries()) <= limit
    small = remote.open_object(url(server)("x.npy"), str(tmp_path / "small"), 1000)
    assert remote.cache_objects([url(server)("x.npy")], str(tmp_path / "small"), 1000) == [None]
    assert small.cache().entries() == []


def test_a_killed_fill_never_leaves_an_entry_that_reads_as_valid(data, server, tmp_path):
    cache_dir = tmp_path / "cache"
    target = url(server)("features.npy")
    server.control(bandwidth=2e6)  # 1.5 MB at 2 MB/s: killed mid-way
    code = (
        "import sys; from torch_fastload import remote; "
        f"remote.cache_objects([{target!r}], {str(cache_dir)!r}); print('done')"
    )
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": REPO})
    deadline = time.monotonic() + 30
    while not list(cache_dir.glob(".partial-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    server.control(bandwidth=0)
    assert [p.name for p in cache_dir.iterdir() if not p.name.startswith(".")] == []  # no entry
    partials = list(cache_dir.glob(".partial-*"))
    assert len(partials) == 1 and 0 < partials[0].stat().st_size  # the sparse temp file, never renamed
    obj = remote.open_object(target, str(cache_dir))
    assert obj.cache().entries() == [] and obj.cache().lookup(obj) is None
    assert ShardCache(str(cache_dir), 1 << 30).entries() == [] and not list(cache_dir.glob(".partial-*"))
    entry = remote.cache_objects([target], str(cache_dir))[0]
    with open(entry, "rb") as f, open(data / "data" / "features.npy", "rb") as g:
        assert f.read() == g.read()


# ------------------------------------------------------------------------------------------
# settings, doctor, secrets in URLs
# ------------------------------------------------------------------------------------------
def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCH_FASTLOAD_REMOTE_CONCURRENCY", "7")
    monkeypatch.setenv("TORCH_FASTLOAD_REMOTE_REQUEST_SIZE", "2MiB")
    monkeypatch.setenv("TORCH_FASTLOAD_REMOTE_READ_AHEAD", "96MiB")
    with remote.RemoteReader() as reader:
        assert (reader.concurrency, reader.request_size, reader.ahead.budget) == (7, 2 << 20, 96 << 20)
    monkeypatch.setenv("TORCH_FASTLOAD_REMOTE_CONCURRENCY", "0")
    with pytest.raises(ValueError, match="TORCH_FASTLOAD_REMOTE_CONCURRENCY"):
        remote.RemoteReader()
    from torch_fastload.remote.kvikio_backend import unavailable_reason

    if unavailable_reason():  # this CPU machine: kvikio asked for, refused with the reason
        with pytest.raises(ValueError, match="remote_backend='kvikio' cannot run here"):
            remote.RemoteReader(concurrency=1, backend="kvikio")


def test_doctor_url_sweep_recommends_a_cell(server, tmp_path, capsys):
    from torch_fastload.remote import sweep

    result = sweep.sweep(url(server)("features.npy"), [1, 4], [64 << 10, 1 << 20], span=1 << 20, min_seconds=0.02)
    rec = result["recommended"]
    assert (rec["concurrency"], rec["request_size"]) in {(c, s) for c in (1, 4) for s in (64 << 10, 1 << 20)}
    assert all(v > 0 for row in result["gbps"] for v in row)
    assert "recommended: remote_concurrency=" in sweep.render(result)
    from torch_fastload import doctor

    assert doctor.main(["--url", url(server)("nope.bin"), "--quick"]) == 1
    assert "remote sweep: failed: RemoteNotFoundError" in capsys.readouterr().out


def test_a_url_that_refuses_head_is_sized_by_its_first_byte(data, server):
    """A presigned GET URL cannot be HEADed: the size and version come from a 1-byte range."""
    server.control(refuse_head=True)
    for ignore_range in (False, True):  # the probe's answer: 206, or the whole object (200)
        server.control(ignore_range=ignore_range)
        obj = remote.open_object(url(server)("y.npy"))
        assert obj.size == os.path.getsize(data / "data" / "y.npy") and obj.version
    server.control(ignore_range=False)
    ours, _ = batches(ArrayDataset(url(server)("y.npy")), batch_size=500)
    assert torch.equal(torch.cat(ours), torch.from_numpy(np.load(local(data)("y.npy"))))
    with config.override(s3_endpoint_url=server.endpoint), pytest.raises(remote.RemoteAccessError):
        remote.open_object("s3://data/y.npy")  # s3:// signs its HEAD: a refusal stays one


def test_query_strings_never_reach_a_message(server):
    secret = "X-Amz-Signature=0123456789abcdef&X-Amz-Credential=AKIASECRET"
    with pytest.raises(RemoteNotFoundError) as info:
        ArrayDataset(url(server)("nope.npy") + "?" + secret)
    assert "0123456789abcdef" not in str(info.value) and "AKIASECRET" not in str(info.value)
    assert "?<query hidden>" in str(info.value)


@pytest.mark.cuda
def test_urls_read_into_gpu_memory(data, server):
    for name, make in sources(url(server)).items():
        if name == "images":
            continue
        loader = DataLoader(make(), batch_size=64, device="cuda")
        theirs = DataLoader(sources(local(data))[name](), batch_size=64, device="cuda")
        assert_same(list(loader), list(theirs), name)
        loader.close()
        theirs.close()


@pytest.mark.cuda
def test_cache_hit_epochs_on_the_gpu_take_the_local_files_path(data, server, tmp_path):
    cache_dir = str(tmp_path / "cache")
    names = ("x.npy", "y.npy")
    remote.cache_objects([url(server)(n) for n in names], cache_dir)
    runs = {}
    for kind, dataset in (
        ("cache", ArrayDataset(*(url(server)(n) for n in names), cache_dir=cache_dir)),
        ("local", ArrayDataset(*(local(data)(n) for n in names))),
    ):
        loader = DataLoader(
            dataset, batch_size=64, shuffle=True, device="cuda", generator=torch.Generator().manual_seed(3)
        )
        list(loader)  # the first epoch maps the page-cache-resident files
        loader.stats(reset=True)
        runs[kind] = ([[t.cpu() for t in b] for b in loader], loader.stats())
        loader.close()
    (ours, stats), (theirs, local_stats) = runs["cache"], runs["local"]
    assert_same(ours, theirs, "cached arrays on cuda")
    assert stats.path == f"{local_stats.path} (remote objects from the shard cache)"
    assert set(stats.io_bytes) == set(local_stats.io_bytes)


def test_no_thread_outlives_a_closed_loader(server):
    loader = DataLoader(ArrayDataset(url(server)("x.npy")), batch_size=64, device="cpu")
    next(iter(loader))
    assert any(name.startswith("fastload-remote") for name in remote_threads())
    loader.close()
    assert_no_threads_left()
