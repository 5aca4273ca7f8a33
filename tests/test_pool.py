"""The pinned pool's close: what its leak warning names."""

from __future__ import annotations

import warnings

import pytest

from torch_fastload.pool import PinnedPool


class _Copy:
    """A stand-in for the CUDA event recorded after a copy out of a slot."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_pool_closed_busy_names_the_slots_out_and_the_copies_running():
    """A slot never given back and one given back under a copy still running: close() keeps the
    memory (a copy may read it) and its warning names each, so a leak says whose it is."""
    pool = PinnedPool(3, 4096, pin=False)
    kept, copying, idle = pool.acquire(), pool.acquire(), pool.acquire()
    pool.release(copying, _Copy(done=False))
    pool.release(idle, _Copy(done=True))
    with pytest.warns(RuntimeWarning) as caught:
        pool.close(timeout=0.05)
    text = str(caught[0].message)
    assert "copies still in flight after 0.05 s" in text and "leaked instead of freed" in text
    assert f"slots not given back: [{kept.index}]" in text
    assert f"slots whose copy has not finished: [{copying.index}]" in text


def test_a_pool_closed_idle_frees_its_memory_without_a_warning():
    """Control: every slot back and every copy done, close() frees the pool and says nothing."""
    pool = PinnedPool(2, 4096, pin=False)
    first, second = pool.acquire(), pool.acquire()
    pool.release(first, _Copy(done=True))
    pool.release(second)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.close(timeout=0.05)
    assert pool.slots == [] and pool._memory is None
