"""The Parquet decode arena (torch_fastload._arrow, csrc/arrow/): row groups decoded by pyarrow's
C++ into pinned memory of ours, equal to pyarrow's own decode for every type, compression and
writer option; errors typed as before; fields lying in the arena go to the GPU from where they
lie and stay alive until their copy ran (negative control: without the hold, the arena is
reused under a pending copy and batches come out wrong)."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_parquet import every_type, expected, write

from torch_fastload import DataLoader, config, stager, transfer
from torch_fastload.errors import ParquetDecodeError
from torch_fastload.pool import PinnedPool
from torch_fastload.sources import ParquetDataset, ParquetSampler, parquet_arena
from torch_fastload.staging import ParallelCopier, add_direct_region, remove_direct_region

ARENA_BYTES = 256 << 20  # the tests' process arena (the first make_arena call sizes it)

needs_arena = pytest.mark.skipif(
    parquet_arena.unavailable_reason() is not None,
    reason=f"torch_fastload._arrow is not built: {parquet_arena.unavailable_reason()}",
)


def _arena():
    from torch_fastload import _arrow

    base, size = _arrow.make_arena(ARENA_BYTES)
    return _arrow, base, size


@needs_arena
@pytest.mark.parametrize(
    "options",
    [
        dict(compression="snappy"),
        dict(compression="zstd"),
        dict(compression="gzip"),
        dict(compression="none"),
        dict(compression="snappy", data_page_version="2.0", use_dictionary=False, write_statistics=False),
    ],
    ids=["snappy", "zstd", "gzip", "none", "v2-plain-nostats"],
)
def test_arena_decodes_every_type_as_pyarrow_does_into_the_arena(tmp_path, options):
    _arrow, base, size = _arena()
    table = every_type(3000)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=1000, **options)
    reference = pq.ParquetFile(path)
    columns = list(range(reference.metadata.num_columns))
    for group in range(reference.num_row_groups):
        ours = _arrow.read_row_group(str(path), group, columns, True)
        assert ours.equals(reference.read_row_group(group)), (options, group)
        large = [
            buf
            for column in ours.columns
            for chunk in column.chunks
            for buf in chunk.buffers()
            if buf is not None and buf.size >= 4096
        ]
        assert large and all(base <= buf.address < base + size for buf in large)


@needs_arena
def test_arena_errors_are_python_errors_with_arrows_message(tmp_path):
    _arrow, _, _ = _arena()
    path = write(every_type(500), tmp_path / "t.parquet", row_group_size=100)
    with pytest.raises(OSError, match="nope.parquet"):
        _arrow.read_row_group(str(tmp_path / "nope.parquet"), 0, [0], True)
    with pytest.raises(ValueError, match="row_group"):
        _arrow.read_row_group(str(path), 99, [0], True)
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_bytes(b"PAR1" + b"\0" * 100)
    with pytest.raises((OSError, ValueError)):
        _arrow.read_row_group(str(not_parquet), 0, [0], True)


@needs_arena
def test_allocations_the_arena_cannot_hold_fall_back_and_decode_the_same(tmp_path):
    """A column bigger than the arena's largest class decodes into Arrow's default pool. The
    arena is the process's, made by the first test that asked (2 GiB where a CUDA test's
    dataset made it first): sixteen large_binary values of a sixteenth of it each, one row
    group, so the bytes exceed any arena size (an int64 column cannot: a row group is at most
    64 Mi rows), one value a page."""
    _arrow, base, size = _arena()
    width = size // 16 + 4096
    values = pa.array([np.full(width, k, dtype=np.uint8).tobytes() for k in range(16)], pa.large_binary())
    path = tmp_path / "big.parquet"
    # one value a page: a page of them all would pass pyarrow's 2 GiB page limit on a large arena
    pq.write_table(
        pa.table({"v": values}),
        path,
        compression="none",
        use_dictionary=False,
        write_batch_size=1,
        data_page_size=1 << 20,
    )
    del values
    before = _arrow.arena_stats()["fallback_allocations"]
    ours = _arrow.read_row_group(str(path), 0, [0], True)
    assert _arrow.arena_stats()["fallback_allocations"] > before
    column = ours.column(0).chunk(0)
    _, offsets, data = column.buffers()
    starts = np.frombuffer(offsets, dtype=np.int64)[column.offset : column.offset + 17]
    assert np.array_equal(np.diff(starts), np.full(16, width))
    raw = np.frombuffer(data, dtype=np.uint8)
    assert all((raw[starts[k] : starts[k + 1]] == k).all() for k in range(16))
    assert not (base <= data.address < base + size)


@needs_arena
def test_dataset_batches_decoded_in_the_arena_equal_pyarrows_and_errors_stay_typed(tmp_path):
    """The dataset's decode through the arena (set by hand: no GPU here) gives the batches the
    pyarrow route gives; a corrupt page still raises ParquetDecodeError naming row group and
    column, from the arena's decode as from pyarrow's."""
    _arrow, _, _ = _arena()
    table = every_type(1000)
    path = Path(write(table, tmp_path / "t.parquet", row_group_size=96))
    dataset = ParquetDataset(path, threads=2)
    dataset._reader().arena_decode = _arrow.read_row_group
    reference = pq.read_table(path)
    for start in (0, 90, 500):
        rows = reference.slice(start, 150)
        batch = dataset.batch(np.arange(start, start + 150))
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                assert torch.equal(batch[key], want), (start, key)
    dataset.close()

    # corrupt the page header of column "i64" in row group 2 (its bytes, not the footer)
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(2)
    data = bytearray(path.read_bytes())
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
    dataset = ParquetDataset(path, threads=2)
    dataset._reader().arena_decode = _arrow.read_row_group
    with pytest.raises(ParquetDecodeError) as info:
        dataset.batch(np.arange(2 * 96, 3 * 96))
    assert info.value.row_group == 2 and info.value.column == "i64" and str(path) in str(info.value)
    dataset.close()


def test_fields_in_a_direct_region_are_planned_out_of_the_slot():
    copier = ParallelCopier(2)
    if not copier.native:
        pytest.skip("the C++ engine is not built: no one-call stage to take direct fields")
    inside = torch.arange(4096, dtype=torch.int64)
    outside = torch.arange(1000, dtype=torch.int32)
    slot = torch.empty(1 << 16, dtype=torch.uint8)
    items = [(0, inside), (32768, outside)]
    add_direct_region(inside.data_ptr(), inside.numel() * 8)
    try:
        plan = copier.plan_copy(slot, items, direct=True)
        assert [src for _, src, _ in plan.direct] == [inside]
        assert plan.total == 4000 and [src for _, src, _ in plan.contiguous] == [outside]
        dst, src, sizes = plan.native[2]
        assert dst.tolist() == [0] and src.tolist() == [inside.data_ptr()] and sizes.tolist() == [32768]
        plain = copier.plan_copy(slot, items)  # the default: every field into the slot
        assert not plain.direct and plain.native[2] is None and plain.total == 32768 + 4000
    finally:
        remove_direct_region(inside.data_ptr(), inside.numel() * 8)


class _Pending:
    """A CUDA event's stand-in: complete once ``done`` is set."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_a_slot_holds_what_its_copy_reads_until_the_copy_completed():
    pool = PinnedPool(1, 4096, pin=False)
    slot = pool.acquire()
    source = torch.arange(16)
    ref = weakref.ref(source)
    event = _Pending()
    pool.release(slot, event, keep=[source])
    del source
    gc.collect()
    assert ref() is not None  # the copy may still read it
    event.done = True
    again = pool.acquire(timeout=5)
    gc.collect()
    assert again is slot and ref() is None  # released once the copy completed
    pool.release(again)
    pool.close()


