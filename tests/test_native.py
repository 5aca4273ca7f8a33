"""The C++ steady state (native.py, csrc/native_loop.cpp) on the CPU: same batches as torch and
as the Python pipeline, errors in their batch's next(), exact resume, clean shutdown, and no
Python running on any thread but the caller's while batches flow."""

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_harness import check_resume
from torch.utils.data import TensorDataset

import torch_fastload
import torch_fastload.errors
from torch_fastload import ArrayDataset, DataLoader, RecordDataset, pack
from torch_fastload.native import NativePipeline
from torch_fastload.sampling import OrderPass
from torch_fastload.vision.step_probe import StepReading


def batches(loader):
    return [b if isinstance(b, (list, tuple)) else [b] for b in loader]


def assert_batches_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = list(a), list(b)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            if x is None or y is None:
                assert x is None and y is None
                continue
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.fixture
def arrays(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((203, 3, 5)).astype(np.float32)
    y = rng.integers(0, 10, 203).astype(np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return ArrayDataset(tmp_path / "x.npy", tmp_path / "y.npy")


@pytest.fixture
def records(tmp_path):
    rng = np.random.default_rng(1)
    blobs = [rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes() for _ in range(97)]
    pack(blobs, tmp_path / "pack", labels=list(range(97)), shard_size=4096, progress=False)
    return RecordDataset(tmp_path / "pack")


def iterator_kind(loader) -> type:
    it = iter(loader)
    kind = type(it._pipeline)
    it.close()
    return kind


@pytest.mark.parametrize("shuffle,drop_last", [(False, False), (True, False), (True, True)])
def test_tensor_dataset_batches_equal_torch_and_the_python_pipeline(shuffle, drop_last):
    data = TensorDataset(torch.randn(101, 4, 6), torch.arange(101), torch.randn(101).to(torch.bfloat16))
    kwargs = dict(batch_size=16, shuffle=shuffle, drop_last=drop_last)
    theirs = batches(torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(5), **kwargs))
    loader = DataLoader(data, generator=torch.Generator().manual_seed(5), device="cpu", **kwargs)
    assert iterator_kind(loader) is NativePipeline
    loader = DataLoader(data, generator=torch.Generator().manual_seed(5), device="cpu", **kwargs)
    ours = batches(loader)
    assert loader.stats().path.startswith("native loop")
    with torch_fastload.config.override(native="off"):
        python = batches(DataLoader(data, generator=torch.Generator().manual_seed(5), device="cpu", **kwargs))
    assert_batches_equal(ours, theirs)
    assert_batches_equal(python, theirs)


def test_array_and_record_sources_equal_torch(arrays, records):
    for dataset, collate in ((arrays, None), (records, records.collate)):

        def make(dataset=dataset):
            return DataLoader(
                dataset, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2), device="cpu"
            )

        assert iterator_kind(make()) is NativePipeline
        loader = make()
        ours = batches(loader)
        theirs = batches(
            torch.utils.data.DataLoader(
                dataset, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2), collate_fn=collate
            )
        )
        assert_batches_equal(ours, theirs)
        stats = loader.stats()
        assert stats.io_bytes.get("engine-posix", 0) > 0 and stats.batches == len(theirs)


def test_python_pipeline_where_the_loop_does_not_apply(arrays):
    data = TensorDataset(torch.arange(20))
    assert iterator_kind(DataLoader(data, batch_size=4, device="cpu", num_workers=1)) is not NativePipeline
    assert iterator_kind(DataLoader(data, batch_size=4, device="cpu", collate_fn=lambda b: b)) is not NativePipeline
    assert iterator_kind(DataLoader(TensorDataset(torch.randn(5, 20).t()), device="cpu")) is not NativePipeline
    with torch_fastload.config.override(native="off"):
        assert iterator_kind(DataLoader(arrays, batch_size=4, device="cpu")) is not NativePipeline


def test_an_out_of_range_index_fails_its_own_batch_and_later_batches_arrive(arrays):
    sampler = [[0, 1], [2, 500], [-1, 3], [4, -204]]
    it = iter(DataLoader(arrays, batch_sampler=sampler, device="cpu"))
    x, _ = next(it)
    assert torch.equal(x, torch.from_numpy(np.load(arrays.files[0].path)[[0, 1]]))
    with pytest.raises(IndexError, match=r"index 500 is out of range for .*x.npy \(203 rows\)") as info:
        next(it)
    assert "batch 1" in "".join(getattr(info.value, "__notes__", []))
    x, _ = next(it)
    assert torch.equal(x, torch.from_numpy(np.load(arrays.files[0].path)[[-1, 3]]))
    with pytest.raises(IndexError, match="index -204"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_a_file_truncated_after_opening_is_a_typed_error_in_its_batch(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    dataset = ArrayDataset(tmp_path / "a.npy")
    it = iter(DataLoader(dataset, batch_size=8, device="cpu", prefetch=1))
    assert next(it).shape == (8, 16)
    with open(tmp_path / "a.npy", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "a.npy") - 32 * 64)
    errors = 0
    for _ in range(7):
        try:
            next(it)
        except (torch_fastload.engine.RangeError, EOFError, torch_fastload.errors.FileChangedError):
            errors += 1
    assert errors >= 1  # batches read before the truncation may still arrive whole
    with pytest.raises(StopIteration):
        next(it)


def tensors(seed, prefetch=2):
    """A loader on the C++ loop for the resume harness (its child process builds it too)."""
    torch.manual_seed(seed)
    data = TensorDataset(torch.arange(90 * 3, dtype=torch.float32).reshape(90, 3), torch.arange(90))
    return DataLoader(data, batch_size=8, shuffle=True, device="cpu", prefetch=prefetch)


def test_resume_after_0_1_k_and_the_last_batch_in_a_fresh_process():
    assert iterator_kind(tensors(0)) is NativePipeline
    check_resume("test_native:tensors", {}, child_overrides={"prefetch": 5})


def test_break_and_del_stop_the_loop_threads():
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    data = TensorDataset(torch.randn(400, 64))
    gc.collect()
    before = threads()
    for _ in range(3):
        loader = DataLoader(data, batch_size=8, device="cpu")
        for i, _ in enumerate(loader):
            if i == 3:
                break
        del loader
        gc.collect()
    assert threads() <= before  # the engine's persistent pool may have started before `before`


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _epoch_loops(loader, epochs: int) -> tuple[list, list, list]:
    """Each epoch's batches, the C++ loop it ran on, and the process's thread count after it."""
    got, loops, threads = [], [], []
    for _ in range(epochs):
        it = iter(loader)
        loops.append(it._pipeline.loop)
        got.append(batches(it))
        threads.append(_threads())
    return got, loops, threads


@pytest.mark.parametrize("keep", [True, False])
def test_a_loader_keeps_its_loop_across_epochs_and_close_stops_it(keep):
    """Epochs run to their end leave the loop (its workers, plans, positions) to the next one;
    every epoch still equals torch's. Control: keep_loop off makes and stops a loop an epoch."""
    data = TensorDataset(torch.randn(203, 7), torch.arange(203))
    kwargs = dict(batch_size=16, shuffle=True)
    theirs = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(3), **kwargs)
    gc.collect()
    before = _threads()
    with torch_fastload.config.override(keep_loop=keep):
        loader = DataLoader(data, generator=torch.Generator().manual_seed(3), device="cpu", **kwargs)
        got, loops, threads = _epoch_loops(loader, 4)
    for ours in got:
        assert_batches_equal(ours, batches(theirs))
    if keep:
        assert all(loop is loops[0] for loop in loops)
        assert min(threads) > before  # parked between epochs: its workers are alive...
        assert len(set(threads)) == 1  # ...and only one loop's: none are started per epoch
    else:
        assert len({id(loop) for loop in loops}) == 4
        assert max(threads) <= before
    assert loader.stats().batches == 4 * len(theirs)
    loader.close()
    assert _threads() <= before


