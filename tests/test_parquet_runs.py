"""ParquetSampler orders without a per-row array of the epoch: an epoch whose rows keep their
file order is drawn as runs of row groups, and a batch inside consecutive rows is a ``range``
that ParquetDataset reads as slices; a windowed shuffle builds only the windows of the batch
drawn. The per-row order (built, searched and checked row by row) had cost an 8-byte column's
epoch more than its decode, all before the first batch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_loader import assert_same

from torch_fastload import DataLoader
from torch_fastload.sources import ParquetDataset, ParquetSampler
from torch_fastload.sources.parquet_order import WindowedOrder
from torch_fastload.sources.parquet_sampler import first_seen_groups


def _file(tmp_path, rows: int = 1000, row_group_size: int = 100) -> str:
    path = str(tmp_path / "t.parquet")
    table = pa.table({"x": pa.array(np.arange(rows, dtype=np.int64)), "y": pa.array(np.arange(rows) * 0.5)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _no_per_row_order(monkeypatch) -> None:
    """Fail any call that builds the epoch's order row by row."""

    def refuse(self):
        raise AssertionError("the epoch's order was built row by row")

    monkeypatch.setattr(ParquetSampler, "global_order", refuse)
    monkeypatch.setattr(ParquetSampler, "indices", refuse)


def test_an_unshuffled_epoch_is_read_as_ranges_with_no_array_of_every_row(tmp_path, monkeypatch):
    """Negative control: the old sampler built ``global_order()`` and yielded int64 arrays."""
    path = _file(tmp_path, rows=1000, row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    batches = ParquetSampler(dataset, shuffle=False).batches(300)
    _no_per_row_order(monkeypatch)
    drawn = list(batches)
    assert drawn == [range(0, 300), range(300, 600), range(600, 900), range(900, 1000)]
    assert dataset._schedule.tolist() == list(range(11))  # the read-ahead knows every row group
    reference = pq.read_table(path)
    ours = list(DataLoader(dataset, batch_sampler=batches, device="cpu"))
    assert len(ours) == 4
    for k, batch in enumerate(ours):
        rows = reference.slice(300 * k, 300)
        assert torch.equal(batch["x"], torch.from_numpy(rows.column("x").to_numpy()))
        assert torch.equal(batch["y"], torch.from_numpy(rows.column("y").to_numpy()))
    assert_same(list(torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=dataset.collate)), ours)
    dataset.close()


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("batch_size", [1, 37, 100, 250, 1000])
def test_row_group_shuffled_batches_equal_the_per_row_order(tmp_path, ranks, batch_size):
    """Row groups shuffled, rows kept in order (``shuffle_rows=1``): the batches, cut into runs
    and across them, hold the rows of the per-row order, and the read-ahead schedule is the one
    it gave."""
    path = _file(tmp_path, rows=1000, row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    for rank in range(ranks):
        sampler = ParquetSampler(dataset, seed=4, shuffle_rows=1, num_replicas=ranks, rank=rank)
        sampler.set_epoch(2)
        want = sampler.indices()
        batches = list(sampler.batches(batch_size))
        assert np.array_equal(np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]), want)
        assert all(isinstance(b, (range, np.ndarray)) for b in batches)
        assert dataset._schedule.tolist() == first_seen_groups(dataset.plan.starts, want).tolist()
        assert np.array_equal(sampler.begin(), want) and list(sampler) == want.tolist()
        for b in batches[:3]:
            rows = np.asarray(b, dtype=np.int64)
            assert torch.equal(dataset.batch(b)["x"], torch.from_numpy(rows))
    dataset.close()


def test_a_windowed_shuffle_builds_only_the_windows_of_the_batch_drawn(tmp_path, monkeypatch):
    """Negative control: the old sampler permuted every window of the epoch in ``begin()``."""
    path = _file(tmp_path, rows=1000, row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    built = []
    window = WindowedOrder._window
    monkeypatch.setattr(WindowedOrder, "_window", lambda self, k: built.append(k) or window(self, k))
    sampler = ParquetSampler(dataset, seed=1, shuffle_rows=50)
    first = next(iter(sampler.batches(128)))
    assert sorted(set(built)) == [0, 1, 2] and len(first) == 128  # positions 0..127 only
    dataset.close()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_windowed_shuffles_permute_each_window_and_read_every_row_once(tmp_path, ranks):
    path = _file(tmp_path, rows=1000, row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    shares = []
    for rank in range(ranks):
        sampler = ParquetSampler(dataset, seed=1, shuffle_rows=50, num_replicas=ranks, rank=rank)
        sampler.set_epoch(3)
        mine = sampler.indices()
        assert np.array_equal(np.concatenate(list(sampler.batches(128))), mine)
        assert np.array_equal(sampler.begin(), mine) and list(sampler) == mine.tolist()
        shares.append(mine)
    order = sampler.global_order()
    assert np.array_equal(np.concatenate(shares), order)
    in_file_order = sampler.global_runs().rows()
    for k in range(0, 1000, 50):  # each window holds the rows of its positions, permuted
        assert sorted(order[k : k + 50].tolist()) == sorted(in_file_order[k : k + 50].tolist())
    assert not np.array_equal(order, in_file_order) and sorted(order.tolist()) == list(range(1000))
    sampler.set_epoch(4)
    assert not np.array_equal(sampler.global_order(), order)  # another epoch, another order
    dataset.close()


def test_padded_ranks_repeat_their_own_first_rows(tmp_path):
    path = _file(tmp_path, rows=1000, row_group_size=96)
    dataset = ParquetDataset(path, threads=2)
    shares = []
    for rank in range(3):
        padded = ParquetSampler(dataset, shuffle=False, num_replicas=3, rank=rank, even=True)
        mine = padded.indices()
        assert len(mine) == 334 and np.array_equal(np.concatenate(list(padded.batches(100))), mine)
        shares.append(mine)
    assert shares[0][-1] == shares[0][0] and shares[1][-1] == shares[1][0]  # 333 rows each, padded
    assert sorted(set(np.concatenate(shares).tolist())) == list(range(1000))
    dataset.close()


def test_a_range_of_rows_is_read_as_slices_and_checked(tmp_path):
    path = _file(tmp_path, rows=500, row_group_size=64)
    dataset = ParquetDataset(path, threads=2)
    assert torch.equal(dataset.batch(range(60, 200))["x"], torch.arange(60, 200))
    assert dataset.batch(range(7, 7))["x"].numel() == 0
    assert torch.equal(dataset.batch(range(10, 0, -3))["x"], torch.tensor([10, 7, 4, 1]))
    with pytest.raises(IndexError):
        dataset.batch(range(450, 501))
    dataset.close()


def test_exact_resume_of_an_unshuffled_epoch(tmp_path):
    path = _file(tmp_path, rows=900, row_group_size=100)

    def loader():
        dataset = ParquetDataset(path)
        batches = ParquetSampler(dataset, shuffle=False).batches(64)
        return DataLoader(dataset, batch_sampler=batches, device="cpu")

    full = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert_same(head + list(resumed), full)