# -- on the GPU -------------------------------------------------------------------------------
def _recording_stage(monkeypatch) -> list:
    """Wraps the one-call stages (of a slot's plan, and of a planned batch of consecutive rows)
    to record the bytes each batch copied from where they lie."""
    direct_bytes = []
    inner, planned = transfer._stage_host_batch, transfer._stage_range_plan

    def stage(*args):
        direct_bytes.append(int(args[-1].sum()) if len(args) == 20 else 0)  # 17 + direct_dst/src/sizes
        return inner(*args)

    def stage_planned(plan, *args):
        direct_bytes.append(plan.direct_bytes)
        return planned(plan, *args)

    monkeypatch.setattr(transfer, "_stage_host_batch", stage)
    monkeypatch.setattr(transfer, "_stage_range_plan", stage_planned)
    return direct_bytes


@needs_arena
@pytest.mark.cuda
def test_gpu_batches_of_consecutive_rows_go_from_the_arena_to_the_device(tmp_path, monkeypatch):
    table = every_type(4000)
    path = write(table, tmp_path / "t.parquet", row_group_size=500)
    direct_bytes = _recording_stage(monkeypatch)
    dataset = ParquetDataset(path)
    loader = DataLoader(dataset, batch_size=300, device="cuda")
    ours = list(loader)
    assert "Parquet decoded into the pinned arena" in loader.stats().path
    assert dataset._reader().arena_decode is not None and parquet_arena.arena_stats()["live_bytes"] > 0
    reference = pq.read_table(path)
    for k, batch in enumerate(ours):
        rows = reference.slice(k * 300, 300)
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                assert torch.equal(batch[key].cpu(), want), (k, key)
    # the numeric and string columns' values went from the arena (offsets and masks via the slot)
    assert sum(1 for n in direct_bytes if n) == len(ours)
    assert min(direct_bytes[:-1]) >= 300 * 8 * 6  # full batches: at least six 8-byte columns in place
    dataset.close()