def test_a_kept_loop_counts_its_stages_once():
    """The loop's counters are cumulative: an epoch on a kept loop counts from where the last
    one synced. Control: the same epochs on a new loop each give the same totals."""
    data = TensorDataset(torch.randn(300, 64), torch.arange(300))
    totals = []
    for keep in (True, False):
        with torch_fastload.config.override(keep_loop=keep):
            loader = DataLoader(data, batch_size=32, shuffle=True, device="cpu")
            for _ in range(3):
                for _ in loader:
                    pass
            stats = loader.stats()
            totals.append((stats.batches, stats.samples, stats.stage_bytes["stage"]))
            loader.close()
    assert totals[0] == totals[1] and totals[0][2] > 0


def test_an_epoch_left_midway_or_failed_leaves_no_loop_to_the_next():
    """A loop with batches of the epoch still in it (a break) or a failed sampler is stopped;
    the next epoch runs on a new loop and equals torch's."""
    data = TensorDataset(torch.arange(64 * 5, dtype=torch.float32).reshape(64, 5))
    loader = DataLoader(data, batch_size=8, device="cpu")
    it = iter(loader)
    first = it._pipeline.loop
    next(it)
    del it
    gc.collect()
    it = iter(loader)
    assert it._pipeline.loop is not first
    assert_batches_equal(batches(it), batches(torch.utils.data.DataLoader(data, batch_size=8)))

    class FailsOnce(torch.utils.data.Sampler):
        def __init__(self):
            self.epochs = 0

        def __len__(self):
            return 64

        def __iter__(self):
            self.epochs += 1
            for i in range(64):
                if self.epochs == 1 and i == 40:
                    raise RuntimeError("sampler broke")
                yield i

    loader = DataLoader(data, batch_size=8, sampler=FailsOnce(), device="cpu")
    it = iter(loader)
    broken = it._pipeline.loop
    with pytest.raises(RuntimeError, match="sampler broke"):
        for _ in it:
            pass
    it = iter(loader)
    assert it._pipeline.loop is not broken
    assert_batches_equal(batches(it), batches(torch.utils.data.DataLoader(data, batch_size=8)))


def test_a_kept_loop_of_another_layout_is_stopped_not_stacked():
    """An epoch whose loop would differ (here its copy timing) stops the kept one first: loops
    never pile up, and the one after it keeps its own."""
    data = TensorDataset(torch.randn(96, 8))
    loader = DataLoader(data, batch_size=8, device="cpu")
    gc.collect()
    before = _threads()
    loops, threads = [], []
    for every in (16, 4, 4, 16):
        with torch_fastload.config.override(copy_timing_every=every):
            it = iter(loader)
            loops.append(it._pipeline.loop)
            assert_batches_equal(batches(it), batches(torch.utils.data.DataLoader(data, batch_size=8)))
            threads.append(_threads())
    assert loops[1] is not loops[0] and loops[2] is loops[1] and loops[3] is not loops[2]
    assert len(set(threads)) == 1  # one loop's workers at a time
    loader.close()
    assert _threads() <= before


def test_a_loop_parked_as_its_loader_closes_is_closed_once():
    """An epoch may end on the training thread while another thread closes the loader: the loop
    it parks after close() is stopped at once, and each parked loop is closed exactly once
    (twice would give its pinned slots back to the pool twice)."""
    from torch_fastload.resources import LoaderResources

    class Parked:
        key = ("k",)

        def __init__(self):
            self.closed = 0

        def close(self):
            self.closed += 1

    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, device="cpu")
    resources: LoaderResources = loader.resources
    first, second, third = Parked(), Parked(), Parked()
    resources.park(first)
    assert resources.adopt(("k",)) is first and first.closed == 0
    resources.park(first)
    resources.park(second)  # one a loader: the earlier one is stopped
    assert (first.closed, second.closed) == (1, 0)
    assert resources.adopt(("other",)) is None and second.closed == 1
    loader.close()
    resources.park(third)
    assert third.closed == 1 and resources.adopt(("k",)) is None
    fourth = Parked()  # an epoch begun after close() (adopt) may park again
    resources.park(fourth)
    assert fourth.closed == 0
    loader.close()
    assert (first.closed, second.closed, third.closed, fourth.closed) == (1, 1, 1, 1)


@pytest.mark.parametrize("kept", [False, True])
def test_an_iter_that_fails_to_start_leaves_no_loop_running(monkeypatch, kept):
    """iter() raising after the loop exists (here its first submit; a new loop or one kept from
    the last epoch) stops it before the error reaches the caller: no worker outlives the
    traceback the caller holds. Control: the loop's threads run while the traceback lives."""
    data = TensorDataset(torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3))
    gc.collect()
    before = _threads()
    loader = DataLoader(data, batch_size=8, device="cpu")
    if kept:
        batches(loader)
        assert _threads() > before

    def refuse(self, *args):
        raise RuntimeError("refused")

    monkeypatch.setattr(NativePipeline, "_submit_group", refuse)
    with pytest.raises(RuntimeError, match="refused") as info:
        iter(loader)
    assert info.traceback  # the failed pipeline (and so its loop) stays reachable from here
    assert _threads() <= before
    monkeypatch.undo()
    assert_batches_equal(batches(loader), batches(torch.utils.data.DataLoader(data, batch_size=8)))
    loader.close()


def test_a_loader_iterated_after_close_keeps_its_loop_again():
    data = TensorDataset(torch.randn(40, 3))
    loader = DataLoader(data, batch_size=8, device="cpu")
    batches(loader)
    loader.close()
    loops = []
    for _ in range(2):
        it = iter(loader)
        loops.append(it._pipeline.loop)
        assert_batches_equal(batches(it), batches(torch.utils.data.DataLoader(data, batch_size=8)))
    assert loops[1] is loops[0]
    loader.close()


