"""Typed errors, and the wrapper that carries a background thread's exception to ``next()``."""

from __future__ import annotations

import sys
import threading

from torch._utils import ExceptionWrapper

__all__ = ["FastloadError", "BatchTooLargeError", "PoolError", "LoaderShutdownError", "capture"]


class FastloadError(RuntimeError):
    """Base class of torch_fastload's own errors."""


class BatchTooLargeError(FastloadError, ValueError):
    """A batch does not fit in a pinned slot and ``oversize='error'`` was asked for."""

    def __init__(self, batch_index: int, batch_bytes: int, slot_bytes: int):
        self.batch_index = batch_index
        self.batch_bytes = batch_bytes
        self.slot_bytes = slot_bytes
        super().__init__(
            f"batch {batch_index} needs {batch_bytes} bytes but pinned slots hold {slot_bytes} bytes; "
            f"pass slot_bytes>={batch_bytes} (or TORCH_FASTLOAD_SLOT_BYTES) or oversize='grow'"
        )


class PoolError(FastloadError):
    """The pinned pool could not be allocated, registered or waited on."""


class LoaderShutdownError(FastloadError):
    """The iterator was used after it was shut down, or a pipeline thread died unexpectedly."""


def capture(stage: str, batch_index: int | None = None) -> ExceptionWrapper:
    """Wrap the exception being handled, naming the stage, the batch and the thread.

    ``ExceptionWrapper.reraise()`` raises an exception of the original type whose message
    holds the original traceback, like torch's DataLoader does for worker errors.
    """
    where = f"torch_fastload {stage} (thread {threading.current_thread().name!r}"
    if batch_index is not None:
        where += f", batch {batch_index}"
    where += ")"
    return ExceptionWrapper(sys.exc_info(), where=where)
