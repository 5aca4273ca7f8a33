"""Batches of consecutive rows cut from each decoded row group's tensors (made once, on the
decode thread) equal pyarrow's own values, with the Arrow route's errors and keys."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_parquet import every_type, expected, write

import torch_fastload.sources.parquet as parquet_module
from torch_fastload import DataLoader
from torch_fastload.errors import ParquetDecodeError
from torch_fastload.sources import ParquetDataset, ParquetSampler
from torch_fastload.sources.parquet_decode import DecodedRowGroup
from torch_fastload.sources.parquet_tensors import can_plan_ranges, planned_range
from torch_fastload.staging import ALIGN, PendingConcat, PendingOffsets, PlannedBatch, materialize


@pytest.mark.parametrize("masks", ["auto", "always"])
def test_consecutive_rows_cut_from_prepared_row_groups_equal_read_table(tmp_path, masks):
    path = write(every_type(1000), tmp_path / "t.parquet", row_group_size=96)
    dataset = ParquetDataset(path, threads=2, masks=masks)
    reference = pq.read_table(path)
    for first, stop in [(0, 1), (5, 96), (90, 200), (95, 97), (191, 480), (999, 1000), (0, 1000)]:
        batch = dataset.batch(range(first, stop))
        assert set(batch) == set(dataset.keys()), (first, stop)
        rows = reference.slice(first, stop - first)
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                assert batch[key].dtype == want.dtype and torch.equal(batch[key], want), (first, stop, key)
    plans = dataset.__fastload_batch__(range(90, 200))  # three row groups: one piece each, copied once
    assert isinstance(plans["name"], PendingConcat) and len(plans["name"].tensors) == 3
    assert list(plans) == dataset.keys()  # the keys in the Arrow route's order
    decoded = dataset._reader().get([0])[0]
    assert isinstance(decoded, DecodedRowGroup)
    assert all(column is not None for column in decoded.columns)  # every column took the prepared route
    dataset.close()


def test_nulls_unreported_are_an_error_only_for_the_batches_that_hold_them(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"x": pa.array([1, None, 3] * 100, pa.int64())}), path, write_statistics=False)
    dataset = ParquetDataset(path, masks="never")
    assert torch.equal(dataset.batch(range(1))["x"], torch.tensor([1]))  # its row group has nulls, its rows none
    with pytest.raises(ParquetDecodeError, match="column 'x': holds nulls"):
        dataset.batch(range(0, 3))


def test_list_values_with_nulls_go_through_arrow_and_fail_only_their_batch(tmp_path):
    values = [[1, 2], [3], [4, 5]] * 10 + [[6, None]] + [[7]] * 9  # the null element in row group 1
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"tags": pa.array(values, pa.list_(pa.int64()))}), path, row_group_size=30)
    dataset = ParquetDataset(path)
    batch = dataset.batch(range(2, 30))
    assert batch["tags"].tolist() == [x for v in values[2:30] for x in v]
    assert batch["tags__offsets"].tolist() == np.concatenate([[0], np.cumsum([len(v) for v in values[2:30]])]).tolist()
    with pytest.raises(ParquetDecodeError, match="null elements"):
        dataset.batch(range(28, 33))
    cache = dataset._reader()
    assert cache.get([0])[0].columns[0] is not None and cache.get([1])[0].columns[0] is None
    dataset.close()


# -- the C++ planner of consecutive rows (a loader's route: ``planned_range``) ------------------
needs_planner = pytest.mark.skipif(not can_plan_ranges(), reason="the extension's range planner is not built")


def _planned(monkeypatch) -> list:
    """Records, per range batch a loader fetched, whether the C++ planner took it."""
    made = []
    inner = parquet_module.planned_range

    def spy(*args, **kwargs):
        batch = inner(*args, **kwargs)
        made.append(isinstance(batch, PlannedBatch))
        return batch

    monkeypatch.setattr(parquet_module, "planned_range", spy)
    return made


@needs_planner
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("masks", ["auto", "always"])
def test_a_loader_plans_consecutive_rows_in_c_with_the_python_routes_batches(tmp_path, monkeypatch, masks, device):
    """Every batch of a loader over consecutive rows (across row groups: 150 rows of groups of 96)
    is planned by one C++ call and equals pyarrow's values and the Python route's batch exactly
    (keys, order, dtypes, shapes); with ``parquet_range_plan`` off no batch is planned."""
    path = write(every_type(1000), tmp_path / "t.parquet", row_group_size=96)
    made = _planned(monkeypatch)
    dataset = ParquetDataset(path, threads=2, masks=masks)
    planned = [{k: v.cpu() for k, v in b.items()} for b in DataLoader(dataset, batch_size=150, device=device)]
    assert len(made) == len(planned) == 7 and all(made)
    reference = pq.read_table(path)
    for k, batch in enumerate(planned):
        assert list(batch) == dataset.keys()
        rows = reference.slice(k * 150, 150)
        for spec in dataset.plan.columns:
            for key, want in expected(rows, spec.name, spec.masked).items():
                assert batch[key].dtype == want.dtype and torch.equal(batch[key], want), (k, key)
    monkeypatch.setenv("TORCH_FASTLOAD_PARQUET_RANGE_PLAN", "0")
    made.clear()
    python = [{k: v.cpu() for k, v in b.items()} for b in DataLoader(dataset, batch_size=150, device=device)]
    assert not made and len(python) == len(planned)
    for ours, theirs in zip(planned, python):
        assert list(ours) == list(theirs)
        for key in ours:
            assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape
            assert torch.equal(ours[key], theirs[key]), key
    dataset.close()


@needs_planner
def test_unreported_nulls_fail_only_the_planned_batch_that_holds_them(tmp_path, monkeypatch):
    """masks='never' on a column whose footer reports no nulls: the batch whose rows hold one is
    raised by its own next(), naming the file, row group and column; the batches around it are
    delivered whole."""
    values = list(range(600))
    values[250] = None
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"x": pa.array(values, pa.int64())}), path, row_group_size=100, write_statistics=False)
    made = _planned(monkeypatch)
    dataset = ParquetDataset(path, masks="never")
    it = iter(DataLoader(dataset, batch_size=120, device="cpu"))
    assert [next(it)["x"][0].item() for _ in range(2)] == [0, 120]
    with pytest.raises(ParquetDecodeError, match="holds nulls") as info:
        next(it)
    assert (info.value.path, info.value.row_group, info.value.column) == (path, 2, "x")
    rest = [batch["x"] for batch in it]
    assert [int(x[0]) for x in rest] == [360, 480] and torch.equal(torch.cat(rest), torch.arange(360, 600))
    assert made[:2] == [True, True]
    dataset.close()


def _descriptor(offsets, values: np.ndarray, elem: int, rows: int, valid=None) -> np.ndarray:
    return np.array(
        [
            offsets.ctypes.data if offsets is not None else 0,
            offsets.itemsize if offsets is not None else 0,
            values.ctypes.data,
            values.nbytes,
            elem,
            rows,
            valid.ctypes.data if valid is not None else 0,
        ],
        dtype=np.int64,
    )


@needs_planner
def test_the_planner_lays_out_rebases_and_masks_like_the_python_route():
    """Two row groups of a string column (int32 and int64 offsets) and a masked int64 column, the
    second without nulls: offsets rebased onto one another from 0, masks ones where no nulls,
    fields ALIGN-ed; write_host gives the same bytes as the Python route's materialised batch."""
    from torch_fastload import _C

    a_values, a_offsets = np.frombuffer(b"abcdefghij", np.uint8).copy(), np.array([0, 2, 5, 9, 10], np.int32)
    b_values, b_offsets = np.frombuffer(b"KLMNO", np.uint8).copy(), np.array([0, 1, 3, 5], np.int64)
    a_ints, b_ints = np.arange(4, dtype=np.int64), np.arange(10, 13, dtype=np.int64)
    a_valid = np.array([1, 0, 1, 1], dtype=bool)
    groups = [
        np.concatenate([_descriptor(a_offsets, a_values, 1, 4), _descriptor(None, a_ints, 8, 4, a_valid)]),
        np.concatenate([_descriptor(b_offsets, b_values, 1, 3), _descriptor(None, b_ints, 8, 3)]),
    ]
    plan = _C.plan_range(groups, [0, 1, 4, 1, 0, 2], [0, 1], ALIGN, np.zeros(0, np.int64))
    assert plan.rows == 5 and plan.bad_column == -1 and plan.direct_bytes == 0
    fields = plan.fields
    assert [f[0] % ALIGN for f in fields] == [0, 0, 0, 0]
    assert [(f[1], f[2]) for f in fields] == [(8 + 3, 11), (6 * 8, 6), (5 * 8, 5), (5, 5)]
    flat = torch.zeros(plan.total, dtype=torch.uint8)
    plan.write_host(flat.data_ptr())
    batch = PlannedBatch(
        plan,
        ["s", "s__offsets", "n", "n__valid"],
        [torch.uint8, torch.int64, torch.int64, torch.bool],
        [(), (), (), ()],
        keep=[],
    ).unpack(flat)
    assert bytes(batch["s"].numpy()) == b"cdefghij" + b"KLM"
    assert batch["s__offsets"].tolist() == [0, 3, 7, 8, 9, 11]
    assert batch["n"].tolist() == [1, 2, 3, 10, 11] and batch["n__valid"].tolist() == [False, True, True, True, True]
    # the same rows in the Python route's pieces, joined
    want_offsets = PendingOffsets([a_offsets, b_offsets], [1, 1], [4, 2], [-2, 8 - 0]).join()
    assert torch.equal(batch["s__offsets"], want_offsets)