def test_a_kept_loop_survives_forked_workers_between_epochs():
    """The usual train/validate loop: between two training epochs (the loop kept, its workers
    idle) a torch DataLoader forks worker processes; they exit without touching the loop, and
    the next training epoch runs on it and equals torch's."""
    data = TensorDataset(torch.randn(96, 5), torch.arange(96))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(6), device="cpu")
    theirs = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(6))
    it = iter(loader)
    kept = it._pipeline.loop
    assert_batches_equal(batches(it), batches(theirs))
    validation = torch.utils.data.DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context="fork")
    assert sum(len(b[0]) for b in validation) == 96
    it = iter(loader)
    assert it._pipeline.loop is kept
    assert_batches_equal(batches(it), batches(theirs))
    loader.close()


def test_no_python_runs_off_the_calling_thread_in_the_steady_state(arrays):
    """The point of the loop: the training thread is the only one executing Python while batches
    flow, but for the group turns' own thread where it is asked for (``turn_thread``, on by default
    only for CUDA outputs). Negative control: the Python pipeline's fetch and stage threads do run
    Python."""
    data = TensorDataset(torch.randn(2000, 32), torch.arange(2000))

    def python_threads(native: str, turn_thread="auto") -> set:
        seen: set = set()
        main = threading.get_ident()

        def profile(frame, event, arg):  # threading's own frames: a thread's end reads as a Dummy one
            if threading.get_ident() != main and frame.f_code.co_filename != threading.__file__:
                seen.add(threading.current_thread().name)

        with torch_fastload.config.override(native=native, turn_thread=turn_thread):
            loader = DataLoader(data, batch_size=16, shuffle=True, device="cpu")
            threading.setprofile(profile)  # every thread started from now on (iter() starts any)
            try:
                for _ in loader:
                    pass
            finally:
                threading.setprofile(None)
        return seen

    assert python_threads("auto") == set()  # host outputs: turns stay in next() unless asked
    assert python_threads("auto", turn_thread=False) == set()
    assert python_threads("auto", turn_thread=True) == {"fastload-turn"}
    assert any(name.startswith(("fastload-fetch", "fastload-stage")) for name in python_threads("off"))


def host_loop(fields, workers: int = 1, **debug):
    """A NativeLoop on the host (no CUDA, no files, no slots) over in-memory ``fields``; ``debug``:
    its test-only arguments."""
    from torch_fastload import _C

    no_files = ([], False, 0, 0, 0, 0)  # paths, cuda, stream, slots, slot bytes, slot count
    return _C.NativeLoop(fields, *no_files, workers, 1, 1, 1 << 20, False, False, None, 0, 1 << 16, 1, **debug)


def test_loop_rejects_a_buffer_too_small_and_unknown_batches():

    values = torch.arange(10, dtype=torch.int64)
    loop = host_loop([(0, 10, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)])
    assert loop.row_layout(3) == [24, 0, 24]
    layout = loop.submit(0, [1, 2, 3])
    assert layout == [24, 0, 24]
    with pytest.raises(ValueError, match="holds 8 bytes, the batch needs 24"):
        loop.start(0, values.data_ptr(), 8)
    with pytest.raises(ValueError, match="was not submitted"):
        loop.start(7, values.data_ptr(), 64)
    out = torch.zeros(3, dtype=torch.int64)
    loop.start(0, out.data_ptr(), 24)
    assert loop.take(0, 0, 5.0)
    assert out.tolist() == [1, 2, 3]
    assert loop.submit(1, [11]) == [-1]
    with pytest.raises(IndexError, match="index 11 is out"):
        loop.take(1, 0, 0.0)
    out = torch.zeros(2, dtype=torch.int64)
    assert loop.submit(2, [9, -1], out.data_ptr(), 16) == [16, 0, 16]  # submitted and started at once
    assert loop.take(2, 0, 5.0) and out.tolist() == [9, 9]
    with pytest.raises(ValueError, match="was not submitted"):
        loop.take(3, 0, 0.0)
    assert loop.stop(1.0, True)


def test_image_folder_with_workers_still_takes_the_batch_path(tmp_path):
    """num_workers=16, as the PyTorch ImageNet example passes: the source still decodes whole
    batches (worker processes would decode per sample); one warning says why, and the batches
    are the same as with num_workers=0."""
    pytest.importorskip("torchvision")  # ImageFolder's CPU decode
    pytest.importorskip("PIL")  # the sample photographs
    from torch_fastload.fetch import InThreadSource
    from torch_fastload.sources import ImageFolder
    from torch_fastload.vision import TrainTransform
    from torch_fastload.vision.sample_data import make_image_folder

    train, _ = make_image_folder(str(tmp_path), classes=3, train_per_class=4, val_per_class=1, progress=False)

    def run(workers):
        dataset = ImageFolder(train, TrainTransform(), seed=7)
        loader = DataLoader(
            dataset,
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            device="cpu",
            generator=torch.Generator().manual_seed(0),
        )
        it = iter(loader)
        assert isinstance(it._pipeline.source, InThreadSource)
        out = [x for x, _ in it]
        assert sum(loader.stats().decoded.values()) == 12  # decoded by the batch decoder, counted
        return out

    with pytest.warns(UserWarning, match="num_workers=16 starts no worker processes"):
        with_workers = run(16)
    without = run(0)
    assert len(with_workers) == 3 and all(torch.equal(a, b) for a, b in zip(with_workers, without))


