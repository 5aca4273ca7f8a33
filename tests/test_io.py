"""Read backends: which io_mode runs where (reported, never silent), coalescing, and on the GPU
machine every backend (engine, kvikio into pinned slots, kvikio/GDS into device memory) giving
torch's batches, with typed errors for files damaged between planning and reading."""

import os
import threading
import traceback
import warnings

import numpy as np
import pytest
import torch
from test_loader import assert_same

import torch_fastload
from torch_fastload import DataLoader, RecordDataset, engine, io, pack
from torch_fastload._benchutil import drop_page_cache
from torch_fastload.errors import FileChangedError
from torch_fastload.sources import ArrayDataset, ArrayFile


@pytest.fixture
def no_kvikio(monkeypatch):
    monkeypatch.setattr(io, "_kvikio", lambda: None)
    io.gds_status.cache_clear()
    yield
    io.gds_status.cache_clear()


def test_posix_and_auto_on_the_cpu():
    path = io.select("posix", "cpu")
    assert (path.mode, path.to_device, path.threads, path.task_size) == ("engine-posix", False, 16, 4 << 20)
    assert io.select("posix", "cpu", o_direct=True).mode == "engine-odirect"
    auto = io.select("auto", "cpu", threads=3, task_size=1 << 20)
    assert auto.mode == "engine-posix" and "device is cpu" in auto.why and auto.threads == 3
    assert "engine-posix -> pinned slot (3 threads x 1 MiB tasks; io_mode=auto" in str(auto)


def test_explicit_modes_that_cannot_run_say_why(no_kvikio):
    with pytest.raises(ValueError, match="reads into GPU memory, but the loader's device is cpu"):
        io.select("gds", "cpu")
    with pytest.raises(ValueError, match="o_direct=True applies to the C\\+\\+ engine"):
        io.select("gds", "cpu", o_direct=True)
    pinned = io.select("pinned", "cpu")
    assert pinned.mode == "engine-posix" and "kvikio is not installed" in pinned.why
    assert "pip install kvikio" in str(io.gds_status())
    with pytest.raises(ValueError, match="must be one of"):
        io.select("nvme", "cpu")


def test_without_the_engine(monkeypatch):
    monkeypatch.setattr(engine, "available", lambda: False)
    path = io.select("auto", "cpu")
    assert path.mode == "python-posix" and "not built" in path.why
    with pytest.raises(ValueError, match="o_direct=True needs the C\\+\\+ engine"):
        io.select("posix", "cpu", o_direct=True)


def test_io_mode_from_the_environment_and_loader_arguments(tmp_path, monkeypatch):
    np.save(tmp_path / "x.npy", np.arange(40, dtype=np.float32).reshape(10, 4))
    monkeypatch.setenv("TORCH_FASTLOAD_O_DIRECT", "1")
    monkeypatch.setenv("TORCH_FASTLOAD_NUM_THREADS", "3")
    loader = DataLoader(ArrayDataset(tmp_path / "x.npy"), batch_size=5, device="cpu")
    assert loader.io.mode == "engine-odirect" and loader.io.threads == 3
    assert loader.stats().io == ""  # nothing read yet
    assert torch.equal(torch.cat(list(loader)), torch.arange(40, dtype=torch.float32).reshape(10, 4))
    stats = loader.stats()
    assert stats.io.startswith("engine-odirect") and "file reads: engine-odirect" in str(stats)
    assert stats.stage_bytes["read"] == 160 and stats.stage_s["read"] > 0
    override = DataLoader(
        ArrayDataset(tmp_path / "x.npy"), batch_size=5, device="cpu", o_direct=False, io_task_size="64KiB"
    )
    assert override.io.mode == "engine-posix" and override.io.task_size == 65536
    with pytest.raises(ValueError, match="'io_threads' must be an integer in \\[1, 256\\], got 0"):
        DataLoader(ArrayDataset(tmp_path / "x.npy"), io_threads=0)


def test_coalesce_matches_the_engine_plan(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 16))
    rng = np.random.default_rng(0)
    offsets = np.sort(rng.choice(np.arange(0, 60000, 100), 40, replace=False))
    offsets[5:15] = offsets[5] + 100 * np.arange(10)  # a run of neighbours
    lengths = np.full(40, 100, np.int64)
    dst = np.zeros(40, np.int64)
    dst[1:] = np.cumsum(lengths)[:-1]
    dst[20:] += 7  # a hole in the destination breaks the run there
    merged = io.coalesce(np.zeros(40, np.int64), offsets.astype(np.int64), lengths, dst)
    plan = engine.plan_ranges(str(path), None, offsets, lengths, 5000, dst, task_size=1 << 30)
    assert [tuple(int(v) for v in r) for r in zip(*merged)] == [tuple(r) for r in plan[0]]


