"""The Parquet source: every type against pyarrow's own read_table, files of several writers and
codecs, batches across row groups, torch's DataLoader per row, exact resume, sharding, and bad
input (typed errors naming file, row group and column, raised by the batch's own next())."""

from __future__ import annotations

import decimal
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_loader import assert_same

from torch_fastload import DataLoader
from torch_fastload.errors import ParquetDecodeError, ParquetError, ParquetFormatError, ParquetSchemaError
from torch_fastload.sources import ParquetDataset, ParquetSampler
from torch_fastload.sources.parquet_tensors import can_gather
from torch_fastload.staging import PendingConcat

#: parquet_gather's routes: the C++ gather needs the extension built (CI builds it)
GATHER_ROUTES = [
    pytest.param("native", marks=pytest.mark.skipif(not can_gather(), reason="the C++ extension is not built")),
    "arrow",
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def every_type(n: int = 1000, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    nulls = rng.random(n) < 0.1
    table = pa.table(
        {
            "i8": pa.array(rng.integers(-128, 128, n).astype(np.int8)),
            "i32": pa.array(rng.integers(-(2**31), 2**31, n).astype(np.int32)),
            "i64": pa.array(rng.integers(-(2**62), 2**62, n)),
            "u16": pa.array([None if z else int(v) for v, z in zip(rng.integers(0, 2**16, n), nulls)], pa.uint16()),
            "u64": pa.array(rng.integers(0, 2**63, n).astype(np.uint64)),
            "price_null": pa.array(
                [None if z else decimal.Decimal(int(v)) for v, z in zip(rng.integers(0, 10**6, n), nulls)],
                pa.decimal128(9, 0),
            ),
            "f32": pa.array(rng.standard_normal(n).astype(np.float32)),
            "f64": pa.array(rng.standard_normal(n)),
            "flag": pa.array(rng.random(n) < 0.5),
            "ts_us": pa.array(rng.integers(0, 2**50, n), pa.timestamp("us")),
            "ts_ms_tz": pa.array(rng.integers(0, 2**40, n), pa.timestamp("ms", tz="UTC")),
            "clock": pa.array(rng.integers(0, 86_400 * 10**6, n), pa.time64("us")),
            "wait": pa.array(rng.integers(-(10**9), 10**9, n), pa.duration("ms")),
            "day64": pa.array(rng.integers(0, 40000, n) * 86_400_000, pa.date64()),
            "half": pa.array(rng.standard_normal(n).astype(np.float16)),
            "day": pa.array(rng.integers(0, 40000, n).astype(np.int32), pa.date32()),
            "price": pa.array(
                [decimal.Decimal(int(v)).scaleb(-2) for v in rng.integers(-(10**9), 10**9, n)], pa.decimal128(12, 2)
            ),
            "name": pa.array([None if z else f"user-{v}" * int(v % 4) for v, z in zip(rng.integers(0, 500, n), nulls)]),
            "blob": pa.array([bytes(rng.integers(0, 256, int(k), dtype=np.uint8)) for k in rng.integers(0, 9, n)]),
            "tags": pa.array([list(range(int(k))) for k in rng.integers(0, 5, n)], pa.list_(pa.int64())),
            "emb": pa.array(rng.standard_normal((n, 4)).astype(np.float32).tolist(), pa.list_(pa.float32(), 4)),
            "maybe": pa.array([None if z else int(v) for v, z in zip(rng.integers(0, 100, n), nulls)], pa.int64()),
        }
    )
    if int(pa.__version__.split(".")[0]) < 15:  # float16 in Parquet since pyarrow 15
        table = table.remove_column(table.schema.get_field_index("half"))
    return table


def expected(table: pa.Table, column: str, masked: bool) -> dict:
    """The batch dict of ``column`` worked out from pyarrow's values (Python objects, not buffers)."""
    arr = table.column(column).combine_chunks()
    values = arr.to_pylist()
    valid = [v is not None for v in values]
    t = arr.type
    out = {}
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        raw = [(v.encode() if isinstance(v, str) else v) if v is not None else b"" for v in values]
        out[column] = torch.tensor(list(b"".join(raw)), dtype=torch.uint8)
        out[column + "__offsets"] = torch.tensor(
            np.concatenate([[0], np.cumsum([len(r) for r in raw])]), dtype=torch.int64
        )
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        flat = [x for v in values for x in (v or [])]
        out[column] = torch.tensor(flat, dtype=torch.int64)
        out[column + "__offsets"] = torch.tensor(
            np.concatenate([[0], np.cumsum([len(v or []) for v in values])]), dtype=torch.int64
        )
    elif pa.types.is_fixed_size_list(t):
        out[column] = torch.tensor(values, dtype=torch.float32)
    elif pa.types.is_decimal(t):
        out[column] = torch.tensor([int(v.scaleb(t.scale)) if v is not None else 0 for v in values], dtype=torch.int64)
    elif pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_duration(t):
        narrow = pa.types.is_date32(t) or pa.types.is_time32(t)
        ints = arr.cast(pa.int32()).cast(pa.int64()) if narrow else arr.cast(pa.int64())
        out[column] = torch.tensor([v if v is not None else 0 for v in ints.to_pylist()], dtype=torch.int64)
    else:
        # the type's numpy dtype without DataType.to_pandas_dtype (pyarrow < 26 imports pandas for it)
        dtype = pa.array([], t).to_numpy(zero_copy_only=False).dtype
        out[column] = torch.from_numpy(np.array([v if v is not None else 0 for v in values], dtype=dtype))
    assert masked or not arr.null_count, column  # a column with nulls always has a mask
    if masked:
        out[column + "__valid"] = torch.tensor(valid)
    return out


def assert_matches_read_table(dataset: ParquetDataset, reference: pa.Table) -> None:
    batch = dataset.batch(range(len(dataset)))
    want = {}
    for spec in dataset.plan.columns:
        want.update(expected(reference, spec.name, spec.masked))
    assert set(batch) == set(want) == set(dataset.keys())
    for key in want:
        assert batch[key].dtype == want[key].dtype, key
        assert torch.equal(batch[key], want[key]), key


def assert_equals_take(dataset: ParquetDataset, reference: pa.Table, rows) -> None:
    """The dataset's batch of ``rows`` equals pyarrow's take of them, key by key, dtype included."""
    batch = dataset.batch(rows)
    taken = reference.take(pa.array(rows))
    for spec in dataset.plan.columns:
        for key, want in expected(taken, spec.name, spec.masked).items():
            assert batch[key].dtype == want.dtype, key
            assert torch.equal(batch[key], want), key


def write(table: pa.Table, path, writer: str = "pyarrow", compression: str = "snappy", row_group_size: int = 128):
    path = str(path)
    if writer == "pyarrow":
        pq.write_table(table, path, row_group_size=row_group_size, compression=compression)
    elif writer == "pyarrow-v2-plain-nostats":
        pq.write_table(
            table,
            path,
            row_group_size=row_group_size,
            compression=compression,
            data_page_version="2.0",
            use_dictionary=False,
            write_statistics=False,
        )
    elif writer == "polars":
        polars = pytest.importorskip("polars")
        polars.from_arrow(table).write_parquet(path, compression=compression, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("compression", ["snappy", "zstd", "gzip", "none"])
@pytest.mark.parametrize("writer", ["pyarrow", "pyarrow-v2-plain-nostats", "polars"])
def test_every_type_equals_read_table(tmp_path, writer, compression):
    table = every_type()
    if writer == "polars":  # polars has no uint16-free decimal quirks; it rewrites types it lacks
        table = table.select([c for c in table.column_names if c not in ("u16", "u64", "half")])  # not in polars
    path = write(
        table,
        tmp_path / "t.parquet",
        writer,
        "uncompressed" if compression == "none" and writer == "polars" else compression,
    )
    dataset = ParquetDataset(path, threads=3)
    reference = pq.read_table(path)
    assert dataset.plan.schema.names == reference.schema.names
    assert_matches_read_table(dataset, reference)
    assert dataset.units["ts_us"] == "us" and dataset.units["day"] == "days" and dataset.units["price"] == "scale=2"
    dataset.close()


@pytest.mark.parametrize("read_mode", ["pyarrow", "pread"])
def test_read_modes_threads_and_projection_agree(tmp_path, read_mode):
    table = every_type(700)
    path = write(table, tmp_path / "t.parquet", row_group_size=50)
    reference = ParquetDataset(path, threads=1).batch(np.arange(700)[::-1])
    dataset = ParquetDataset(path, threads=4, read_mode=read_mode, cache_bytes=1)  # evicts as it goes
    assert_same(dataset.batch(np.arange(700)[::-1]), reference)
    projected = ParquetDataset(path, columns=["name", "f32"], read_mode=read_mode)
    assert projected.keys() == ["name", "name__offsets", "name__valid", "f32"]
    batch = projected.batch(range(700))
    assert torch.equal(batch["f32"], torch.tensor(table.column("f32").to_numpy()))


def test_directory_glob_and_list_of_files(tmp_path):
    tables = [every_type(300, seed) for seed in range(3)]
    for k, t in enumerate(tables):
        write(t, tmp_path / f"part-{k}.parquet", row_group_size=100)
    whole = pa.concat_tables([pq.read_table(p) for p in sorted(tmp_path.glob("*.parquet"))])  # as stored
    for source in (tmp_path, str(tmp_path / "part-*.parquet"), sorted(tmp_path.glob("*.parquet"))):
        dataset = ParquetDataset(source)
        assert len(dataset) == 900 and len(dataset.plan.row_groups) == 9
        assert_matches_read_table(dataset, whole)


def test_many_files_hold_few_descriptors(tmp_path):
    for k in range(24):
        write(
            pa.table({"x": pa.array(np.arange(k * 50, k * 50 + 50))}), tmp_path / f"p{k:02d}.parquet", row_group_size=25
        )
    before = len(os.listdir("/proc/self/fd"))
    dataset = ParquetDataset(tmp_path, threads=2)
    batch = dataset.batch(np.arange(1200)[::-1])
    assert batch["x"].tolist() == list(range(1199, -1, -1))
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * 4 + 2  # a few open per decode thread
    dataset.close()


def test_column_names_with_dots_and_nested_neighbours(tmp_path):
    table = pa.table(
        {
            "a": pa.array([{"b": 1}, {"b": 2}]),  # leaf path a.b
            "a.b": pa.array([10, 20], pa.int64()),  # leaf path a.b as well
            "emb.x": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32(), 2)),
        }
    )
    path = write(table, tmp_path / "t.parquet")
    dataset = ParquetDataset(path, columns=["a.b", "emb.x"])
    batch = dataset.batch([1, 0])
    assert batch["a.b"].tolist() == [20, 10] and batch["emb.x"].tolist() == [[3.0, 4.0], [1.0, 2.0]]
    assert len(dataset.plan.row_groups[0].chunks["a.b"]) == 1


def test_empty_files_and_row_groups_are_skipped(tmp_path):
    empty = write(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "a.parquet")  # an empty chunk at offset 0
    full = write(pa.table({"x": pa.array([1, 2, 3], pa.int64())}), tmp_path / "b.parquet")
    dataset = ParquetDataset([empty, full])
    assert len(dataset) == 3 and len(dataset.plan.row_groups) == 1 and dataset.keys() == ["x"]
    got = torch.cat(
        [b["x"] for b in DataLoader(dataset, batch_sampler=ParquetSampler(dataset).batches(2), device="cpu")]
    )
    assert sorted(got.tolist()) == [1, 2, 3]
    alone = ParquetDataset(empty)
    assert (
        len(alone) == 0 and list(DataLoader(alone, batch_sampler=ParquetSampler(alone).batches(2), device="cpu")) == []
    )


def test_dictionary_columns_give_codes_and_a_dictionary(tmp_path):
    table = every_type(400)
    path = write(table, tmp_path / "t.parquet")
    dataset = ParquetDataset(path, columns=["name"], dictionary_columns=["name"])
    batch = dataset.batch(range(400))
    words = [
        bytes(batch["name__dictionary"][a:b].numpy()).decode()
        for a, b in zip(batch["name__dictionary_offsets"][:-1], batch["name__dictionary_offsets"][1:])
    ]
    decoded = [words[c] if c >= 0 else None for c in batch["name"].tolist()]
    assert decoded == table.column("name").to_pylist()
    assert torch.equal(batch["name__valid"], torch.tensor([v is not None for v in decoded]))


def test_loader_batches_cut_across_row_groups_and_equal_torch_per_row(tmp_path):
    table = every_type(1000)
    path = write(table, tmp_path / "t.parquet", row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    sampler = ParquetSampler(dataset, seed=5, shuffle_rows=200)
    ours = list(DataLoader(dataset, batch_size=70, sampler=sampler, device="cpu"))
    theirs = list(torch.utils.data.DataLoader(dataset, batch_size=70, sampler=sampler, collate_fn=dataset.collate))
    assert len(ours) == 15
    assert_same(ours, theirs)
    rows = torch.cat([b["i64"] for b in ours])
    assert sorted(rows.tolist()) == sorted(table.column("i64").to_pylist())  # every row once


@pytest.mark.parametrize("batch_size", [70, 250])
def test_in_order_batches_across_row_groups_are_copied_once_and_equal_read_table(tmp_path, batch_size, device="cpu"):
    table = every_type(1000)
    path = write(table, tmp_path / "t.parquet", row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    reference = pq.read_table(path)
    plans = dataset.__fastload_batch__(np.arange(90, 90 + batch_size))  # across 2+ row groups
    assert isinstance(plans["i64"], PendingConcat) and isinstance(plans["name"], PendingConcat)
    assert plans["name__offsets"].dtype == torch.int64 and plans["i64"].shape == (batch_size,)
    ours = list(DataLoader(dataset, batch_size=batch_size, device=device))
    assert len(ours) == -(-1000 // batch_size)
    for k, batch in enumerate(ours):
        rows = reference.slice(k * batch_size, batch_size)
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                got = batch[key]
                assert got.device.type == device and got.dtype == want.dtype, (k, key)
                assert torch.equal(got.cpu(), want), (k, key)
    dataset.close()


def test_batch_sampler_gives_the_same_batches_without_per_row_python(tmp_path):
    path = write(every_type(1000), tmp_path / "t.parquet", row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    sampler = ParquetSampler(dataset, seed=5, shuffle_rows=200, num_replicas=2, rank=1)
    by_rows = list(DataLoader(dataset, batch_size=70, sampler=sampler, device="cpu"))
    batches = sampler.batches(70)
    assert len(batches) == 8 and all(isinstance(b, np.ndarray) and b.dtype == np.int64 for b in batches)
    ours = list(DataLoader(dataset, batch_sampler=batches, device="cpu"))
    theirs = list(torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=dataset.collate))
    assert_same(ours, by_rows)
    assert_same(ours, theirs)
    assert len(sampler.batches(70, drop_last=True)) == 7


def test_exact_resume_with_the_batch_sampler(tmp_path):
    path = write(every_type(900), tmp_path / "t.parquet", row_group_size=100)

    def loader():
        dataset = ParquetDataset(path)
        batches = ParquetSampler(dataset, seed=2).batches(64)
        batches.set_epoch(1)
        return DataLoader(dataset, batch_sampler=batches, device="cpu")

    full = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert_same(head + list(resumed), full)


def test_shuffle_is_by_row_group_then_within_a_window(tmp_path):
    path = write(pa.table({"x": pa.array(np.arange(1000))}), tmp_path / "t.parquet", row_group_size=100)
    dataset = ParquetDataset(path)
    order = ParquetSampler(dataset, seed=1, shuffle_rows=100).indices()
    assert sorted(order.tolist()) == list(range(1000))
    for k in range(10):  # a window of one row group's length over aligned row groups: whole groups
        assert len(set((order[k * 100 : (k + 1) * 100] // 100).tolist())) == 1
    again = ParquetSampler(dataset, seed=1, shuffle_rows=100)
    assert np.array_equal(again.indices(), order)
    again.set_epoch(1)
    assert not np.array_equal(again.indices(), order)
    plain = ParquetSampler(dataset, shuffle=False).indices()
    assert plain.tolist() == list(range(1000))


def test_first_seen_groups_is_the_order_row_groups_are_first_read():
    from torch_fastload.sources.parquet_sampler import first_seen_groups

    rng = np.random.default_rng(0)
    starts = np.concatenate(([0], np.cumsum(rng.integers(1, 50, 40))))
    for _ in range(50):
        rows = rng.permutation(int(starts[-1]))[: rng.integers(0, starts[-1])]
        rows = np.sort(rows) if rng.random() < 0.5 else rows
        groups = np.searchsorted(starts, rows, side="right") - 1
        _, first = np.unique(groups, return_index=True)  # every row sorted: the slow reference
        assert first_seen_groups(starts, rows).tolist() == groups[np.sort(first)].tolist()


def _settled(cache) -> None:
    """Wait (no time limit asserted) until the cache has no decode running."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with cache.lock:
            if all(f.done() for f in cache.entries.values()):
                time.sleep(0.05)  # a finished decode's callback may still start the next one
                if all(f.done() for f in cache.entries.values()):
                    return
        time.sleep(0.01)
    raise AssertionError("decodes still running after 60 s")


@pytest.mark.parametrize("shuffle", [False, True])
def test_decode_runs_ahead_of_the_batches_in_the_samplers_order(tmp_path, shuffle):
    """After one batch, row groups keep decoding in the order the sampler reads them (the old
    read-ahead started ``threads`` row groups and waited for the next batch to ask for more)."""
    path = write(pa.table({"x": pa.array(np.arange(4000))}), tmp_path / "t.parquet", row_group_size=100)
    dataset = ParquetDataset(path, threads=2)
    sampler = ParquetSampler(dataset, shuffle=shuffle, seed=3, shuffle_rows=100)
    batch = next(iter(sampler.batches(100)))
    dataset.batch(batch)
    cache = dataset._reader()
    _settled(cache)
    assert list(cache.entries) == dataset._schedule.tolist()  # all 40 row groups, in read order
    dataset.close()


@pytest.mark.parametrize("at_iter", [True, False])
def test_the_epochs_first_row_groups_decode_from_iter_on(tmp_path, monkeypatch, at_iter):
    """``iter(loader)`` starts decoding the sampler's first row groups before the fetch thread
    asks for a batch (held back here); negative control: ``DECODE_AT_ITER`` off, nothing
    decodes until a batch asks. Either way the epoch is the sampler's rows, once each."""
    from torch_fastload.sources import parquet as pq_source

    monkeypatch.setattr(pq_source, "DECODE_AT_ITER", at_iter)
    path = write(pa.table({"x": pa.array(np.arange(4000))}), tmp_path / "t.parquet", row_group_size=100)
    dataset = ParquetDataset(path, threads=2)
    batches = ParquetSampler(dataset, shuffle=True, seed=3, shuffle_rows=100).batches(100)
    release, asked = threading.Event(), []
    fetch = dataset.__fastload_batch__

    def held(indices):
        asked.append(True)
        release.wait(30)
        return fetch(indices)

    dataset.__fastload_batch__ = held
    it = iter(DataLoader(dataset, batch_sampler=batches, device="cpu"))
    first = int(dataset._schedule[0])
    deadline = time.monotonic() + (30 if at_iter else 0.5)
    while time.monotonic() < deadline and not (dataset._cache is not None and first in dataset._cache.entries):
        time.sleep(0.01)
    started = dataset._cache is not None and first in dataset._cache.entries
    release.set()
    rows = torch.cat([b["x"] for b in it])
    assert started == at_iter
    assert asked  # the fetch thread was there, held back
    assert rows.tolist() == batches.sampler.indices().tolist()
    dataset.close()


@pytest.mark.parametrize("first_alone, columns, alone", [(True, 4, True), (False, 4, False), (True, 1, False)])
def test_the_epochs_first_row_group_is_read_alone_then_the_read_ahead_resumes(
    tmp_path, monkeypatch, first_alone, columns, alone
):
    """``RowGroupCache.start`` (an epoch's start) holds the read-ahead back while the first row
    group is read, so it has the decode threads to itself; once it is read the others start.
    Only where its column chunks fill the threads: a one-column row group is one chunk on one
    thread. Negative control: ``FIRST_ALONE`` off starts them beside it at once."""
    from torch_fastload.sources import parquet_decode

    monkeypatch.setattr(parquet_decode, "FIRST_ALONE", first_alone)
    monkeypatch.setattr(parquet_decode.pa, "cpu_count", lambda: 4)  # pyarrow's pool, whatever the machine
    table = pa.table({f"c{k}": pa.array(np.arange(4000) + k) for k in range(columns)})
    path = write(table, tmp_path / "t.parquet", row_group_size=100)
    dataset = ParquetDataset(path, threads=4)
    cache = dataset._reader()
    release = threading.Event()
    read = cache._read

    def held(group, names, order=-1):
        if group.index == 0:
            release.wait(30)
        return read(group, names, order)

    cache._read = held
    cache.start(list(range(40)))
    time.sleep(0.2)  # room for a read-ahead to start, if it is not held back
    with cache.lock:
        beside = sorted(i for i in cache.entries if i != 0)
    release.set()
    _settled(cache)
    assert (beside == []) == alone, beside
    assert {0, 1, 2} <= set(cache.entries)  # read ahead once the first was read
    assert_matches_read_table(dataset, pq.read_table(path))
    dataset.close()


@pytest.mark.parametrize("route", GATHER_ROUTES)
def test_shuffled_batches_across_row_groups_equal_read_table(tmp_path, route):
    """Batches of 5000 shuffled rows spanning two or three row groups: gathered in one C++ call
    across the row groups ('native'), or by the parallel per-column take ('arrow'); every type
    and the nulls come out as pyarrow's own take of the same rows."""
    from torch_fastload import config

    table = every_type(12000, seed=5)
    path = write(table, tmp_path / "t.parquet", row_group_size=3000)
    reference = pq.read_table(path)
    with config.override(parquet_gather=route):
        dataset = ParquetDataset(path, threads=4)
        sampler = ParquetSampler(dataset, seed=2, shuffle_rows=6000)
        spans = 0
        for rows in sampler.batches(5000):
            spans += len(np.unique(np.searchsorted(dataset.plan.starts, rows, side="right"))) > 1
            assert_equals_take(dataset, reference, rows)
    assert spans  # batches across row groups were read
    # the per-column take ran only on the Arrow route
    assert (dataset._reader().gather_pool is not None) == (route == "arrow")
    dataset.close()


@pytest.mark.parametrize("route", GATHER_ROUTES)
def test_shuffled_batches_of_one_row_group_are_gathered_in_one_call_and_equal_read_table(tmp_path, monkeypatch, route):
    """Shuffled batches whose rows lie in one row group: every column's rows cut by one C++ call
    (``parquet_gather='native'``), or by pyarrow's take ('arrow'); both equal pyarrow's take of
    the same rows for every type, nulls and masks included, through the dataset and the loader."""
    from torch_fastload import config
    from torch_fastload.sources import parquet as parquet_module

    calls = []
    gather = parquet_module.gather_tensors
    monkeypatch.setattr(parquet_module, "gather_tensors", lambda *a: calls.append(1) or gather(*a))
    table = every_type(12000, seed=7)
    path = write(table, tmp_path / "t.parquet", row_group_size=3000)
    reference = pq.read_table(path)
    with config.override(parquet_gather=route):
        dataset = ParquetDataset(path, threads=4)
        sampler = ParquetSampler(dataset, seed=3, shuffle_rows=1000)
        batches = list(sampler.batches(400))
        for rows in batches:
            assert_equals_take(dataset, reference, rows)
        loader = DataLoader(dataset, batch_sampler=batches, device="cpu")
        for rows, got in zip(batches, loader):
            assert_same(got, dataset.batch(rows))
    one_group = sum(len(np.unique(np.searchsorted(dataset.plan.starts, r, side="right"))) == 1 for r in batches)
    assert one_group >= len(batches) // 2  # most batches lie in one row group: the route under test ran
    assert (len(calls) > 0) == (route == "native")
    dataset.close()


def test_shuffled_masks_across_row_groups_with_and_without_nulls(tmp_path):
    """A masked column whose nulls lie in one row group only: the row groups without a mask
    give ones, gathered beside the masks of the others; values and masks equal pyarrow's."""
    n = 4000
    x = pa.array([None if i < 1000 and i % 3 == 0 else i for i in range(n)], pa.int64())
    s = pa.array([None if i < 1000 and i % 5 == 0 else f"s{i}" for i in range(n)])
    path = write(pa.table({"x": x, "s": s}), tmp_path / "t.parquet", row_group_size=1000)
    reference = pq.read_table(path)
    dataset = ParquetDataset(path, masks="always")
    rows = np.random.default_rng(0).permutation(n)[:1500]
    batch = dataset.batch(rows)
    taken = reference.take(pa.array(rows))
    for spec in dataset.plan.columns:
        for key, want in expected(taken, spec.name, True).items():
            assert torch.equal(batch[key], want), key
    assert not batch["x__valid"].all() and batch["x__valid"].sum() > 1000
    dataset.close()


def test_unreported_nulls_in_shuffled_rows_of_one_row_group_are_an_error(tmp_path):
    table = pa.table({"x": pa.array([1, None, 3, 4] * 500, pa.int64()), "s": pa.array(["ab", "c", "", "d"] * 500)})
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, write_statistics=False, row_group_size=1000)
    dataset = ParquetDataset(path, masks="never")
    with pytest.raises(ParquetDecodeError, match="nulls"):
        dataset.batch(np.array([7, 3, 1, 0]))
    dataset.batch(np.array([7, 3, 2, 0]))  # the same row group without its nulls: no error


def test_a_full_cache_drops_row_groups_already_read_before_those_decoded_ahead(tmp_path):
    path = write(pa.table({"x": pa.array(np.arange(4000))}), tmp_path / "t.parquet", row_group_size=100)
    group_bytes = pq.read_table(path).slice(0, 100).nbytes
    dataset = ParquetDataset(path, threads=2, cache_bytes=6 * group_bytes)
    cache = dataset._reader()
    for b in range(0, 80):  # two batches a row group
        k = b // 2
        batch = dataset.batch(np.arange(b * 50, (b + 1) * 50))
        assert torch.equal(batch["x"], torch.arange(b * 50, (b + 1) * 50))
        _settled(cache)
        assert cache.held <= 6 * group_bytes
        if k < 38:  # the row group being read and the next ones stay decoded; the ones read go
            assert {k, k + 1, k + 2} <= set(cache.entries), (b, list(cache.entries))
    assert cache.decoded[0] == 40  # none decoded twice
    dataset.close()


def test_row_groups_at_once_give_every_thread_column_chunks(tmp_path):
    one = write(pa.table({"x": pa.array(np.arange(400))}), tmp_path / "one.parquet", row_group_size=100)
    wide = write(pa.table({f"c{k}": pa.array(np.arange(400)) for k in range(8)}), tmp_path / "w.parquet")
    assert ParquetDataset(one, threads=4)._reader().at_once == 4  # one column: a row group a thread
    assert ParquetDataset(wide, threads=16)._reader().at_once == 4  # 8 columns: two chunks a thread
    assert ParquetDataset(wide, threads=16, arrow_threads=False)._reader().at_once == 16
    assert ParquetDataset(wide, threads=16, row_groups_at_once=1)._reader().at_once == 1


def test_read_ahead_holds_at_most_half_the_cache(tmp_path):
    path = write(pa.table({"x": pa.array(np.arange(4000))}), tmp_path / "t.parquet", row_group_size=100)
    group_bytes = pq.read_table(path).slice(0, 100).nbytes
    dataset = ParquetDataset(path, threads=2, cache_bytes=8 * group_bytes)
    dataset.batch(np.arange(100))
    cache = dataset._reader()
    _settled(cache)
    ahead = [g for g in cache.entries if g != 0]
    assert 2 <= len(ahead) <= 4 and ahead == list(range(1, len(ahead) + 1))  # the next ones, bounded
    assert_matches_read_table(dataset, pq.read_table(path))  # what was cached is what is read
    dataset.close()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_ranks_read_every_row_once_balanced_by_rows(tmp_path, world):
    tables = [pa.table({"x": pa.array(np.arange(k * 1000, k * 1000 + n))}) for k, n in enumerate([430, 170, 999])]
    for k, t in enumerate(tables):
        write(t, tmp_path / f"p{k}.parquet", row_group_size=64)
    dataset = ParquetDataset(tmp_path)
    seen = []
    for rank in range(world):
        sampler = ParquetSampler(dataset, seed=3, num_replicas=world, rank=rank)
        batches = list(DataLoader(dataset, batch_size=50, sampler=sampler, device="cpu"))
        got = torch.cat([b["x"] for b in batches]).tolist()
        assert abs(len(got) - len(dataset) / world) < 1
        seen += got
    assert sorted(seen) == sorted(pa.concat_tables(tables).column("x").to_pylist())
    padded = [len(ParquetSampler(dataset, num_replicas=world, rank=r, even=True)) for r in range(world)]
    assert len(set(padded)) == 1 and padded[0] * world - len(dataset) < world


def test_exact_resume_mid_epoch_in_a_fresh_loader(tmp_path):
    path = write(every_type(900), tmp_path / "t.parquet", row_group_size=100)

    def loader():
        dataset = ParquetDataset(path, threads=2)
        sampler = ParquetSampler(dataset, seed=11, shuffle_rows=300)
        sampler.set_epoch(2)
        return DataLoader(dataset, batch_size=64, sampler=sampler, device="cpu")

    full = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert_same(head + list(resumed), full)


def test_resume_with_other_sampler_settings_is_refused_by_name(tmp_path):
    from torch_fastload.resume import ResumeError

    path = write(every_type(600), tmp_path / "t.parquet", row_group_size=100)

    def loader(**options):
        dataset = ParquetDataset(path)
        sampler = ParquetSampler(dataset, seed=4, **options)
        sampler.set_epoch(3)
        return DataLoader(dataset, batch_size=50, sampler=sampler, device="cpu"), sampler

    first, _ = loader(num_replicas=2, rank=0)
    it = iter(first)
    next(it)
    state = first.state_dict()
    assert state["dataset"]["sampler"]["num_replicas"] == 2
    other, _ = loader(num_replicas=3, rank=0)
    other.load_state_dict(state)
    with pytest.raises(ResumeError, match="num_replicas: 2 then, 3 now"):
        next(iter(other))
    late, sampler = loader(num_replicas=2, rank=0)
    sampler.set_epoch(4)
    late.load_state_dict(state)
    with pytest.raises(ResumeError, match="epoch: 3 then, 4 now"):
        next(iter(late))
    other_file = write(every_type(600), tmp_path / "u.parquet", row_group_size=200)  # other row groups
    with pytest.raises(ResumeError, match="600 rows in 6 row groups, this one has 600 in 3"):
        ParquetDataset(other_file).load_state_dict(state["dataset"])
    list(it)  # the epoch's end: a checkpoint now is between epochs, the next may differ
    done = first.state_dict()
    assert done["dataset"]["rows_delivered"] == 300
    elastic, sampler = loader(num_replicas=3, rank=1)
    sampler.set_epoch(4)
    elastic.load_state_dict(done)
    assert sum(len(b["i8"]) for b in elastic) == 200


# -- bad input ---------------------------------------------------------------------------
def test_not_parquet_truncated_and_still_being_written(tmp_path):
    good = write(every_type(300), tmp_path / "good.parquet")
    data = open(good, "rb").read()
    cases = {
        "text.parquet": (b"id,name\n1,a\n" * 10, "not a Parquet file"),
        "tiny.parquet": (b"PAR1", "too short"),
        "half.parquet": (data[: len(data) // 2], "truncated, or still being written"),
        "writing.parquet": (data[:-8], "truncated, or still being written"),
        "badlength.parquet": (data[:-8] + (len(data) * 2).to_bytes(4, "little") + b"PAR1", "footer length"),
    }
    writing = tmp_path / "open_writer.parquet"  # a real writer that has not closed its file
    writer = pq.ParquetWriter(str(writing), every_type(10).schema)
    writer.write_table(every_type(300))
    with pytest.raises(ParquetFormatError, match="still being written"):
        ParquetDataset(writing)
    writer.close()
    assert len(ParquetDataset(writing)) == 300
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ParquetFormatError, match=match) as info:
            ParquetDataset(tmp_path / name)
        assert name in str(info.value) and info.value.path.endswith(name)


def test_missing_column_mismatched_schemas_and_unsupported_types(tmp_path):
    a = write(pa.table({"x": pa.array([1, 2, 3]), "y": pa.array([1.0, 2.0, 3.0])}), tmp_path / "a.parquet")
    b = write(pa.table({"x": pa.array([1.5, 2.5]), "y": pa.array([1.0, 2.0])}), tmp_path / "b.parquet")
    with pytest.raises(ParquetSchemaError, match="no such column") as info:
        ParquetDataset(a, columns=["x", "z"])
    assert info.value.column == "z"
    with pytest.raises(ParquetSchemaError, match="differs") as info:
        ParquetDataset([a, b])
    assert info.value.path == b and info.value.column == "x"
    assert len(ParquetDataset([a, b], columns=["y"])) == 5  # the differing column left out
    nested = pa.table(
        {
            "ok": [1, 2],
            "s": pa.array([{"p": 1}, {"p": 2}]),
            "big": pa.array([decimal.Decimal(1)] * 2, pa.decimal128(30, 2)),
        }
    )
    c = write(nested, tmp_path / "c.parquet")
    with pytest.raises(ParquetSchemaError, match="struct") as info:
        ParquetDataset(c)
    assert info.value.column == "s"
    with pytest.raises(ParquetSchemaError, match="precision > 18"):
        ParquetDataset(c, columns=["big"])
    assert len(ParquetDataset(c, columns=["ok"])) == 2


def _corrupt_page(path: str, column: str, row_group: int) -> None:
    meta = pq.read_metadata(path)
    names = [meta.schema.column(j).path for j in range(meta.num_columns)]
    chunk = meta.row_group(row_group).column(names.index(column))
    start = chunk.data_page_offset
    with open(path, "r+b") as f:  # the page header's bytes: the page cannot be parsed
        f.seek(start)
        f.write(b"\xff" * 24)


@pytest.mark.parametrize("read_mode", ["pyarrow", "pread"])
def test_corrupt_page_fails_its_own_batch_naming_row_group_and_column(tmp_path, read_mode):
    table = pa.table({"a": pa.array(np.arange(1000)), "b": pa.array([f"s{i}" for i in range(1000)])})
    path = write(table, tmp_path / "t.parquet", compression="none", row_group_size=100)
    _corrupt_page(path, "b", 4)
    dataset = ParquetDataset(path, threads=1, read_mode=read_mode)  # the footer is fine
    loader = DataLoader(dataset, batch_size=100, sampler=ParquetSampler(dataset, shuffle=False), device="cpu")
    it = iter(loader)
    for k in range(4):
        assert torch.equal(next(it)["a"], torch.arange(k * 100, (k + 1) * 100))
    with pytest.raises(ParquetDecodeError) as info:
        next(it)
    assert (info.value.path, info.value.row_group, info.value.column) == (path, 4, "b")
    assert "row group 4" in str(info.value) and "'b'" in str(info.value)


def test_a_row_group_that_fails_ahead_is_not_decoded_again_until_its_batch(tmp_path):
    table = pa.table({"a": pa.array(np.arange(1000)), "b": pa.array([f"s{i}" for i in range(1000)])})
    path = write(table, tmp_path / "t.parquet", compression="none", row_group_size=100)
    _corrupt_page(path, "b", 2)
    dataset = ParquetDataset(path, threads=2)
    cache = dataset._reader()
    tries: dict = {}
    decode = cache._decode

    def counted(index, order=-1):
        tries[index] = tries.get(index, 0) + 1
        return decode(index, order)

    cache._decode = counted
    for k in range(2):
        assert torch.equal(dataset.batch(np.arange(k * 100, (k + 1) * 100))["a"], torch.arange(k * 100, (k + 1) * 100))
        _settled(cache)
    assert tries[2] == 1 and max(tries) > 2  # tried once ahead; the read-ahead went on past it
    with pytest.raises(ParquetDecodeError) as info:
        dataset.batch(np.arange(200, 300))
    assert info.value.row_group == 2 and tries[2] == 2  # its own batch tries again and raises
    dataset.close()


def test_file_rewritten_after_open_is_a_typed_batch_error(tmp_path):
    path = write(every_type(300), tmp_path / "t.parquet")
    dataset = ParquetDataset(path)
    with open(path, "ab") as f:
        f.write(b"more rows being appended")
    with pytest.raises(ParquetFormatError, match="still being written"):
        dataset.batch(range(10))


@pytest.mark.parametrize("read_mode", ["pyarrow", "pread"])
def test_file_truncated_after_its_first_batch_is_a_typed_error_of_a_later_batch(tmp_path, read_mode):
    """The size check before each decode: the row groups not decoded yet are a typed error of
    their own batch, never rows of a shorter file. The truncation waits for the decodes in
    flight (read ahead) so that it is the check, not a short read, that is tested."""
    path = write(every_type(400), tmp_path / "t.parquet", row_group_size=100)
    dataset = ParquetDataset(path, threads=1, read_mode=read_mode, cache_bytes=1)
    assert len(dataset.batch(range(100))["i8"]) == 100
    cache = dataset._reader()
    deadline = time.monotonic() + 10
    while cache.running and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
    with pytest.raises(ParquetFormatError, match="still being written") as info:
        dataset.batch(range(300, 400))
    assert info.value.path == path and info.value.row_group == 3
    dataset.close()


def test_nulls_the_statistics_did_not_report_are_an_error_not_garbage(tmp_path):
    table = pa.table({"x": pa.array([1, None, 3] * 100, pa.int64())})
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, write_statistics=False)
    assert ParquetDataset(path).keys() == ["x", "x__valid"]  # no statistics: a mask
    with pytest.raises(ParquetDecodeError, match="nulls"):
        ParquetDataset(path, masks="never").batch(range(3))


def test_a_column_chunk_of_another_physical_type_is_a_footer_error_not_an_abort(tmp_path):
    """Found by the fuzz: pyarrow aborts the process (an exception thrown out of
    ``ColumnChunkMetaData``) when a chunk's physical type is not its column's. The footer check
    refuses it first, naming the row group and column."""
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"i": pa.array(np.arange(100))}), path, row_group_size=50)
    data = bytearray(open(path, "rb").read())
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    # ColumnChunk field 3 (the metadata struct), then its field 1 (type): INT64 (zigzag 4) -> INT96
    at = data.index(b"\x1c\x15\x04", footer_start) + 2
    data[at] = 0x06
    open(path, "wb").write(bytes(data))
    with pytest.raises(ParquetFormatError, match="physical type") as info:
        ParquetDataset(path)
    assert (info.value.row_group, info.value.column) == (0, "i")


@pytest.mark.parametrize("arena", [False, True], ids=["pyarrow", "arena"])
def test_fuzzed_footer_and_page_bytes_never_crash_the_process(tmp_path, arena):
    """Run in a subprocess, so a crash in pyarrow's parser (found so: an abort on a level
    histogram of the wrong length) fails this test instead of killing the run. ``arena``: the
    same through the pinned decode arena's C++ (torch_fastload._arrow)."""
    if arena:
        from torch_fastload.sources import parquet_arena

        if parquet_arena.unavailable_reason() is not None:
            pytest.skip(f"torch_fastload._arrow is not built: {parquet_arena.unavailable_reason()}")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for seed in (0, 1):
        res = subprocess.run(
            [sys.executable, os.path.join(REPO, "tests", "fuzz_parquet.py"), "--seed", str(seed), "--seconds", "8"]
            + (["--arena"] if arena else []),
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        assert "failures=0" in res.stdout and "typed error" in res.stdout


def test_typed_errors_are_parquet_errors():
    assert issubclass(ParquetDecodeError, ParquetFormatError) and issubclass(ParquetSchemaError, ParquetError)
    assert issubclass(ParquetError, ValueError)


# -- GPU delivery ------------------------------------------------------------------------
@pytest.mark.cuda
def test_gpu_batches_equal_the_cpu_batches(tmp_path):
    path = write(every_type(2000), tmp_path / "t.parquet", row_group_size=300)
    dataset = ParquetDataset(path)
    sampler = ParquetSampler(dataset, seed=2)
    cpu = list(DataLoader(dataset, batch_size=256, sampler=sampler, device="cpu"))
    gpu = list(DataLoader(dataset, batch_size=256, sampler=sampler, device="cuda"))
    assert len(gpu) == len(cpu)
    for a, b in zip(gpu, cpu):
        assert all(t.device.type == "cuda" for t in a.values())
        assert_same(a, b)


@pytest.mark.cuda
def test_gpu_in_order_batches_across_row_groups_equal_read_table(tmp_path):
    test_in_order_batches_across_row_groups_are_copied_once_and_equal_read_table(tmp_path, 70, device="cuda")


def test_readme_example_as_a_user_runs_it(tmp_path):
    """README's Parquet example (on the CPU, two epochs): a dict of tensors, strings as bytes + offsets."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from parquet_data import write_alert  # the alert table the benchmark reads

    path = write_alert(tmp_path, 5000, "snappy", 1024)
    dataset = ParquetDataset(path, columns=["device_id", "created_at", "severity", "resolved"])
    sampler = ParquetSampler(dataset, seed=0, shuffle_rows=1 << 16)
    loader = DataLoader(dataset, batch_sampler=sampler.batches(2048), device="cpu")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        rows = 0
        for batch in loader:
            ids, offsets = batch["device_id"], batch["device_id__offsets"]
            assert offsets[-1] == len(ids) and batch["created_at"].dtype == torch.int64
            rows += len(offsets) - 1
        assert rows == 5000
    assert dataset.units["created_at"] == "us"


@pytest.mark.cuda
def test_gpu_corrupt_page_is_raised_by_its_own_next(tmp_path):
    table = pa.table({"a": pa.array(np.arange(1000)), "b": pa.array([f"s{i}" for i in range(1000)])})
    path = write(table, tmp_path / "t.parquet", compression="none", row_group_size=100)
    _corrupt_page(path, "b", 2)
    dataset = ParquetDataset(path, threads=2)
    it = iter(DataLoader(dataset, batch_size=100, sampler=ParquetSampler(dataset, shuffle=False), device="cuda"))
    assert [int(next(it)["a"][0]) for _ in range(2)] == [0, 100]
    with pytest.raises(ParquetDecodeError) as info:
        next(it)
    assert (info.value.row_group, info.value.column) == (2, "b")


def test_batches_never_import_pandas(tmp_path):
    """pyarrow imports pandas, where it is installed, from ``pa.array``/``pa.scalar`` (a boolean
    column's ``fill_null``, a shuffled batch's take indices): a fraction of a second holding
    the GIL inside a user's first epoch. A stand-in ``pandas`` that records its import (and
    refuses it) must stay untouched by range, shuffled and loader batches with nullable and
    plain booleans. Before the numpy bit unpack both batch kinds imported it."""
    rng = np.random.default_rng(0)
    n = 3000
    table = pa.table(
        {
            "flag": pa.array(rng.random(n) < 0.5, mask=rng.random(n) < 0.2),
            "plain": pa.array(rng.random(n) < 0.5),
            "x": pa.array(np.arange(n)),
            "s": pa.array([f"v{i}" for i in range(n)]),
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=700)
    fake = tmp_path / "fake" / "pandas"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os\nopen(os.environ['PANDAS_MARKER'], 'a').write('imported')\nraise ImportError('blocked')\n"
    )
    marker = tmp_path / "marker"
    script = f"""
import numpy as np, torch
from torch_fastload import DataLoader
from torch_fastload.sources import ParquetDataset, ParquetSampler
ds = ParquetDataset({str(path)!r}, masks="always")
ranged = ds.batch(np.arange(100, 1600))
shuffled = ds.batch(np.random.default_rng(0).permutation({n})[:2000])
rows = sum(len(b["x"]) for b in DataLoader(ds, batch_sampler=ParquetSampler(ds, shuffle=True).batches(512)))
assert rows == {n}, rows
print(int(ranged["flag"].sum()), int(shuffled["plain"].sum()))
"""
    path_dirs = [str(fake.parent), REPO, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PANDAS_MARKER=str(marker), PYTHONPATH=os.pathsep.join(path_dirs))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "pandas was imported by a batch"
    flag = table.column("flag").to_pylist()
    want = sum(bool(v) for v in flag[100:1600])
    assert int(done.stdout.split()[0]) == want


def test_batches_handed_to_user_code_never_alias_the_loaders_registered_memory(tmp_path):
    """``dataset.batch()`` (and ``__getitem__``) copy out tensors that lie in a direct region (the
    pinned arena, the gather region a CUDA loader registers): the loader reuses that memory, and
    a user's non-blocking copy of a view of it could read bytes rewritten under it. Here the
    gather region is declared direct by hand (no GPU): shuffled rows land in it, the batch does
    not; without the region, the gathered buffers are handed over as they are."""
    _C = pytest.importorskip("torch_fastload._C")
    from torch_fastload.staging import add_direct_region, remove_direct_region

    table = every_type(600)
    path = write(table, tmp_path / "t.parquet", row_group_size=600)
    dataset = ParquetDataset(path, threads=2)
    rows = np.random.default_rng(0).permutation(600)[:100]
    base, size = _C.gathered_region(64 << 20)  # the process's region (later tests' gathers carve it too)
    inside = lambda t: base <= t.data_ptr() < base + size  # noqa: E731
    raw = dataset.__fastload_batch__(rows)
    assert any(isinstance(v, torch.Tensor) and inside(v) for v in raw.values())  # gathered into the region
    del raw
    add_direct_region(base, size)
    try:
        batch = dataset.batch(rows)
    finally:
        remove_direct_region(base, size)
    assert not any(inside(v) for v in batch.values())
    assert_equals_take(dataset, pq.read_table(path), rows)
    dataset.close()


def test_the_gather_runs_on_parquet_gather_threads(tmp_path, monkeypatch):
    """``parquet_gather_threads`` sets the C++ gather's threads (0: the dataset's, at most 16)."""
    pytest.importorskip("torch_fastload._C")
    from torch_fastload import config
    from torch_fastload.sources import parquet_tensors

    path = write(every_type(300), tmp_path / "t.parquet", row_group_size=300)
    dataset = ParquetDataset(path, threads=40)
    widths = []
    inner = parquet_tensors._gather_rows
    monkeypatch.setattr(parquet_tensors, "_gather_rows", lambda *a: widths.append(a[-1]) or inner(*a))
    rows = np.arange(300)[::-1].copy()
    dataset.batch(rows)
    with config.override(parquet_gather_threads=3):
        dataset.batch(rows)
    assert widths == [16, 3]
    dataset.close()
