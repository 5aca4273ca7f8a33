"""Thread priorities: background decode threads yield their cores to the threads that pace
training (the training thread's kernel launches, the loader's fetch/stage/copy threads, which
hold the GIL in short bursts and stall every other Python thread while preempted)."""

from __future__ import annotations

import os
import threading

__all__ = ["lower_thread_priority"]


def lower_thread_priority(nice: int) -> bool:
    """Set this thread's nice value to at least ``nice`` (Linux sets it per thread; raising it
    needs no privilege). At least, not plus: a thread started by a lowered thread inherits its
    value, and must not go lower still. Returns whether it took effect; elsewhere, or where
    refused, nothing changes."""
    if nice <= 0:
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), min(19, nice)))
    except (AttributeError, OSError):
        return False
    return True