@needs_planner
def test_the_planner_refuses_rows_and_offsets_outside_a_row_group_naming_the_column():
    """Rows past a row group's end, offsets past its values and offsets that run backwards (a
    corrupt page) raise RangeError naming the column's position and row group; nothing is planned.
    The dataset's route turns it into a ParquetDecodeError naming the column."""
    from torch_fastload import _C

    values = np.frombuffer(b"abcdefghij", np.uint8).copy()
    ints = np.arange(3, dtype=np.int64)
    none = np.zeros(0, np.int64)

    def plan(offsets, spans):
        group = np.concatenate([_descriptor(None, ints, 8, 3), _descriptor(offsets, values, 1, 3)])
        return _C.plan_range([group], spans, [0, 0], ALIGN, none)

    good = np.array([0, 2, 4, 10], np.int32)
    assert plan(good, [0, 0, 3]).rows == 3
    with pytest.raises(_C.RangeError, match=r"column #0, rows \[1, 4\) of row group #0: outside its 3 rows"):
        plan(good, [0, 1, 4])
    with pytest.raises(_C.RangeError, match=r"column #1.*leave the values"):
        plan(np.array([0, 2, 4, 11], np.int32), [0, 0, 3])
    with pytest.raises(_C.RangeError, match=r"column #1.*run backwards"):
        plan(np.array([0, 5, 4, 6], np.int32), [0, 1, 2])
    with pytest.raises(ValueError, match="spans must not be empty"):
        plan(good, [0, 2, 2])

    class Group:  # a decoded row group's descriptor as the decode thread makes it
        ranged = (
            np.concatenate(
                [_descriptor(None, ints, 8, 3), _descriptor(np.array([0, 2, 4, 11], np.int32), values, 1, 3)]
            ),
            (),
        )

    specs = [type("Spec", (), {"name": name, "masked": False})() for name in ("n", "s")]
    with pytest.raises(ParquetDecodeError, match="leave the values") as info:
        planned_range("f.parquet", specs, [(Group(), 0, 3)], none, [7])
    assert (info.value.path, info.value.row_group, info.value.column) == ("f.parquet", 7, "s")


