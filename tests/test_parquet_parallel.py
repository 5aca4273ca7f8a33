"""fetch_threads > 1 on the Parquet source: several batches fetched at once (each waits for its
row groups to decode), delivered in order, and a checkpoint counts exactly the rows delivered
however the fetches finished."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import torch
from test_loader import assert_same
from test_parquet import every_type, write

from torch_fastload import DataLoader
from torch_fastload.resume import batch_key
from torch_fastload.sources import ParquetDataset, ParquetSampler


def _slowed(dataset: ParquetDataset, seen: dict) -> None:
    """Each batch's fetch held back, the earlier of every three the longest: with three fetch
    threads, later batches finish first."""
    fetch = dataset.__fastload_batch__
    lock = threading.Lock()

    def slow(indices):
        key = batch_key()
        with lock:
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
            seen["threads"].add(threading.current_thread().name)
        time.sleep(0.01 * (3 - (key.number % 3 if key is not None else 0)))
        try:
            return fetch(indices)
        finally:
            with lock:
                seen["running"] -= 1

    dataset.__fastload_batch__ = slow


def _loader(path, fetch_threads: int, seen: dict | None = None) -> DataLoader:
    dataset = ParquetDataset(path, threads=2)
    if seen is not None:
        _slowed(dataset, seen)
    batches = ParquetSampler(dataset, seed=4, shuffle_rows=200).batches(64)
    batches.set_epoch(1)
    return DataLoader(dataset, batch_sampler=batches, device="cpu", fetch_threads=fetch_threads)


def test_fetch_threads_fetch_batches_at_once_and_deliver_them_in_order(tmp_path):
    path = write(every_type(900), tmp_path / "t.parquet", row_group_size=100)
    one = list(_loader(path, 1))
    seen = {"running": 0, "most": 0, "threads": set()}
    three = list(_loader(path, 3, seen))
    assert len(one) == 15
    assert_same(three, one)
    assert seen["most"] >= 2 and len(seen["threads"]) >= 2  # really at once, on several threads


def test_a_checkpoint_counts_the_rows_delivered_when_later_batches_were_fetched_first(tmp_path):
    path = write(pa.table({"x": pa.array(range(900))}), tmp_path / "t.parquet", row_group_size=100)
    full = list(_loader(path, 1))
    seen = {"running": 0, "most": 0, "threads": set()}
    first = _loader(path, 3, seen)
    it = iter(first)
    head = [next(it) for _ in range(14)]  # the 15th (4 rows) was fetched, before the 14th finished
    assert first.dataset._delivered == 14 * 64
    resumed = _loader(path, 3)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert_same(head + rest, full)
    assert len(rest) == 1 and torch.equal(rest[0]["x"], full[-1]["x"])
