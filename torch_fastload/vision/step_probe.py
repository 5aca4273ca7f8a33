"""Whether a training step runs at its GPU's pace, read from CUDA events without a host wait.

The route trial keeps the CPU decoder at once when the training loop hardly waited for its
batches. That is only a sign that no route can do better if the step itself runs at the GPU's
pace. If the step is limited by its host thread instead (16 decode threads beside it, the
first steps' autotuning), the loop does not wait either, yet a route that frees the CPU would
speed it up. On an H200 the trial kept the CPU route for ResNet-18 at 59.7 ms a batch against
DALI's 26.6 ms step.

The GPU time between two ``next()`` calls cannot tell these apart: in a steady state every
clock of the loop runs at the same average pace. What differs is where the GPU is when the loop
asks for a batch. So two events are recorded on the training loop's stream per batch: when
``next()`` is entered (the step's work is all queued) and when it returns (after the batch's
hand-off). If the GPU was still running the step, it passes both markers at once, later; if it
had caught up with the host, it passes each as it is recorded, so the GPU gap between them
equals the host's. The GPU time from a hand-off to the next ``next()`` is the step's GPU time.
Events are read once both are complete (``query()``), never waited on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["StepReading", "GpuStepProbe", "read_marks", "REQUESTED", "DELIVERED"]

REQUESTED, DELIVERED = "requested", "delivered"  # next() entered / returned a batch


@dataclass(frozen=True)
class StepReading:
    """A window's steps seen from the GPU (medians over the window)."""

    gpu_step: float  # seconds of GPU time from a batch's hand-off to the next next() call
    caught_up: float  # GPU gap / host gap inside next(): ~1 the GPU waited for the host, ~0 it was busy


def read_marks(marks: list) -> StepReading | None:
    """``marks``: ``(kind, gpu_seconds, host_seconds)`` in recording order (only those the GPU
    has passed); None with fewer than 3 of either span."""
    steps, caught = [], []
    for (kind0, gpu0, host0), (kind1, gpu1, host1) in zip(marks, marks[1:]):
        if kind0 == DELIVERED and kind1 == REQUESTED:
            steps.append(gpu1 - gpu0)
        elif kind0 == REQUESTED and kind1 == DELIVERED and host1 > host0:
            caught.append((gpu1 - gpu0) / (host1 - host0))
    if len(steps) < 3 or len(caught) < 3:
        return None
    return StepReading(_median(steps), _median(caught))


class GpuStepProbe:
    """CUDA events on the calling thread's current stream of ``device`` at each mark (the
    training thread, inside ``next()``); ``take()`` reads those the GPU has passed and forgets
    all. Nothing touches the GPU before the first mark."""

    def __init__(self, device, clock: Callable[[], float] = time.perf_counter):
        self.device = torch.device(device)
        self.clock = clock
        self._marks: list = []  # (kind, event, host seconds)

    def mark(self, kind: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._marks.append((kind, event, self.clock()))

    def take(self) -> StepReading | None:
        marks, self._marks = self._marks, []
        if not marks:
            return None
        first = marks[0][1]
        passed = []
        for kind, event, host in marks:
            if not event.query():  # still queued: so is everything after it
                break
            passed.append((kind, first.elapsed_time(event) / 1e3, host))
        return read_marks(passed)


def _median(values: list) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