@needs_planner
def test_a_planned_batch_outside_the_one_call_stage_is_materialized():
    """``staging.materialize`` of a PlannedBatch writes it out as its dict (an engine without the
    one-call stage, and user code given one, take that route)."""
    from torch_fastload import _C

    ints = np.arange(6, dtype=np.int64)
    plan = _C.plan_range([_descriptor(None, ints, 16, 3)], [0, 1, 3], [0], ALIGN, np.zeros(0, np.int64))
    batch = materialize(PlannedBatch(plan, ["pairs"], [torch.int64], [(2,)], keep=[]))
    assert list(batch) == ["pairs"] and batch["pairs"].tolist() == [[2, 3], [4, 5]]


@needs_planner
def test_a_dictionary_column_keeps_its_batches_on_the_python_route(tmp_path, monkeypatch):
    """A column delivered as codes + dictionary is not prepared per row group (its dictionary is
    the batch's own): the planner declines those batches and the Python route makes them, equal
    to the dataset's own batch() of the same rows."""
    path = write(every_type(600), tmp_path / "t.parquet", row_group_size=96)
    made = _planned(monkeypatch)
    dataset = ParquetDataset(path, columns=["i32", "name"], dictionary_columns=["name"])
    got = list(DataLoader(dataset, batch_size=150, device="cpu"))
    assert len(made) == len(got) == 4 and not any(made)
    for k, batch in enumerate(got):
        want = dataset.batch(range(k * 150, (k + 1) * 150))
        assert list(batch) == list(want)
        for key in want:
            assert torch.equal(batch[key], want[key]), (k, key)
    dataset.close()


@pytest.mark.parametrize("shuffle_rows", [1, 200], ids=["consecutive", "gathered"])
def test_a_loader_counts_rows_not_the_first_string_columns_bytes(tmp_path, shuffle_rows):
    """``loader.stats()`` and ``state_dict()`` count a Parquet batch's rows
    (``__fastload_samples__``), also where its first field is a string column's bytes: before,
    a shuffled epoch of 1,000 rows counted ~20x as many samples."""
    table = pa.table({"name": pa.array([f"row-{k:05d}-padding" for k in range(1000)]), "x": pa.array(np.arange(1000))})
    path = write(table, tmp_path / "t.parquet", row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    sampler = ParquetSampler(dataset, seed=1, shuffle_rows=shuffle_rows)
    loader = DataLoader(dataset, batch_size=128, sampler=sampler, device="cpu")
    it = iter(loader)
    rows = sum(len(next(it)["x"]) for _ in range(3))
    assert rows == 384 and loader.state_dict()["samples_yielded"] == 384
    rows += sum(len(batch["x"]) for batch in it)
    assert rows == 1000 and loader.stats().samples == 1000
    dataset.close()