@needs_arena
@pytest.mark.cuda
@pytest.mark.parametrize("keep", [True, False])
def test_arena_memory_is_not_reused_under_a_pending_copy(tmp_path, monkeypatch, keep):
    """Every copy waits ~100 ms on the stream while the decode threads run ahead with a cache of
    one row group: the blocks of a row group whose batch is still to be copied are freed by the
    cache and reused by the next decode unless the slot holds them (negative control)."""
    monkeypatch.setattr(stager, "KEEP_DIRECT_SOURCES", keep)
    rng = np.random.default_rng(3)
    table = pa.table({"x": rng.integers(0, 1 << 60, 24 * 4096), "y": rng.standard_normal(24 * 4096)})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=4096, compression="none")
    dataset = ParquetDataset(path, threads=2, cache_bytes=1)
    loader = DataLoader(dataset, batch_size=4096, device="cuda", pool_slots=2, prefetch=4)
    loader.resources.engine.debug_delay_cycles = 200_000_000
    got = [(b["x"].cpu(), b["y"].cpu()) for b in loader]
    intact = all(
        np.array_equal(x.numpy(), table.column("x").to_numpy()[k * 4096 : (k + 1) * 4096])
        and np.array_equal(y.numpy(), table.column("y").to_numpy()[k * 4096 : (k + 1) * 4096])
        for k, (x, y) in enumerate(got)
    )
    assert len(got) == 24 and intact is keep
    dataset.close()


@needs_arena
@pytest.mark.cuda
def test_gpu_shuffled_batches_go_from_the_gather_region_to_the_device(tmp_path, monkeypatch):
    """Shuffled batches are gathered by ``_C.gather_rows`` into the pinned gather region and copied
    to the device from there (no copy into the slot), and equal pyarrow's take of their rows."""
    table = every_type(4000)
    path = write(table, tmp_path / "t.parquet", row_group_size=500)
    direct_bytes = _recording_stage(monkeypatch)
    dataset = ParquetDataset(path)
    sampler = ParquetSampler(dataset, shuffle=True, seed=5, shuffle_rows=1000)
    loader = DataLoader(dataset, batch_sampler=sampler.batches(300), device="cuda")
    order = [np.asarray(rows) for rows in sampler.batches(300)]  # the epoch's batches (epoch 0 again below)
    ours = list(loader)
    assert "shuffled rows gathered into pinned memory" in loader.stats().path
    reference = pq.read_table(path)
    assert len(order) == len(ours)
    for k, (rows, batch) in enumerate(zip(order, ours)):
        taken = reference.take(pa.array(rows))
        for spec in dataset.plan.columns:
            for key, want in expected(taken, spec.name, spec.masked).items():
                assert torch.equal(batch[key].cpu(), want), (k, key)
    full = [n for n, rows in zip(direct_bytes, order) if len(rows) == 300]
    assert full and min(full) >= 300 * 8 * 6  # every full batch: at least six 8-byte columns in place
    dataset.close()


@needs_arena
@pytest.mark.cuda
@pytest.mark.parametrize("keep", [True, False])
def test_gather_region_is_not_reused_under_a_pending_copy(tmp_path, monkeypatch, keep):
    """Every copy waits ~100 ms on the stream while the fetch threads gather the next batches: a
    batch's gathered blocks go back to the region's free lists when its host tensors are dropped
    and the next gather writes them, unless the slot holds them until the copy ran (negative
    control)."""
    monkeypatch.setattr(stager, "KEEP_DIRECT_SOURCES", keep)
    rng = np.random.default_rng(4)
    table = pa.table({"x": rng.integers(0, 1 << 60, 8 * 4096), "y": rng.standard_normal(8 * 4096)})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=8 * 4096, compression="none")
    dataset = ParquetDataset(path, threads=2)
    sampler = ParquetSampler(dataset, shuffle=True, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler.batches(2048), device="cuda", pool_slots=2, prefetch=4)
    loader.resources.engine.debug_delay_cycles = 200_000_000
    order = [np.asarray(rows) for rows in sampler.batches(2048)]
    got = [(b["x"].cpu(), b["y"].cpu()) for b in loader]
    x, y = table.column("x").to_numpy(), table.column("y").to_numpy()
    intact = all(
        np.array_equal(gx.numpy(), x[rows]) and np.array_equal(gy.numpy(), y[rows])
        for (gx, gy), rows in zip(got, order)
    )
    assert len(got) == 16 and intact is keep
    dataset.close()


