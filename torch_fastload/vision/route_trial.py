"""Which decoder feeds a training run faster, measured on the run itself.

Neither route wins everywhere. On the 16-core H100 machine, decoding every JPEG on the CPU took
a ResNet-50 step from 1.10x to 1.02-1.03x of the device-resident step, because nvJPEG's work
sits beside the step's kernels on the GPU. A ResNet-18 step outruns twelve CPU decode threads
(30.5 ms a step with nvJPEG, 31-43 ms without). Which one a model needs depends on the model,
the GPU and the cores, so ``cpu_decode_share="auto"`` tries both on the run's first batches.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

__all__ = ["RouteTrial"]


class RouteTrial:
    """Gives the CPU share each batch decodes with: the first candidate for ``warmup`` batches
    (a model's first steps are slow: cuDNN autotuning, compilation), then each candidate in turn
    for ``settle`` batches and ``window`` more that are timed, then the faster one for good.

    Two clocks time a route: the starts of decodes (``next_share``) and the batches handed to
    the training loop (``consumed``). The loader's queues hold a few batches between them, so
    over a short window one clock can run fast. If the queues fill, decodes start faster than
    batches leave, and the training loop's pace is the real one. If they drain, the loop runs
    ahead on stored batches, and the decoder's pace is the real one. In both cases the real
    pace is the slower clock, so a route's time is the larger of the two.
    Each clock's estimate is the median of its gaps over two batches. Two stage threads decode
    side by side, so a single gap can be short or long. The median also ignores an epoch
    boundary or a slow step inside the window; a mean does not.
    """

    def __init__(self, candidates: Sequence[float] = (0.0, 1.0), warmup: int = 8, settle: int = 4,
                 window: int = 10, clock: Callable[[], float] = time.perf_counter,
                 on_choice: Callable[["RouteTrial"], None] | None = None):
        if len(candidates) < 2 or warmup < 0 or settle < 0 or window < 3:
            raise ValueError("a route trial needs two candidates, warmup >= 0, settle >= 0 and window >= 3")
        self.candidates = [float(c) for c in candidates]
        self.warmup = int(warmup)
        self.settle = int(settle)
        self.window = int(window)
        self.clock = clock
        self.on_choice = on_choice
        self.periods: dict[float, float] = {}  # candidate -> seconds a batch (the slower clock)
        self.clocks: dict[float, tuple[float, float | None]] = {}  # candidate -> (decodes, deliveries)
        self.choice: float | None = None
        self._lock = threading.Lock()
        self._calls = 0
        self._starts: list[float] = []
        self._deliveries: list[float] = []

    def next_share(self) -> float:
        """The share for the decode that starts now (thread-safe; one call per batch)."""
        with self._lock:
            if self.choice is not None:
                return self.choice
            self._calls += 1
            if self._calls <= self.warmup:
                return self.candidates[0]
            per_candidate = self.settle + self.window + 1
            turn, position = divmod(self._calls - 1 - self.warmup, per_candidate)
            share = self.candidates[turn]
            if position >= self.settle:
                self._starts.append(self.clock())
            chosen = False
            if position == per_candidate - 1:
                decodes = _median_two_gap(self._starts)
                deliveries = _median_two_gap(self._deliveries) if len(self._deliveries) >= 3 else None
                self.clocks[share] = (decodes, deliveries)
                self.periods[share] = max(decodes, deliveries or 0.0)
                self._starts, self._deliveries = [], []
                if turn == len(self.candidates) - 1:
                    self.choice = min(self.candidates, key=lambda c: self.periods[c])
                    chosen = True
        if chosen and self.on_choice is not None:
            self.on_choice(self)
        return share

    def consumed(self) -> None:
        """The loader handed a batch to the training loop now."""
        if self.choice is not None:
            return
        with self._lock:
            if self._starts:  # inside a timed window
                self._deliveries.append(self.clock())

    def describe(self) -> str:
        parts = []
        for c in self.candidates:
            if c in self.periods:
                decodes, deliveries = self.clocks[c]
                seen = f"; decodes {decodes * 1e3:.1f}, deliveries " + \
                    (f"{deliveries * 1e3:.1f}" if deliveries is not None else "untimed")
                parts.append(f"{self.periods[c] * 1e3:.1f} ms a batch {_NAMES.get(c, f'at share {c:g}')}{seen}")
        return ", ".join(parts)


_NAMES = {0.0: "with nvJPEG", 1.0: "with every JPEG on the CPU"}


def _median_two_gap(times: list[float]) -> float:
    two_gaps = sorted((times[i + 2] - times[i]) / 2 for i in range(len(times) - 2))
    middle = len(two_gaps) // 2
    return two_gaps[middle] if len(two_gaps) % 2 else (two_gaps[middle - 1] + two_gaps[middle]) / 2
