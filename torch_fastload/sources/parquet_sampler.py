"""The order of a Parquet epoch: row groups shuffled, rows permuted within a bounded window,
split among ranks by rows; and its batches as numpy slices for the loader's ``batch_sampler``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Sampler

from .parquet_order import RowRuns, WindowedOrder

if TYPE_CHECKING:
    from .parquet import ParquetDataset

__all__ = ["ParquetSampler", "ParquetBatchSampler"]


class ParquetSampler(Sampler[int]):
    """Row order of one epoch of a ``ParquetDataset``: row groups in a seeded order (``seed +
    epoch``, as ``DistributedSampler``), rows permuted within windows of ``shuffle_rows``
    consecutive rows of that order (a shuffle buffer that keeps only a few row groups decoded),
    then split among ``num_replicas`` ranks in contiguous runs balanced by rows: rank ``r``
    reads rows ``[r * N // W, (r + 1) * N // W)`` of the order, so each rank decodes its own
    row groups (two at most are shared at its edges) and every row is read once per epoch.

    ``even=True`` pads the shorter ranks with their own first row so all ranks have the same
    length (as ``DistributedSampler``: DDP needs equal batch counts); rows then differ by at
    most one across ranks. Call ``set_epoch`` every epoch; a checkpointed epoch resumes
    exactly (the loader's ``state_dict``) after ``set_epoch`` of the checkpoint's epoch.
    """

    def __init__(
        self,
        dataset: ParquetDataset,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_rows: int = 1 << 16,
        num_replicas: int | None = None,
        rank: int | None = None,
        even: bool = False,
    ):
        if num_replicas is None or rank is None:
            from ..distributed import world

            world_size, world_rank = world()
            num_replicas = world_size if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_rows = max(1, int(shuffle_rows))
        self.num_replicas = num_replicas
        self.rank = rank
        self.even = even
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _bounds(self) -> tuple[int, int]:
        n, w, r = len(self.dataset), self.num_replicas, self.rank
        return r * n // w, (r + 1) * n // w

    def __len__(self) -> int:
        lo, hi = self._bounds()
        return math.ceil(len(self.dataset) / self.num_replicas) if self.even else hi - lo

    def global_order(self) -> np.ndarray:
        """Every row of the epoch in order, before the split among ranks (world-size free)."""
        n = len(self.dataset)
        return self._windowed(0, n, n).rows()

    def indices(self) -> np.ndarray:
        """This rank's rows of the epoch, in order."""
        return self.order().rows()

    def order(self) -> RowRuns | WindowedOrder:
        """This rank's order, with no array of every row: ``RowRuns`` where rows keep their
        file order within row groups and no rank is padded, else a ``WindowedOrder``."""
        lo, hi = self._bounds()
        if (self.shuffle and self.shuffle_rows > 1) or len(self) != hi - lo:
            return self._windowed(lo, hi, len(self))
        return self.global_runs().part(lo, hi)

    def _windowed(self, lo: int, hi: int, length: int) -> WindowedOrder:
        window = self.shuffle_rows if self.shuffle else 1
        return WindowedOrder(self.global_runs(), window, self.seed, self.epoch, lo, hi, length)

    def global_runs(self) -> RowRuns:
        """Every row of the epoch as row groups in order (before the split among ranks)."""
        rows = self.dataset.row_group_rows
        groups = np.arange(len(rows))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            groups = torch.randperm(len(rows), generator=generator).numpy()
        return RowRuns(self.dataset.plan.starts[:-1][groups], rows[groups], groups)

    def settings(self) -> dict:
        """What decides this rank's order: a resumed epoch must draw with the same."""
        keys = ("shuffle", "seed", "shuffle_rows", "num_replicas", "rank", "even", "epoch")
        return dict({k: getattr(self, k) for k in keys}, rows=len(self))

    def __iter__(self):
        return iter(self.begin().tolist())

    def begin(self) -> np.ndarray:
        """This rank's rows of the epoch, drawn now (on the thread calling ``iter()``)."""
        return self.begin_order().rows()

    def begin_order(self) -> RowRuns | WindowedOrder:
        """This rank's order (``order()``), drawn now: a checkpoint's settings are checked and
        the row groups' order handed to the dataset's read-ahead. No row is worked out here:
        a batch's rows are, when the batch is drawn."""
        self._check_resume()
        order = self.order()
        self.dataset._set_schedule(order.groups)
        return order

    def _check_resume(self) -> None:
        settings = self.settings()
        saved, self.dataset._resume = self.dataset._resume, None
        self.dataset._fetched.clear()
        self.dataset._delivered = 0
        if saved is not None:
            self.dataset._delivered = saved["rows_delivered"]  # the rows before the checkpoint
            differ = {k: (saved.get(k), v) for k, v in settings.items() if k != "rows" and saved.get(k) != v}
            if differ:
                from ..resume import ResumeError

                raise ResumeError(
                    "the checkpointed Parquet epoch was drawn with other sampler settings "
                    + ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in differ.items())
                    + " (call set_epoch with the checkpoint's epoch; the world size must be the same)"
                )
        self.dataset._epoch = settings

    def batches(self, batch_size: int, drop_last: bool = False) -> ParquetBatchSampler:
        """A ``batch_sampler`` over this order whose batches are ranges or numpy arrays (no
        per-row Python)."""
        return ParquetBatchSampler(self, batch_size, drop_last)


def first_seen_groups(starts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The row groups of ``rows`` in the order each is first read. Only the rows where the row
    group changes are sorted (a row group's first row always is one): sorting every row of a
    4M-row epoch took longer than reading its first row groups."""
    groups = np.searchsorted(starts, rows, side="right") - 1
    if not len(groups):
        return groups
    changes = groups[np.concatenate(([0], np.flatnonzero(groups[1:] != groups[:-1]) + 1))]
    _, first = np.unique(changes, return_index=True)
    return changes[np.sort(first)]


class ParquetBatchSampler(Sampler):
    """Batches of ``ParquetSampler``'s order: pass as the loader's ``batch_sampler`` (torch's
    ``BatchSampler`` would build a Python list of every row). A batch is a ``range`` where its
    rows are consecutive in the files (``ParquetDataset`` reads it as slices, with no array of
    its rows), else an int64 numpy array."""

    def __init__(self, sampler: ParquetSampler, batch_size: int, drop_last: bool = False):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        # drawn now, on the thread calling iter() (torch's DataLoader draws its sampler there
        # too): a loader bound to the dataset starts decoding the epoch's first row groups
        # before its own threads run
        order = self.sampler.begin_order()
        return self._batches(order)

    def _batches(self, order):
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield order[start : start + self.batch_size]