@pytest.mark.parametrize("prefetch", [1, 4])
def test_every_sample_exactly_once_in_order_when_batches_finish_out_of_order(prefetch, monkeypatch):
    """Workers finish batches in random order (jitter); next() still hands them out in the
    sampler's order, each sample once per epoch, over epochs and an early break."""
    from torch_fastload import native as native_module

    monkeypatch.setattr(native_module, "DEBUG_JITTER_US", 3000)
    data = TensorDataset(torch.arange(600))
    loader = DataLoader(
        data, batch_size=7, shuffle=True, device="cpu", prefetch=prefetch, generator=torch.Generator().manual_seed(1)
    )
    theirs = torch.utils.data.DataLoader(data, batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        ours = [b[0] for b in loader]
        want = [b[0] for b in theirs]
        assert len(ours) == len(want) and all(torch.equal(a, b) for a, b in zip(ours, want))
        assert sorted(torch.cat(ours).tolist()) == list(range(600))
    for i, _ in enumerate(loader):  # an early break, then a whole epoch again
        if i == 5:
            break
    assert sorted(torch.cat([b[0] for b in loader]).tolist()) == list(range(600))


@pytest.mark.parametrize("old_wait", [False, True])
def test_a_batch_whose_wakeup_is_lost_is_still_staged(old_wait, monkeypatch):
    """No started batch notifies an idle worker; the workers' look at the queue every 20 ms
    still finds it, and a whole loader runs its epochs so. Control: with the old wait (a notify
    alone wakes a worker) a batch started while both workers sleep is never staged."""
    from torch_fastload import native as native_module

    values = torch.arange(10, dtype=torch.int64)
    fields = [(0, 10, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)]
    loop = host_loop(fields, workers=2, debug_lose_wakeups=True, debug_old_idle_wait=old_wait)
    time.sleep(0.2)  # both workers asleep
    out = torch.zeros(3, dtype=torch.int64)
    loop.submit(0, [4, 5, 6], out.data_ptr(), 24)
    staged = loop.take(0, 0, 2.0)
    assert loop.stop(5.0, False)
    if old_wait:
        assert not staged and out.tolist() == [0, 0, 0]
        return
    assert staged and out.tolist() == [4, 5, 6]
    monkeypatch.setattr(native_module, "DEBUG_LOSE_WAKEUPS", True)
    loader = DataLoader(TensorDataset(torch.arange(60)), batch_size=7, device="cpu", timeout=10)
    for _ in range(2):
        batches = [b[0] for b in loader]
        assert len(batches) == 9 and torch.equal(torch.cat(batches), torch.arange(60))


_STOP_IN_THE_WINDOW = """
import sys, time, torch
from torch_fastload import _C
values = torch.arange(10, dtype=torch.int64)
fields = [(0, 10, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)]
# two workers; the first to look finds no job and pauses 1 s holding the loop's mutex before it
# waits: stop() comes in that window
loop = _C.NativeLoop(fields, [], False, 0, 0, 0, 0, 2, 1, 1, 1 << 20, False, False, None, 0, 1 << 16, 1,
                     debug_idle_pause_us=1_000_000, debug_old_idle_wait=sys.argv[1] == "old")
time.sleep(0.2)
began = time.monotonic()
assert loop.stop(5.0, False)
print(f"stopped in {time.monotonic() - began:.2f} s")
"""


@pytest.mark.parametrize("old_wait", [False, True])
def test_stop_reaches_a_worker_between_its_look_and_its_wait(old_wait):
    """stop() while a worker has found no job and not yet begun to wait: the flag is raised under
    the loop's mutex, so the worker sees it (or its notify) and the join returns. Control: the
    old stop() (flag raised without the mutex, a notify alone wakes a worker) joins for ever."""
    command = [sys.executable, "-c", _STOP_IN_THE_WINDOW, "old" if old_wait else "new"]
    package = str(Path(__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]))
    if old_wait:
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(command, capture_output=True, text=True, timeout=8, env=env)
        return
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[2]) < 4.0  # the pauses of both workers at most


def test_each_field_of_a_batch_is_its_own_tensor():
    """torch's collate gives independent tensors: keeping the labels must not keep the images'
    memory alive (the loop used to hand out views of one buffer)."""
    data = TensorDataset(torch.randn(40, 3, 8), torch.arange(40))
    x, y = next(iter(DataLoader(data, batch_size=8, device="cpu")))
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    assert x.untyped_storage().nbytes() == x.nbytes and y.untyped_storage().nbytes() == y.nbytes


@pytest.mark.parametrize("ahead", [1, 4])
def test_planned_batches_are_submitted_a_group_at_a_time(ahead, monkeypatch):
    """``allocate_ahead``: batches of a planned size are allocated and submitted ``ahead`` at a
    time (one C++ call, one wake-up of the workers), so most next() calls only take a batch; the
    first batch and an epoch's short last one go alone; the epoch still equals torch's, each
    field its own tensor, and a bad index inside a group fails only its own batch."""
    groups = []
    real = NativePipeline._submit_group

    def counting(self, group, plan, home):
        groups.append([len(g) for g in group])
        return real(self, group, plan, home)

    monkeypatch.setattr(NativePipeline, "_submit_group", counting)
    rows, labels = torch.arange(1000 * 6, dtype=torch.float32).view(1000, 6), torch.arange(1000)
    with torch_fastload.config.override(allocate_ahead=ahead):
        loader = DataLoader(TensorDataset(rows, labels), batch_size=64, device="cpu", prefetch=2)
        got = list(loader)
        loader.close()
    assert len(got) == 16  # 15 of 64 rows, then 40
    assert torch.equal(torch.cat([x for x, _ in got]), rows) and torch.equal(torch.cat([y for _, y in got]), labels)
    assert all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x, y in got)
    sizes = [len(g) for g in groups]
    assert groups[0] == [64] and groups[-1] == [40]  # the first of a size, and the short last batch, alone
    assert sum(sizes) == 16
    if ahead == 1:
        assert sizes == [1] * 16
    else:
        assert max(sizes) == 4 and len(groups) <= 7  # 1 + ceil(14 / 4) groups and the last
        assert all(len(set(g)) == 1 for g in groups)  # one size a group

    bad = torch.arange(40)
    loader = DataLoader(
        TensorDataset(bad), batch_size=4, device="cpu", sampler=list(range(12)) + [99] + list(range(12, 40))
    )
    it = iter(loader)
    seen, errors = [], 0
    while True:
        try:
            seen.append(next(it)[0])
        except StopIteration:
            break
        except IndexError:
            errors += 1
    loader.close()
    assert errors == 1  # batch 3 (indices 12, 99, 13, 14) only
    assert torch.equal(torch.cat(seen), torch.tensor([i for i in range(40) if i not in (12, 13, 14)]))


def test_a_group_recipe_lays_batches_out_at_512_byte_pitches_and_names_their_addresses():
    """``output_blocks='group'`` (GPU outputs; laid out the same on any device): a field's block
    holds each batch's contiguous view at a multiple of 512 bytes from its start, and the
    addresses handed to the C++ loop are those views' own."""
    from torch_fastload.native import _GroupRecipe, _SharedBlocks

    shapes = ([((63, 7), torch.float32), ((63,), torch.int16)], [1792, 128])  # the layout's byte sizes
    recipe = _GroupRecipe(shapes, 3)
    blocks = [torch.empty(shape, dtype=dtype) for shape, dtype in recipe.blocks]
    views = [block.as_strided(*view).unbind(0) for block, view in zip(blocks, recipe.views)]
    batches = [list(batch) for batch in zip(*views)]
    assert [b.nbytes for b in blocks] == [3 * 2048, 3 * 512]
    assert all(x.shape == (63, 7) and y.shape == (63,) and x.is_contiguous() for x, y in batches)
    shared = _SharedBlocks(blocks, recipe.pitch_bytes)  # what submit_group(..., pitches=) is given
    addresses = [
        block.data_ptr() + k * pitch for k in range(3) for block, pitch in zip(shared.blocks, shared.pitch_bytes)
    ]
    assert addresses == [t.data_ptr() for batch in batches for t in batch]
    assert all((t.data_ptr() - block.data_ptr()) % 512 == 0 for batch in batches for t, block in zip(batch, blocks))
    for k, (x, y) in enumerate(batches):  # no two views overlap
        x.fill_(k), y.fill_(k)
    assert all(bool((x == k).all()) and bool((y == k).all()) for k, (x, y) in enumerate(batches))