@needs_arena
def test_the_arena_decode_survives_close_and_stays_out_of_pickles(tmp_path):
    """A dataset bound to the arena decodes there again after close() (a new cache), and a copy
    sent to worker processes decodes with pyarrow: the arena is mapped in this process only."""
    import pickle

    _arrow, _, _ = _arena()
    path = write(every_type(300), tmp_path / "t.parquet", row_group_size=100)
    dataset = ParquetDataset(path, threads=2)
    dataset._arena_decode = _arrow.read_row_group  # what __fastload_bind__ sets for a CUDA device
    dataset._reader()
    assert dataset._cache.arena_decode is _arrow.read_row_group
    dataset.close()
    assert dataset._reader().arena_decode is _arrow.read_row_group
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._arena_decode is None and copy._reader().arena_decode is None
    assert torch.equal(copy.batch(range(0, 150))["i64"], dataset.batch(range(0, 150))["i64"])
    dataset.close()
    copy.close()


def test_bind_says_where_the_rows_decode(tmp_path):
    """The loader's path names the decode's memory: only the decoder for a CPU loader, the
    slot's route with pinned_arena=0 (no CUDA call needed to say so); a negative size is refused."""
    path = write(every_type(100), tmp_path / "t.parquet")
    with config.override(parquet_cores_left=0):  # pyarrow's pool left as it is (the next test)
        dataset = ParquetDataset(path)
        assert dataset.__fastload_bind__(torch.device("cpu")) == dataset._decoder_note()
    off = ParquetDataset(path, pinned_arena=0)
    assert "pageable memory (pinned_arena=0)" in off.__fastload_bind__(torch.device("cuda"))
    assert off._arena_decode is None
    off.__fastload_unbind__(torch.device("cuda"))  # what the iterator's end calls
    with pytest.raises(ValueError, match="pinned_arena"):
        ParquetDataset(path, pinned_arena=-1)


@pytest.fixture
def arrow_pool():
    """pyarrow's CPU pool size, restored after the test; no hold of it left by earlier tests
    (a dataset collected while bound gives its hold back)."""
    from torch_fastload.sources.parquet import _ARROW_POOL

    gc.collect()
    assert _ARROW_POOL.holders == 0
    before = pa.cpu_count()
    yield
    pa.set_cpu_count(before)


def test_bind_leaves_cores_out_of_pyarrows_pool_never_grows_it(tmp_path, monkeypatch, arrow_pool):
    """A loader's bind makes pyarrow's CPU pool parquet_cores_left smaller than the machine (at
    least half of it) and says so in the loader's path; a pool already smaller stays, as does
    every pool with parquet_cores_left=0 or without pyarrow's column threads."""
    path = write(every_type(100), tmp_path / "t.parquet")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    pa.set_cpu_count(16)
    cpu = torch.device("cpu")
    with config.override(parquet_cores_left=0):
        assert "CPU pool" not in ParquetDataset(path).__fastload_bind__(cpu)
    assert "CPU pool" not in ParquetDataset(path, arrow_threads=False).__fastload_bind__(cpu)
    assert pa.cpu_count() == 16
    dataset = ParquetDataset(path)
    note = dataset.__fastload_bind__(cpu)
    assert pa.cpu_count() == 10 and "pyarrow's CPU pool made 10 threads (was 16" in note
    dataset.__fastload_unbind__(cpu)
    assert pa.cpu_count() == 16
    with config.override(parquet_cores_left=12):
        dataset.__fastload_bind__(cpu)
        assert pa.cpu_count() == 8  # half the machine at least
        dataset.__fastload_unbind__(cpu)
        pa.set_cpu_count(3)  # the user's own, smaller: kept
        assert "CPU pool" not in ParquetDataset(path).__fastload_bind__(cpu) and pa.cpu_count() == 3
    pa.set_cpu_count(16)
    loader = DataLoader(ParquetDataset(path), batch_size=50, device="cpu")
    during = [pa.cpu_count() for _ in loader]
    assert during == [10, 10] and "pyarrow's CPU pool made 10 threads" in loader.stats().path
    assert pa.cpu_count() == 16  # the epoch ended: the pool's size is given back