# ------------------------------------------------------------------------------------------
# every backend on the GPU machine
# ------------------------------------------------------------------------------------------


def expected_mode(io_mode):
    gds = io.gds_status().available
    return {
        "auto": "gds" if gds else "engine-posix",
        "posix": "engine-posix",
        "pinned": "kvikio-compat",
        "gds": "gds" if gds else "kvikio-compat",
    }[io_mode]


def make_sources(tmp_path):
    rng = np.random.default_rng(1)
    features = rng.standard_normal((500, 3, 37)).astype(np.float32)  # 444-byte rows: nothing aligned
    labels = rng.integers(0, 10, 500)
    np.save(tmp_path / "x.npy", features)
    np.save(tmp_path / "y.npy", labels)
    records = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(0, 20000, 300)]
    pack(zip(records, rng.integers(0, 5, 300).tolist()), tmp_path / "pack", shard_size=1 << 20, progress=False)
    return ArrayDataset(tmp_path / "x.npy", tmp_path / "y.npy"), RecordDataset(tmp_path / "pack")


@pytest.mark.cuda
@pytest.mark.parametrize("io_mode", ["auto", "posix", "pinned", "gds"])
def test_every_backend_gives_torchs_batches_on_the_gpu(tmp_path, io_mode):
    arrays, records = make_sources(tmp_path)
    for dataset, extra in ((arrays, {}), (records, {"collate_fn": records.collate})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(
                dataset,
                batch_size=32,
                shuffle=True,
                io_mode=io_mode,
                io_threads=4,
                io_task_size=1 << 16,
                generator=torch.Generator().manual_seed(2),
            )
            ours = list(loader)
        theirs = list(
            torch.utils.data.DataLoader(
                dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(2), **extra
            )
        )
        assert loader.io.mode == expected_mode(io_mode)
        assert loader.io.to_device == (io_mode != "pinned")  # the engine streams through its ring
        assert (loader.io.ring_chunks > 0) == loader.io.mode.startswith("engine")
        if io_mode == "gds" and not io.gds_status().available:
            assert any("compat mode" in str(w.message) for w in caught)
        leaf = ours[0][0] if dataset is arrays else ours[0].data
        assert leaf.is_cuda
        assert_same(ours, theirs)
        stats = loader.stats()
        assert stats.io.startswith(loader.io.mode) and stats.stage_bytes["read"] > 0
        loader.close()


@pytest.mark.cuda
@pytest.mark.parametrize("io_mode", ["posix", "pinned", "gds"])
def test_file_truncated_before_the_read_is_a_typed_error_on_every_backend(tmp_path, io_mode):
    arrays, records = make_sources(tmp_path)
    os.truncate(tmp_path / "x.npy", 128 + 100 * 444 + 10)  # rows 100.. are gone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        it = iter(DataLoader(arrays, batch_size=50, io_mode=io_mode))
    with pytest.raises(FileChangedError) as info:  # no longer the file opened: none of its batches
        next(it)
    text = "".join(traceback.format_exception(info.value))
    assert "x.npy" in text and "changed size" in text and "batch 0" in text
    it.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_o_direct_file_cut_at_a_page_boundary(tmp_path, device):
    from test_engine import o_direct_reason

    if reason := o_direct_reason(tmp_path):
        pytest.skip(reason)
    rows = np.random.default_rng(3).integers(0, 2**31, (64, 1024), dtype=np.int32)  # 4 KiB rows
    rows.tofile(tmp_path / "r.bin")
    dataset = ArrayDataset(ArrayFile.raw(tmp_path / "r.bin", np.int32, (1024,)))
    loader = DataLoader(dataset, batch_size=16, o_direct=True, device=device)
    assert loader.io.mode == "engine-odirect"
    os.truncate(tmp_path / "r.bin", 40 * 4096)  # after planning: a clean page boundary inside batch 2
    it = iter(loader)
    with pytest.raises(FileChangedError, match="r.bin.*changed size from 262144 to 163840"):
        next(it)  # the file is no longer the one planned: none of its batches
    it.close()


def _read_pages(stager, path, offsets, dst, stream, **options) -> int:
    """4 KiB ranges of `path` at `offsets` to the same offsets of `dst`, 64 KiB tasks, 4 threads."""
    lengths = np.full(len(offsets), 4096)
    return stager.read(
        str(path),
        None,
        offsets,
        lengths,
        dst,
        offsets,
        stream=stream.cuda_stream,
        num_threads=4,
        task_size=64 << 10,
        **options,
    )


def _ring_read(tmp_path, wait_for_chunks: bool, group_chunks: int | None = None) -> bool:
    """Read 4 MiB in 64 KiB tasks through a 2-chunk ring while the copy stream is held back by
    a sleeping kernel, so every chunk is reused while its copies wait; True if bytes match."""
    data = np.random.default_rng(4).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "ring.bin"
    data.tofile(path)
    stager = engine.DeviceStager(64 << 10, 2, group_chunks=group_chunks)
    stream = torch.cuda.Stream()
    dst = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    offsets = np.arange(0, len(data), 4096)[::-1].copy()  # nothing coalesces: 64 tasks
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~25 ms: the first copies wait behind this
        _read_pages(stager, path, offsets, dst, stream, wait_for_chunks=wait_for_chunks)
    assert stager.free_chunks == 2, "a chunk read was never handed back to the ring"
    stream.synchronize()
    assert stager.close()
    return bool(torch.equal(dst.cpu(), torch.from_numpy(data)))


# 1: a group a chunk; 2: the whole ring; 8: more than the ring holds, so a task finding no free
# chunk submits its own read's chunks (without that the read would wait forever).
@pytest.mark.cuda
@pytest.mark.parametrize("group_chunks", [1, 2, 8])
def test_ring_chunks_wait_for_their_copies(tmp_path, group_chunks):
    assert _ring_read(tmp_path, wait_for_chunks=True, group_chunks=group_chunks)


@pytest.mark.cuda
def test_negative_control_ring_reused_without_waiting_corrupts(tmp_path):
    assert not _ring_read(tmp_path, wait_for_chunks=False), "the race window did not open: the wait test proves nothing"


@pytest.mark.cuda
def test_a_ring_read_failing_midway_frees_every_chunk_and_the_ring_reads_on(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "cut.bin"
    data.tofile(path)
    stager = engine.DeviceStager(64 << 10, 2, group_chunks=8)
    stream = torch.cuda.Stream()
    dst = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    offsets = np.arange(0, len(data), 4096)
    # The file is cut to 1 MiB while the read's later tasks wait for chunks behind a sleeping
    # kernel (~25 ms): its first MiB is read, the rest ends early.
    cutter = threading.Timer(0.005, os.truncate, (path, 1 << 20))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        cutter.start()
        with pytest.raises(EOFError, match="cut.bin"):
            _read_pages(stager, path, offsets, dst, stream)
    cutter.join()
    assert stager.free_chunks == 2, "chunks of the failed read were lost to the ring"
    again = tmp_path / "again.bin"
    data.tofile(again)
    _read_pages(stager, again, offsets, dst, stream)
    stream.synchronize()
    assert torch.equal(dst.cpu(), torch.from_numpy(data))
    assert stager.close()


@pytest.mark.cuda
def test_ring_under_delayed_copies_in_the_loader(tmp_path):
    arrays, records = make_sources(tmp_path)
    with torch_fastload.config.override(map_budget=0):  # every byte through the ring
        loader = DataLoader(
            records,
            batch_size=40,
            shuffle=True,
            io_threads=8,
            io_task_size=16 << 10,
            generator=torch.Generator().manual_seed(9),
        )
    loader.resources.engine.debug_delay_cycles = 20_000_000  # copies queue up behind sleeps
    ours = [torch_fastload.RecordBatch(*(t.cpu() if t is not None else None for t in b)) for b in loader]
    theirs = list(
        torch.utils.data.DataLoader(
            records, batch_size=40, shuffle=True, collate_fn=records.collate, generator=torch.Generator().manual_seed(9)
        )
    )
    assert loader.io.ring_chunks == 10 and loader.io.map_budget == 0
    assert_same(ours, theirs)
    assert set(loader.stats().io_bytes) == {"engine-posix"}
    loader.close()


@pytest.mark.cuda
def test_gather_kernel_copies_unaligned_ragged_ranges_from_a_mapping(tmp_path):
    from torch_fastload import uva

    assert uva.available(), "torch.cuda._compile_kernel is expected on the GPU machine"
    rng = np.random.default_rng(6)
    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "u.bin"
    data.tofile(path)
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # a current context for the registration
    mapped = engine._require().MappedFile(str(path))
    lengths = rng.integers(0, 200_000, 300)
    lengths[:3] = [0, 1, 17]
    offsets = rng.integers(0, len(data) - lengths)
    dst_offsets = np.zeros(300, np.int64)
    dst_offsets[1:] = np.cumsum(lengths + rng.integers(0, 20, 300))[:-1]  # gaps stay untouched
    dst = torch.full((int(dst_offsets[-1] + lengths[-1]) + 64,), 0xA5, dtype=torch.uint8, device=device)
    stager = engine.DeviceStager(4096, 2)  # 4 KiB chunks: 170 ranges a launch, so two launches
    stream = torch.cuda.current_stream()
    moved = stager.gather_mapped(
        [mapped],
        np.zeros(300, np.int64),
        offsets,
        lengths,
        dst,
        dst_offsets,
        stream=stream.cuda_stream,
        function=uva.kernel_handle(device),
        piece_bytes=uva.PIECE,
        blocks=7,
    )
    assert moved == lengths.sum()
    expected = np.full(dst.numel(), 0xA5, np.uint8)
    for o, n, d in zip(offsets, lengths, dst_offsets):
        expected[d : d + n] = data[o : o + n]
    assert np.array_equal(dst.cpu().numpy(), expected)
    with pytest.raises(engine.RangeError, match="u.bin"):
        stager.gather_mapped(
            [mapped],
            [0],
            [len(data) - 5],
            [10],
            dst,
            [0],
            stream=stream.cuda_stream,
            function=uva.kernel_handle(device),
            piece_bytes=uva.PIECE,
            blocks=7,
        )
    assert stager.close()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "budget,kernel", [("25%", True), ("25%", False), (0, True)], ids=["mapped-kernel", "mapped-dma", "ring"]
)
def test_resident_files_are_dma_copied_from_the_page_cache(tmp_path, budget, kernel, monkeypatch):
    from torch_fastload import uva

    if not kernel:
        monkeypatch.setattr(uva, "available", lambda: False)
    arrays, records = make_sources(tmp_path)
    with torch_fastload.config.override(map_budget=budget):
        for dataset in (arrays, records):
            for path in dataset.shard_paths if dataset is records else [f.path for f in dataset.files]:
                open(path, "rb").read()  # resident
            loader = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
            ours = list(loader)
            theirs = list(
                torch.utils.data.DataLoader(
                    dataset,
                    batch_size=32,
                    shuffle=True,
                    collate_fn=getattr(dataset, "collate", None),
                    generator=torch.Generator().manual_seed(1),
                )
            )
            assert_same(ours, theirs)
            moved = loader.stats().io_bytes
            assert set(moved) == ({"mapped"} if budget else {"engine-posix"}), moved
            assert "DMA'd directly" in str(loader.io) if budget else "DMA" not in str(loader.io)
            loader.close()


@pytest.mark.cuda
def test_cold_files_are_not_mapped_and_truncation_after_mapping_is_an_error(tmp_path):
    arrays, _ = make_sources(tmp_path)
    features, labels = (f.path for f in arrays.files)
    drop_page_cache(features)
    open(labels, "rb").read()
    assert engine.page_cache_residency(features) < 0.5
    loader = DataLoader(arrays, batch_size=50)
    it = iter(loader)
    next(it)
    it.close()
    moved = loader.stats().io_bytes
    assert moved["engine-posix"] >= 50 * 444 and moved["mapped"] >= 50 * 8  # features read, labels mapped
    open(features, "rb").read()
    loader.resources.file_reader().mapped.recheck_s = 0  # look again at once: now resident, so mapped
    it = iter(loader)
    next(it)
    it.close()
    assert loader.resources.file_reader().mapped.pinned_bytes == os.path.getsize(features) + os.path.getsize(labels)
    os.truncate(features, 128 + 100 * 444)
    it = iter(loader)
    with pytest.raises(FileChangedError, match="x.npy"):  # even the rows still there: it changed
        next(it)
    it.close()
    loader.close()


@pytest.mark.cuda
def test_gds_status_is_reported():
    status = io.gds_status()
    text = str(status)
    if status.kvikio_version is None:
        pytest.fail(f"kvikio is expected on the GPU machine: {text}")
    assert status.available or status.reasons, text
    print(text)


def test_package_exports_the_sources():
    assert torch_fastload.ArrayDataset is ArrayDataset and torch_fastload.RecordDataset is RecordDataset