@pytest.mark.parametrize("sampler", ["list", "shuffle"])
def test_group_views_carry_a_whole_epoch_through_the_loop(monkeypatch, sampler):
    """The group blocks' addresses as the C++ loop works them out from each block and pitch (on
    the GPU by default; here the same views of host blocks, forced): every batch equals torch's,
    labels and rows alike, with a sampler's lists or a shuffle drawn in bulk (a group's indices
    one slice of the order)."""
    real = NativePipeline._allocate_group

    def host_blocks(self, shapes, home, count):
        if count == 1:
            return real(self, shapes, home, count)
        return self._group_views(shapes, count, lambda blocks: [torch.empty(s, dtype=d) for s, d in blocks])

    monkeypatch.setattr(NativePipeline, "_allocate_group", host_blocks)
    runs = []
    full_batches = OrderPass.full_batches
    monkeypatch.setattr(OrderPass, "full_batches", lambda self, most: runs.append(full_batches(self, most)) or runs[-1])
    rows, labels = torch.randn(1000, 7), torch.arange(1000, dtype=torch.int16)
    if sampler == "list":
        order = torch.randperm(1000, generator=torch.Generator().manual_seed(3)).tolist()
        loader = DataLoader(TensorDataset(rows, labels), batch_size=63, device="cpu", sampler=order)
    else:
        torch.manual_seed(3)
        order = torch.cat([b for (b,) in torch.utils.data.DataLoader(TensorDataset(torch.arange(1000)), 63, True)])
        torch.manual_seed(3)
        loader = DataLoader(TensorDataset(rows, labels), batch_size=63, device="cpu", shuffle=True)
    got = list(loader)
    groups = [len(r) for r in runs if r is not None]  # the first batch went alone (its size's plan unknown)
    assert sum(groups) == (14 if sampler == "shuffle" else 0) and all(1 <= k <= 8 for k in groups)
    loader.close()
    shared = [x for x, _ in got if x.untyped_storage().nbytes() > x.nbytes]
    assert len(shared) >= 12  # all but the first batch and the short last one came from group blocks
    assert torch.equal(torch.cat([x for x, _ in got]), rows[order])
    assert torch.equal(torch.cat([y for _, y in got]), labels[order])


def test_a_group_submit_checks_its_shape_and_fails_only_its_bad_batches():
    values = torch.arange(10, dtype=torch.int64)
    loop = host_loop([(0, 10, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)])
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    pointers = [t.data_ptr() for t in outs]
    with pytest.raises(ValueError, match="needs count x n indices and count x 1 output buffers"):
        loop.submit_group(0, np.arange(6), 3, pointers[:2], [16])
    assert loop.submit_group(0, np.array([1, 2, 30, 3, 4, 5]), 3, pointers, [16]) == [16, -1, 16]
    assert loop.take(0, 0, 5.0) and loop.take(2, 0, 5.0)
    with pytest.raises(IndexError, match="index 30 is out"):
        loop.take(1, 0, 0.0)
    assert outs[0].tolist() == [1, 2] and outs[2].tolist() == [4, 5] and outs[1].tolist() == [0, 0]
    # a buffer refused midway: the batches started before it still run and can be taken
    with pytest.raises(ValueError, match="output field 0 of batch 5 holds 16 bytes"):
        loop.submit_group(3, np.array([6, 7, 8, 9, 1, 2]), 3, [pointers[0], pointers[1], 0], [16])
    assert loop.take(3, 0, 5.0) and loop.take(4, 0, 5.0)
    assert outs[0].tolist() == [6, 7] and outs[1].tolist() == [8, 9]
    assert loop.stop(1.0, True)


def test_a_group_submit_with_pitches_writes_each_batch_at_its_pitch_in_each_block():
    values, labels = torch.arange(40, dtype=torch.int64), torch.arange(100, 140, dtype=torch.int32)
    loop = host_loop(
        [
            (0, 40, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False),
            (0, 40, 4, labels.data_ptr(), -1, 0, 0, "index {} is out", False),
        ]
    )
    rows, small = torch.full((3, 8), -1, dtype=torch.int64), torch.full((3, 16), -1, dtype=torch.int32)
    bases = [rows.data_ptr(), small.data_ptr()]
    with pytest.raises(ValueError, match="one pitch per block"):
        loop.submit_group(0, np.arange(9), 3, bases, [24, 12], pitches=[64])
    order = np.array([5, 6, 7, 30, 31, 32, 0, 1, 2])
    assert loop.submit_group(0, order, 3, bases, [24, 12], pitches=[64, 64]) == [loop.row_layout(3)[0]] * 3
    assert all(loop.take(k, 0, 5.0) for k in range(3))
    assert loop.stop(1.0, True)
    assert rows[:, :3].flatten().tolist() == order.tolist() and rows[:, 3:].eq(-1).all()  # 64-byte pitch
    assert small[:, :3].flatten().tolist() == (order + 100).tolist() and small[:, 3:].eq(-1).all()


def test_a_group_submit_lets_other_python_threads_run():
    """The C++ submit of a group runs without the GIL: where the turn thread submits, the
    training thread goes on with its step meanwhile. A submit held 200 ms in C++
    (debug_submit_pause_us): a Python thread woken just before it runs while it is still held.
    Holding the GIL, that thread would run only once the call returned (checked: without the
    release it ran after)."""
    values = torch.arange(16, dtype=torch.int64)
    loop = host_loop([(0, 16, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)], debug_submit_pause_us=200_000)
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    woken, ran_at = threading.Event(), []

    def other_python():
        woken.wait()
        ran_at.append(time.perf_counter())

    other = threading.Thread(target=other_python)
    other.start()
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no forced switch: the thread runs only where the GIL is let go
    try:
        woken.set()
        assert loop.submit_group(0, np.array([1, 2, 3, 4]), 2, [t.data_ptr() for t in outs], [16]) == [16, 16]
        returned = time.perf_counter()
    finally:
        sys.setswitchinterval(old_interval)
        other.join()
    assert ran_at[0] < returned - 0.1
    assert loop.take(0, 0, 5.0) and loop.take(1, 0, 5.0)
    assert outs[0].tolist() == [1, 2] and outs[1].tolist() == [3, 4]
    assert loop.stop(1.0, True)