def test_pyarrows_pool_is_given_back_after_the_last_iterator_and_a_size_set_meanwhile_stays(
    tmp_path, monkeypatch, arrow_pool
):
    """Two datasets' iterators hold the smaller pool together; it gets its size back when the
    last ends, not before; an iterator dropped mid-epoch ends too; a size the user set while
    it was held is kept."""
    path = write(every_type(300), tmp_path / "t.parquet", row_group_size=50)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    pa.set_cpu_count(16)
    a = DataLoader(ParquetDataset(path), batch_size=50, device="cpu")
    b = DataLoader(ParquetDataset(path), batch_size=50, device="cpu")
    first, second = iter(a), iter(b)
    next(first), next(second)
    assert pa.cpu_count() == 10
    del first  # dropped mid-epoch: its pipeline shuts down
    gc.collect()
    assert pa.cpu_count() == 10  # the other still runs
    assert sum(len(batch["i64"]) for batch in second) == 250
    assert pa.cpu_count() == 16
    # two iterators of one dataset at once; the user's own size set meanwhile is kept
    c = DataLoader(ParquetDataset(path), batch_size=50, device="cpu")
    one, two = iter(c), iter(c)
    next(one), next(two)
    assert pa.cpu_count() == 10
    pa.set_cpu_count(12)
    one.close()
    two.close()
    assert pa.cpu_count() == 12
    # a dataset collected while bound (its iterator never ended) gives its hold back
    from torch_fastload.sources.parquet import _ARROW_POOL

    pa.set_cpu_count(16)
    dropped = ParquetDataset(path)
    dropped.__fastload_bind__(torch.device("cpu"))
    assert pa.cpu_count() == 10 and _ARROW_POOL.holders == 1
    del dropped
    gc.collect()
    assert pa.cpu_count() == 16 and _ARROW_POOL.holders == 0


def test_doctor_says_whether_the_arena_is_there_and_how_to_get_it(monkeypatch):
    from torch_fastload.doctor.cli import parquet_arena_status

    if parquet_arena.unavailable_reason() is None:
        assert parquet_arena_status().startswith("built")
    reason = "built for pyarrow 1.0.0, pyarrow 2.0.0 is installed"
    monkeypatch.setattr(parquet_arena, "unavailable_reason", lambda: reason)
    line = parquet_arena_status()
    assert "NOT available (built for pyarrow 1.0.0" in line and "--no-build-isolation" in line


@needs_arena
def test_the_arena_splits_and_merges_blocks_across_row_group_shapes(tmp_path):
    """A fresh 16 MiB arena (its own process): a row group of two 4.8 MB columns reaches its
    end in 8 MiB blocks and is freed, then a row group of six 8 KB columns decodes into it:
    the large free blocks are split for them (carved once per class, each small column took a
    whole 8 MiB block and the rest fell back to Arrow's pool), and freed again everything merges
    back into one block."""
    import subprocess
    import sys

    big, small = tmp_path / "big.parquet", tmp_path / "small.parquet"
    pq.write_table(pa.table({"a": np.arange(600_000), "b": np.arange(600_000)}), big, compression="none")
    pq.write_table(pa.table({f"c{k}": np.arange(1000) for k in range(6)}), small, compression="none")
    script = f"""
import json
from torch_fastload import _arrow
base, size = _arrow.make_arena(16 << 20)
def fell_back():  # allocations of 1 KiB and more sent to Arrow's pool
    s = _arrow.arena_stats()
    return s["fallback_allocations"] - s["fallback_small"]
table = _arrow.read_row_group({str(big)!r}, 0, [0, 1], True, by_pages=True, into_arena=True)
reached = _arrow.arena_stats()["carved_bytes"]
del table
before = fell_back()
table = _arrow.read_row_group({str(small)!r}, 0, list(range(6)), True, by_pages=True, into_arena=True)
inside = all(base <= c.chunk(0).buffers()[1].address < base + size for c in table.columns)
after = fell_back()
del table
print(json.dumps(dict(size=size, reached=reached, before=before, after=after, inside=inside,
                      largest=_arrow.arena_stats().get("largest_free"))))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["reached"] == got["size"]  # the large columns' blocks reached the arena's end
    assert got["after"] == got["before"] and got["inside"]  # the six small columns: none fell back
    assert got["largest"] == got["size"] == 16 << 20  # all freed: one block again
