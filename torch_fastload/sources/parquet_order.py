"""An epoch's row order over Parquet row groups, without an array of every row: a batch's rows
are worked out when the batch is drawn. The per-row order of a whole epoch (built, searched and
checked row by row before the first batch) cost an 8-byte column's epoch more than its decode.

``RowRuns``: row groups read one after another, rows in file order (no shuffle, or row groups
shuffled only); a batch inside consecutive rows is a ``range``, read as slices.
``WindowedOrder``: rows also permuted within windows of consecutive positions, each window by
its own seeded generator, so a batch builds only the windows it spans.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RowRuns", "WindowedOrder"]


def _positions(key: slice, length: int) -> tuple[int, int]:
    start, stop, step = key.indices(length)
    if step != 1:
        raise ValueError("an epoch order is sliced with step 1")
    return start, max(start, stop)


class RowRuns:
    """One run of consecutive rows per row group read (``groups``, in order): rows
    ``firsts[k] .. firsts[k] + lengths[k] - 1``. ``order[a:b]``: a ``range`` where positions
    ``a .. b - 1`` are consecutive rows, else their int64 rows (one arange per run)."""

    def __init__(self, firsts: np.ndarray, lengths: np.ndarray, groups: np.ndarray):
        keep = np.asarray(lengths) > 0
        self.firsts = np.asarray(firsts, dtype=np.int64)[keep]
        self.lengths = np.asarray(lengths, dtype=np.int64)[keep]
        self.groups = np.asarray(groups, dtype=np.int64)[keep]
        self.ends = np.cumsum(self.lengths)  # position in the order just after each run
        # runs that continue one another read as one range: where each stretch of them ends
        breaks = np.flatnonzero(self.firsts[1:] != self.firsts[:-1] + self.lengths[:-1])
        self.stretch_ends = np.append(self.ends[breaks], len(self))

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def part(self, lo: int, hi: int) -> RowRuns:
        """Positions ``lo .. hi - 1`` (a rank's share), as runs of the row groups they touch."""
        starts = self.ends - self.lengths
        a, b = np.clip(starts, lo, hi), np.clip(self.ends, lo, hi)
        return RowRuns(self.firsts + (a - starts), b - a, self.groups)

    def __getitem__(self, key: slice) -> range | np.ndarray:
        start, stop = _positions(key, len(self))
        if stop == start:
            return np.zeros(0, dtype=np.int64)
        k = int(np.searchsorted(self.ends, start, side="right"))
        if stop <= int(self.stretch_ends[np.searchsorted(self.stretch_ends, start, side="right")]):
            first = int(self.firsts[k]) + start - (int(self.ends[k]) - int(self.lengths[k]))
            return range(first, first + stop - start)
        pieces = []
        while start < stop:
            end = min(stop, int(self.ends[k]))
            first = int(self.firsts[k]) + start - (int(self.ends[k]) - int(self.lengths[k]))
            pieces.append(np.arange(first, first + end - start, dtype=np.int64))
            start, k = end, k + 1
        return np.concatenate(pieces)

    def rows(self) -> np.ndarray:
        """Every row of the order as int64 (per-row ``iter()``)."""
        return as_rows(self[0 : len(self)])


class WindowedOrder:
    """Positions ``lo .. hi - 1`` of ``runs`` (the epoch's order before the split among ranks)
    with the rows of each window of ``window`` consecutive positions of that order permuted by
    ``numpy.random.default_rng([seed, epoch, window index])`` (``window`` 1: not permuted);
    ``length`` past ``hi - lo`` repeats the share's first rows (``even`` padding)."""

    def __init__(self, runs: RowRuns, window: int, seed: int, epoch: int, lo: int, hi: int, length: int):
        self.runs, self.window, self.seed, self.epoch = runs, max(1, window), seed & (2**63 - 1), epoch
        self.lo, self.share, self.length = lo, hi - lo, length
        self.groups = runs.part(lo, hi).groups
        self._last: tuple[int, np.ndarray] | None = None  # a window shared by two batches is built once

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop = _positions(key, len(self))
        pieces = []
        while start < stop:  # the share, then its first rows again (padding)
            at = start if start < self.share else start - self.share
            end = min(stop, self.share) if start < self.share else stop
            pieces.append(self._global(self.lo + at, self.lo + at + end - start))
            start = end
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    def _global(self, start: int, stop: int) -> np.ndarray:
        if self.window == 1:
            return as_rows(self.runs[start:stop])
        first, last = start // self.window, (stop - 1) // self.window
        rows = np.concatenate([self._window(k) for k in range(first, last + 1)])
        return rows[start - first * self.window : stop - first * self.window]

    def _window(self, k: int) -> np.ndarray:
        if self._last is not None and self._last[0] == k:
            return self._last[1]
        rows = as_rows(self.runs[k * self.window : (k + 1) * self.window])
        rows = rows[np.random.default_rng([self.seed, self.epoch, k]).permutation(len(rows))]
        self._last = (k, rows)
        return rows

    def rows(self) -> np.ndarray:
        return self[0 : len(self)] if len(self) else np.zeros(0, dtype=np.int64)


def as_rows(rows: range | np.ndarray) -> np.ndarray:
    """Rows as an int64 array (a ``range`` built with arange)."""
    if isinstance(rows, range):
        return np.arange(rows.start, rows.stop, dtype=np.int64)
    return rows