@pytest.mark.parametrize("pass_on", [True, False])
def test_a_group_wakes_one_worker_and_each_worker_wakes_the_next(pass_on):
    """A group's submit wakes one idle worker (a futex wake costs the training thread, the
    caller, several microseconds); each worker taking a batch wakes the next, so all of a
    group's batches still run at once. Control: without the passing on (and without the
    workers' periodic look), one worker runs the group's 16 batches one after another."""
    values = torch.arange(64, dtype=torch.int64)
    loop = host_loop(
        [(0, 64, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)],
        workers=16,
        debug_jitter_us=300_000,  # each batch first sleeps 0..0.3 s
        debug_old_idle_wait=True,  # no look every 20 ms: a worker runs only when woken
        debug_no_pass_on=not pass_on,
    )
    time.sleep(0.2)  # every worker asleep
    outs = torch.zeros(16, 4, dtype=torch.int64)
    began = time.monotonic()
    assert loop.submit_group(0, np.arange(64), 16, [outs.data_ptr()], [32], pitches=[32]) == [32] * 16
    assert all(loop.take(k, 0, 30.0) for k in range(16))
    took = time.monotonic() - began
    assert loop.stop(5.0, False)
    assert outs.flatten().tolist() == list(range(64))
    if pass_on:
        assert took < 1.0, took  # at once: the longest sleep, <= 0.3 s
    else:
        assert took > 1.0, took  # one after another: the sum of 16 sleeps, ~2.4 s on average


def test_a_dropped_iterator_frees_its_pipeline_without_the_garbage_collector():
    """The pipeline holds device memory (its submitted batches' outputs, its slots): dropping the iterator
    must free it at once, not at the collector's next cycle (a closure over the pipeline in its
    stock once made a reference cycle)."""
    import weakref

    loader = DataLoader(TensorDataset(torch.randn(256, 4), torch.arange(256)), batch_size=32, device="cpu")
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        it = iter(loader)
        next(it)
        pipeline = weakref.ref(it._pipeline)
        assert isinstance(pipeline(), NativePipeline)
        del it
        assert pipeline() is None
    finally:
        if was_enabled:
            gc.enable()
        loader.close()


def test_loop_checks_each_field_buffer():

    values = torch.arange(10, dtype=torch.int64)
    loop = host_loop([(0, 10, 8, values.data_ptr(), -1, 0, 0, "index {} is out", False)] * 2)
    a, b = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="output field 1 of batch 0 holds 16 bytes, it needs 24"):
        loop.submit_fields(0, np.array([1, 2, 3]), [a.data_ptr(), b.data_ptr()], [24, 16])
    with pytest.raises(ValueError, match="has 2 output fields, got 1 buffers"):
        loop.start_fields(0, [a.data_ptr()], [24])
    loop.start_fields(0, [b.data_ptr(), a.data_ptr()], [24, 24])  # any order in memory
    assert loop.take(0, 0, 5.0)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [1, 2, 3]
    assert loop.submit_fields(1, [4, 11], [a.data_ptr(), b.data_ptr()], [24, 24]) == [-1]
    with pytest.raises(IndexError, match="index 11 is out"):
        loop.take(1, 0, 0.0)
    assert loop.stop(1.0, True)


class _FakeLoop:
    def __init__(self):
        self.kernel = []

    def set_rows_kernel(self, on):
        self.kernel.append(on)


class _FakeProbe:
    def __init__(self, readings):
        self.readings, self.marks = list(readings), 0

    def mark(self, kind):
        self.marks += 1

    def take(self):
        return self.readings.pop(0)


@pytest.mark.parametrize(
    "readings,kernel",
    [
        ([StepReading(0.002, 0.93)], True),  # the GPU waited for the host: a launch-bound step
        ([StepReading(0.050, 0.04)], False),  # the GPU was busy: its SMs are the step's
        ([None], False),  # the GPU had not reached the window's marks: a GPU-bound step
    ],
)
def test_copy_route_choice_follows_where_the_gpu_is_at_next(readings, kernel):
    from types import SimpleNamespace

    from torch_fastload.native import CopyRouteChoice

    rows, mapped = _FakeLoop(), _FakeLoop()
    resources, stats = SimpleNamespace(copy_route=None), SimpleNamespace(path="native loop")
    targets = [("registered rows", rows.set_rows_kernel), ("mapped files", mapped.set_rows_kernel)]
    choice = CopyRouteChoice.__new__(CopyRouteChoice)
    choice.loop, choice.targets, choice.resources, choice.stats, choice.batches = None, targets, resources, stats, 0
    choice.probe = _FakeProbe(readings)
    done, batches = False, 0
    while not done:
        choice.requested()
        done = choice.delivered()
        batches += 1
    assert rows.kernel == [kernel] and mapped.kernel == [kernel]  # one choice, made for both routes
    assert resources.copy_route == ("kernel" if kernel else "dma")
    assert batches == CopyRouteChoice.WARMUP + len(readings) * CopyRouteChoice.WINDOW
    assert choice.probe.marks == 2 * len(readings) * CopyRouteChoice.WINDOW  # only inside the windows
    assert ("gather kernel" if kernel else "copy engines") in stats.path
    assert "registered rows and mapped files" in stats.path


class _RouteLoop:
    def __init__(self):
        self.rows, self.mapped = [], []

    def set_rows_kernel(self, on):
        self.rows.append(on)

    def set_mapped_kernel(self, on):
        self.mapped.append(on)


def _route_pipeline(memory_rows="auto", mapped_copy="auto", rows_bytes=None, file_bytes=None, chosen=None):
    """A NativePipeline with only what ``_choose_copy_route`` reads (no CUDA needed)."""
    from types import SimpleNamespace

    from torch_fastload.native import NativePipeline

    pipeline = NativePipeline.__new__(NativePipeline)
    pipeline.resources = SimpleNamespace(
        settings=SimpleNamespace(memory_rows=memory_rows, mapped_copy=mapped_copy),
        copy_route=chosen,
        copy_route_trial=None,
    )
    pipeline._shortest = {"rows": rows_bytes, "files": file_bytes}
    pipeline.loop, pipeline.device = _RouteLoop(), "cuda"
    pipeline.stats = SimpleNamespace(path="native loop")
    return pipeline


@pytest.mark.parametrize(
    "rows_bytes,file_bytes,rows,mapped,watched",
    [
        (192 << 10, None, [False], [], ["registered rows"]),  # long rows: the copy engines while watched
        (16 << 10, None, [True], [], []),  # short rows: the kernel from the first batch
        (None, 4 << 10, [], [True], []),  # short file rows or records too
        (None, 100 << 10, [], [False], ["mapped files"]),
        (16 << 10, 192 << 10, [True], [False], ["mapped files"]),  # each route by its own ranges
    ],
)
def test_auto_watches_only_routes_whose_ranges_are_long(rows_bytes, file_bytes, rows, mapped, watched):
    from torch_fastload.native import KERNEL_BELOW_BYTES, CopyRouteChoice

    assert KERNEL_BELOW_BYTES == 64 << 10
    pipeline = _route_pipeline(rows_bytes=rows_bytes, file_bytes=file_bytes)
    choice = pipeline._choose_copy_route(rows_bytes is not None, file_bytes is not None)
    assert pipeline.loop.rows == rows and pipeline.loop.mapped == mapped
    if watched:
        assert isinstance(choice, CopyRouteChoice) and [name for name, _ in choice.targets] == watched
    else:
        assert choice is None and "gather kernel" in pipeline._rows_note


