"""Where a batch's CPU-decoded images go: one pinned buffer, uploaded to the GPU in one copy.

Each stage thread owns two pinned buffers that alternate, so one is refilled while the copy
out of the other may still run; a buffer is refilled only after its copy's event completed.
The probed size places every image before it is decoded, so the decode threads write their
images straight into their places.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .settings import PINNED_BUFFER_BYTES

__all__ = ["Place", "PinnedPlaces", "PinnedBuffers"]


@dataclass
class Place:
    """One image's ``(3, H, W)`` place in ``buffer``: bytes ``[start, end)``."""

    start: int
    shape: tuple  # (3, height, width): the probed size, or a region of it
    buffer: torch.Tensor  # the pinned buffer it lies in

    @property
    def end(self) -> int:
        channels, height, width = self.shape
        return self.start + channels * height * width

    @property
    def view(self) -> torch.Tensor | None:
        """The place as a ``(3, H, W)`` tensor, made when asked: the C++ decoder writes by offset,
        so only Python decodes need one; None where the probe gave no size."""
        if not (self.shape[1] and self.shape[2]):
            return None
        return self.buffer[self.start : self.end].view(self.shape)


@dataclass
class PinnedPlaces:
    """A batch's places in one of its stage thread's pinned buffers."""

    buffer: torch.Tensor  # 1-D uint8, pinned
    places: dict  # batch position -> Place
    turn: int  # which of the thread's two buffers
    total: int  # bytes laid out
    events: list  # the thread's two events: the last copy out of each buffer

    def starts(self, which: list) -> list:
        return [self.places[i].start for i in which]

    def upload(self, end: int, device: torch.device) -> torch.Tensor:
        """The buffer's first ``end`` bytes on ``device``: one copy on the current stream, an
        event guarding the buffer's reuse."""
        flat = self.buffer[:end].to(device, non_blocking=True)
        event = self.events[self.turn] = torch.cuda.Event()
        event.record()
        return flat


class PinnedBuffers:
    """Two pinned buffers per thread that asks, alternating."""

    def __init__(self):
        self._local = threading.local()

    def places(self, boxes: np.ndarray, which: list) -> PinnedPlaces:
        """Places for images ``which`` of a batch, laid out in that order, each the size of its
        box (``boxes``: int64 (N, 4) top, left, height, width), in this thread's next buffer."""
        local = self._local
        if not hasattr(local, "buffers"):
            local.buffers, local.events, local.turn = [None, None], [None, None], 0
        turn = local.turn = 1 - local.turn
        layout, total = [], 0
        for i in which:
            height, width = int(boxes[i, 2]), int(boxes[i, 3])
            shape = (3, height, width)
            layout.append((i, total, shape))
            total += 3 * height * width
        if local.events[turn] is not None:
            local.events[turn].synchronize()
        buffer = local.buffers[turn]
        if buffer is None or buffer.numel() < total:
            buffer = local.buffers[turn] = torch.empty(
                max(total, PINNED_BUFFER_BYTES), dtype=torch.uint8, pin_memory=True
            )
        places = {i: Place(start, shape, buffer) for i, start, shape in layout}
        return PinnedPlaces(buffer, places, turn, total, local.events)
