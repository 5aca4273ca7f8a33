"""Batches of consecutive rows cut from each decoded row group's tensors (made once, on the
decode thread) equal pyarrow's own values, with the Arrow route's errors and keys."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_parquet import every_type, expected, write

from torch_fastload.errors import ParquetDecodeError
from torch_fastload.sources import ParquetDataset
from torch_fastload.sources.parquet_decode import DecodedRowGroup
from torch_fastload.staging import PendingConcat


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