@pytest.mark.parametrize("across", [True, False])
def test_an_epoch_shorter_than_the_route_trial_hands_its_count_on(monkeypatch, across):
    """The trial watches WARMUP + WINDOW (32) batches. Epochs of 10 hand their count on, so the
    fourth epoch chooses and its loop takes the route; the control (each epoch starting over)
    never chooses: a loader with short epochs would stay on the copy engines for good."""
    from torch_fastload import native

    monkeypatch.setattr(native, "ROUTE_TRIAL_ACROSS_EPOCHS", across)
    resources, chosen_in = None, None
    for epoch in range(6):
        pipeline = _route_pipeline(rows_bytes=192 << 10)
        if resources is not None:
            pipeline.resources = resources
        resources = pipeline.resources
        trial = pipeline._choose_copy_route(True, False)
        if trial is None:  # an earlier epoch chose: the loop starts on it
            assert pipeline.loop.rows == [True]
            break
        if trial.batches == 0:
            trial.probe = _FakeProbe([StepReading(0.002, 0.93)])  # a launch-bound step
        for _ in range(10):
            trial.requested()
            if trial.delivered():
                chosen_in = epoch
                assert pipeline.loop.rows == [False, True]  # the copy engines, then the kernel
                break
        trial.release(pipeline.loop)  # the epoch's pipeline shut down
    if across:
        assert chosen_in == 3 and resources.copy_route == "kernel" and resources.copy_route_trial is None
    else:
        assert chosen_in is None and resources.copy_route is None


def test_an_iterator_stopping_leaves_the_trial_to_the_one_that_took_it_over():
    """Two iterators of one loader alive at once: the second takes the undecided trial over, and
    the first one's stop must not unbind it from the second's loop."""
    first = _route_pipeline(rows_bytes=192 << 10)
    trial = first._choose_copy_route(True, False)
    second = _route_pipeline(rows_bytes=192 << 10)
    second.resources = first.resources
    assert second._choose_copy_route(True, False) is trial and trial.loop is second.loop
    trial.release(first.loop)
    assert trial.loop is second.loop and trial.names == ["registered rows"]
    trial.release(second.loop)
    assert trial.loop is None and trial.targets == []


def test_explicit_routes_and_an_earlier_choice_need_no_watching():
    explicit = _route_pipeline(memory_rows="kernel", mapped_copy="dma", rows_bytes=4 << 10, file_bytes=1 << 20)
    assert explicit._choose_copy_route(True, True) is None
    assert explicit.loop.rows == [True] and explicit.loop.mapped == []  # 'dma': the loop's default route
    earlier = _route_pipeline(rows_bytes=1 << 20, file_bytes=1 << 20, chosen="kernel")
    assert earlier._choose_copy_route(True, True) is None
    assert earlier.loop.rows == [True] and earlier.loop.mapped == [True]
    assert earlier._rows_note == " (registered rows: gather kernel, mapped files: gather kernel)"


def test_only_tensors_whose_last_page_is_their_own_are_pinned_in_place(monkeypatch):
    """``resources.tail_page_private``: CUDA pins whole pages, so a tensor is registered in place
    only where no other buffer can start on its last page (one that did, and ran past it, would
    fail every CUDA copy with "invalid argument"; the CUDA test shows it)."""
    import mmap

    from torch_fastload.resources import tail_page_private

    page = 4096
    mapping = mmap.mmap(-1, 16 * page)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    assert tail_page_private(whole)  # ends on a page boundary
    assert tail_page_private(whole[100 : 5 * page + 7])  # its last page lies inside its storage
    alone = torch.frombuffer(mapping, dtype=torch.uint8, count=3 * page + 100, offset=64)
    assert not tail_page_private(alone)  # its storage ends mid-page: the rest is someone else's
    assert tail_page_private(torch.frombuffer(mapping, dtype=torch.uint8, count=3 * page, offset=page))
    large = mmap.mmap(-1, (32 << 20) + 2 * page)
    big = torch.frombuffer(large, dtype=torch.uint8, count=(32 << 20) + 100, offset=64)
    assert tail_page_private(big)  # 32 MiB and more: glibc gives it a mapping of its own
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")  # glibc told never to map: it may lie on the heap
    assert not tail_page_private(big)


def test_copy_seconds_are_scaled_from_the_timed_batches_by_bytes():
    """The loop times one batch in ``copy_timing_every``: between two readings the copy seconds
    are the timed batches' seconds per byte over every byte copied, never negative, and zero
    before any batch was timed."""
    from torch_fastload.native import _copy_seconds

    empty = {"copy_s": 0.0, "timed_bytes": 0, "copied_bytes": 0}
    assert _copy_seconds(empty, {"copy_s": 0.0, "timed_bytes": 0, "copied_bytes": 10**9}) == 0.0
    one_timed = {"copy_s": 0.01, "timed_bytes": 10**8, "copied_bytes": 16 * 10**8}  # 10 GB/s
    assert _copy_seconds(empty, one_timed) == pytest.approx(0.16)
    later = {"copy_s": 0.02, "timed_bytes": 2 * 10**8, "copied_bytes": 32 * 10**8}
    assert _copy_seconds(one_timed, later) == pytest.approx(0.16)
    assert _copy_seconds(later, {"copy_s": 0.02, "timed_bytes": 2 * 10**8, "copied_bytes": 32 * 10**8}) == 0.0


def test_copy_timing_every_refuses_a_negative_count():
    with pytest.raises(ValueError, match="copy_timing_every"):
        with torch_fastload.config.override(copy_timing_every=-1):
            pass


# -- the turn thread (config turn_thread): group turns off the training thread's next() -------
def _turn_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "fastload-turn" and t.is_alive()]


def _torch_order(data, batch_size: int, seed: int) -> list:
    torch.manual_seed(seed)
    return [b[0].tolist() for b in torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True)]


def _on_threads(monkeypatch, name: str) -> list:
    """The names of the threads each call of NativePipeline.``name`` ran on."""
    threads = []
    real = getattr(NativePipeline, name)

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NativePipeline, name, spy)
    return threads


def test_turn_thread_is_auto_by_default_and_takes_booleans(monkeypatch):
    """'auto' (the default) turns it on only for CUDA outputs; 1/0 from the environment; a typo
    is an error naming the option, not a silent default."""
    from torch_fastload import config

    monkeypatch.delenv("TORCH_FASTLOAD_TURN_THREAD", raising=False)
    assert config.get("turn_thread") == "auto"
    for text, value in (("1", True), ("off", False), ("AUTO", "auto")):
        monkeypatch.setenv("TORCH_FASTLOAD_TURN_THREAD", text)
        assert config.get("turn_thread") == value
    monkeypatch.setenv("TORCH_FASTLOAD_TURN_THREAD", "sometimes")
    with pytest.raises(ValueError, match="turn_thread"):
        config.get("turn_thread")


@pytest.mark.parametrize("turn_thread", [True, False])
def test_the_turn_thread_takes_group_turns_and_every_epoch_equals_torch(turn_thread, monkeypatch):
    """With ``turn_thread`` the groups' turns run on the loop's thread while the consumer
    sleeps (a step's backward() lets go of the GIL so): each epoch equals torch's, batch for batch;
    the one thread is parked with the loop between epochs and serves the next (no thread start at
    an epoch's edge), and close() ends it. Off: every turn runs in next()."""
    data = TensorDataset(torch.arange(600) * 3, torch.arange(600))
    turns = _on_threads(monkeypatch, "_submit_group")
    seen = set()
    with torch_fastload.config.override(turn_thread=turn_thread):
        loader = DataLoader(data, batch_size=8, shuffle=True, device="cpu")
        for epoch in range(3):
            torch.manual_seed(epoch)
            ours = []
            for batch in loader:
                ours.append(batch[0].tolist())
                time.sleep(0.001)
            assert ours == _torch_order(data, 8, epoch)
            seen.update(_turn_threads())
        assert len(seen) == (1 if turn_thread else 0)  # one thread for every epoch, kept with the loop
        loader.close()
    assert not _turn_threads()
    on_turn_thread = turns.count("fastload-turn")
    assert on_turn_thread > 15 if turn_thread else on_turn_thread == 0


def test_the_turn_thread_stays_with_its_loop_and_ends_with_it():
    """The loop's turn thread serves every epoch that adopts the loop (no thread started at an
    epoch's edge); an epoch left midway stops its loop and the thread with it, and the next epoch
    starts another; an epoch with turn_thread off ends the adopted one. Every epoch equals torch's."""
    data = TensorDataset(torch.arange(400) * 3, torch.arange(400))
    with torch_fastload.config.override(turn_thread=True):
        loader = DataLoader(data, batch_size=8, shuffle=True, device="cpu")
        torch.manual_seed(0)
        assert [b[0].tolist() for b in loader] == _torch_order(data, 8, 0)
        (first,) = _turn_threads()
        torch.manual_seed(1)
        it = iter(loader)
        assert _turn_threads() == [first]  # the parked loop's thread, bound to this epoch
        got = [next(it)[0].tolist() for _ in range(3)]
        assert got == _torch_order(data, 8, 1)[:3]
        it._shutdown_workers()  # left midway: the loop stops, its thread ends
        assert not first.is_alive()
        torch.manual_seed(2)
        assert [b[0].tolist() for b in loader] == _torch_order(data, 8, 2)
        (second,) = _turn_threads()
        assert second is not first
    with torch_fastload.config.override(turn_thread=False):
        torch.manual_seed(3)
        assert [b[0].tolist() for b in loader] == _torch_order(data, 8, 3)
        assert not second.is_alive() and not _turn_threads()
    loader.close()


def test_a_turn_that_fails_on_the_turn_thread_is_raised_after_the_batches_before_it(monkeypatch):
    """An allocation failing on the turn thread: next() hands out every batch submitted before
    it, in order, then raises it; none is lost, repeated or invented, and the thread has ended.
    The loader's next epoch runs whole."""
    data = TensorDataset(torch.arange(400) * 3, torch.arange(400))
    real = NativePipeline._allocate_group
    failed = []

    def allocate(self, shapes, home, count):
        if threading.current_thread().name == "fastload-turn" and not failed:
            failed.append(True)
            raise RuntimeError("CUDA out of memory (a test's)")
        return real(self, shapes, home, count)

    monkeypatch.setattr(NativePipeline, "_allocate_group", allocate)
    with torch_fastload.config.override(turn_thread=True):
        loader = DataLoader(data, batch_size=8, shuffle=True, device="cpu")
        torch.manual_seed(1)
        got = []
        with pytest.raises(RuntimeError, match="out of memory \\(a test's\\)"):
            for batch in loader:
                got.append(batch[0].tolist())
                time.sleep(0.002)
        assert failed and 0 < len(got) < 50
        assert got == _torch_order(data, 8, 1)[: len(got)]
        assert not _turn_threads()
        torch.manual_seed(2)
        assert [b[0].tolist() for b in loader] == _torch_order(data, 8, 2)
        loader.close()


@pytest.mark.parametrize("locked", [True, False])
def test_next_waits_for_the_turn_in_progress_before_its_own(locked, monkeypatch):
    """The consumer finds nothing in flight while the turn thread is midway through a group's
    turn (its indices drawn and numbered, not yet submitted): next() waits for that turn under
    the turn lock, then takes its batches first. Control: without the lock, next() submits the
    following group in the meantime: batches come out of order, or the epoch ends without
    the turn's group."""
    import contextlib

    data = TensorDataset(torch.arange(800) * 3, torch.arange(800))
    real_claim, real_init = NativePipeline._claim_group, NativePipeline.__init__
    slowed = []

    def claim(self, count):
        claimed = real_claim(self, count)
        if threading.current_thread().name == "fastload-turn" and len(slowed) < 1:
            slowed.append(True)
            time.sleep(0.3)  # the consumer drains what is in flight meanwhile
        return claimed

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if not locked:
            self._turn_lock = contextlib.nullcontext()

    monkeypatch.setattr(NativePipeline, "_claim_group", claim)
    monkeypatch.setattr(NativePipeline, "__init__", init)
    with torch_fastload.config.override(turn_thread=True):
        loader = DataLoader(data, batch_size=8, shuffle=True, device="cpu")
        torch.manual_seed(5)
        ours = []
        for batch in loader:
            ours.append(batch[0].tolist())
            time.sleep(0.002)
        loader.close()
    assert slowed
    assert (ours == _torch_order(data, 8, 5)) == locked


def test_a_dropped_iterator_ends_its_turn_thread_without_the_garbage_collector():
    import weakref

    with torch_fastload.config.override(turn_thread=True):
        loader = DataLoader(TensorDataset(torch.arange(4000)), batch_size=8, shuffle=True, device="cpu")
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            it = iter(loader)
            for _ in range(5):
                next(it)
                time.sleep(0.002)
            assert _turn_threads()
            pipeline = weakref.ref(it._pipeline)
            del it
            assert pipeline() is None
        finally:
            if was_enabled:
                gc.enable()
        deadline = time.monotonic() + 5
        while _turn_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _turn_threads()
        loader.close()
