"""GPU paths: pinned pool, copy stream, events, hand-off, slot reuse, shutdown with copies in flight."""

import gc
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from batch_memory import batches_intact, numbered_rows
from conftest import pipeline_threads
from test_loader import Nested, assert_same
from torch.utils.data import Dataset, TensorDataset

from torch_fastload import DataLoader
from torch_fastload.pool import PinnedPool

pytestmark = pytest.mark.cuda
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELAY_CYCLES = 40_000_000  # ~20 ms at H100 clocks: copies sit in the stream long after being enqueued


class Filled(Dataset):
    """Batch i is a 4 MiB tensor full of i, so any mixing of batches is visible."""

    def __init__(self, n, numel=1 << 20):
        self.n, self.numel = n, numel

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.numel,), float(i)), torch.tensor(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_arrive_on_gpu_and_equal_torch(num_workers):
    ours = DataLoader(
        Nested(), batch_size=6, shuffle=True, num_workers=num_workers, generator=torch.Generator().manual_seed(4)
    )
    theirs = torch.utils.data.DataLoader(
        Nested(), batch_size=6, shuffle=True, num_workers=num_workers, generator=torch.Generator().manual_seed(4)
    )
    assert ours.device == torch.device("cuda", torch.cuda.current_device())
    count = 0
    for a, b in zip(ours, theirs, strict=True):
        assert a["image"].is_cuda and a["point"].x.is_cuda and a["meta"][0].is_cuda
        assert_same(a, b)
        count += 1
    assert count == 7
    assert ours.pool.pinned  # registered memory: torch's is_pinned() only knows its own allocator
    assert ours.stats().path.startswith("pinned-pool -> cuda")


@pytest.fixture(params=[True, False], ids=["one-call-stage", "python-stage"])
def stage_route(request, monkeypatch):
    """Both staging routes: the copies, rebase and device copy in one C++ call, or in torch calls.
    Yields a list whose length counts the batches that went through the one call."""
    from torch_fastload import transfer

    monkeypatch.setattr(transfer, "ONE_CALL_STAGE", request.param)
    calls = []
    original = transfer.CopyEngine.start_staged

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transfer.CopyEngine, "start_staged", counted)
    yield calls
    assert (len(calls) > 0) == request.param, "the staging route under test was not the one taken"


def test_user_stream_waits_for_delayed_copies(stage_route):
    loader = DataLoader(Filled(12), batch_size=None, prefetch=3)
    engine = loader.resources.engine
    engine.debug_delay_cycles = DELAY_CYCLES
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for rows, _index in loader:
            sums.append((rows * 2).sum())  # runs on `side`, which must wait for the copy
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [2.0 * i * (1 << 20) for i in range(12)]


def corrupted_batches(monkeypatch, naive: bool) -> int:
    """Run a 1-slot pool with copies delayed; count batches whose bytes came from another batch."""
    if naive:
        original = PinnedPool.release

        def release_without_waiting(self, slot, free_after=None, front=False, keep=None):
            original(self, slot, None, front)  # the bug: reuse the slot before its copy ran

        monkeypatch.setattr(PinnedPool, "release", release_without_waiting)
    loader = DataLoader(Filled(16), batch_size=None, pool_slots=1, prefetch=4, stage_threads=2)
    engine = loader.resources.engine
    engine.debug_delay_cycles = DELAY_CYCLES
    # No host synchronisation inside the loop: a blocking .item() would hold the GIL until the
    # delayed copy finished and so hide the race. Batch i must hold i (sequential sampler); the
    # label travels in the same slot, so it cannot serve as the reference.
    mismatches = [torch.any(rows != float(i)) for i, (rows, _) in enumerate(loader)]
    bad = int(torch.stack(mismatches).sum())
    loader.close()
    return bad


def test_slot_is_not_reused_before_its_copy_completed(monkeypatch, stage_route):
    assert corrupted_batches(monkeypatch, naive=False) == 0


def test_negative_control_naive_pool_corrupts_batches(monkeypatch, stage_route):
    assert corrupted_batches(monkeypatch, naive=True) > 0, "the race test failed to catch a naive pool"


def test_negative_control_hand_off_without_wait_reads_garbage(monkeypatch, stage_route):
    from torch_fastload.transfer import CopyEngine

    monkeypatch.setattr(CopyEngine, "hand_off", lambda self, copy: None)
    loader = DataLoader(Filled(8), batch_size=None, prefetch=4)
    engine = loader.resources.engine
    engine.debug_delay_cycles = DELAY_CYCLES
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        mismatches = [torch.any(rows != float(i)) for i, (rows, _) in enumerate(loader)]
        wrong = int(torch.stack(mismatches).sum())
    assert wrong > 0, "without the stream wait the consumer should see bytes before the copy landed"


def test_one_call_stage_delivers_mixed_dtypes_and_rebased_offsets(stage_route):
    """Fields of several dtypes and shapes plus Arrow-style offsets (rebased and widened in the
    slot) arrive equal through either route; the copy events time the copy."""
    import numpy as np

    from torch_fastload.staging import PendingOffsets

    class Mixed(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            raise AssertionError("whole batches only")

        def __fastload_batch__(self, indices):
            i = int(indices[0])
            raw = np.arange(i, i + 11, dtype=np.int32) * 3  # Arrow offsets that do not start at 0
            return {
                "f16": torch.full((5, 3), float(i), dtype=torch.float16),
                "i64": torch.arange(i, i + 7, dtype=torch.int64),
                "u8": torch.arange(9, dtype=torch.uint8) + i,
                "flag": torch.tensor([True, False, bool(i % 2)]),
                "scalar": torch.tensor(float(i)),
                "offsets": PendingOffsets([raw], [0], [len(raw)], [-int(raw[0])]),
            }

    loader = DataLoader(Mixed(), batch_size=1, device="cuda")
    for i, batch in enumerate(loader):
        assert batch["f16"].shape == (5, 3) and bool((batch["f16"] == i).all())
        assert batch["i64"].tolist() == list(range(i, i + 7))
        assert batch["u8"].tolist() == [k + i for k in range(9)]
        assert batch["flag"].tolist() == [True, False, bool(i % 2)]
        assert batch["scalar"].shape == () and float(batch["scalar"]) == i
        assert batch["offsets"].dtype == torch.int64 and batch["offsets"].tolist() == [3 * k for k in range(11)]
    assert loader.stats().stage_s["copy"] > 0


def test_cpu_device_with_pin_memory_yields_pinned_tensors():
    loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4, device="cpu", pin_memory=True)
    for (x,) in loader:
        assert x.device.type == "cpu" and x.is_pinned()


def test_gpu_soak_keeps_pinned_device_and_host_memory_flat():
    from test_shutdown import VaryingRows

    loader = DataLoader(VaryingRows(2000), batch_size=None, prefetch=3, oversize="grow")
    process = psutil.Process()
    marks = []
    for _epoch in range(2):
        for i, (rows, index) in enumerate(loader):
            assert rows.is_cuda and rows.shape[0] == 1 + (int(index) * 7919) % 64
            if i % 400 == 399:
                torch.cuda.synchronize()
                gc.collect()
                marks.append((process.memory_info().rss, torch.cuda.memory_allocated(), loader.pool.nbytes))
    rss, device_bytes, pool_bytes = zip(*marks)
    assert len(set(pool_bytes[1:])) == 1, f"pool changed size after warm-up: {pool_bytes}"
    assert max(rss[2:]) - rss[1] < 64 * 2**20, [r >> 20 for r in rss]
    assert max(device_bytes[1:]) - min(device_bytes[1:]) < 64 * 2**20, device_bytes
    assert loader.stats().pool_regrows <= 6


SHUTDOWN_SCRIPT = """
    import time, torch
    from torch.utils.data import Dataset
    from torch_fastload import DataLoader

    class Filled(Dataset):
        def __len__(self): return 50
        def __getitem__(self, i): return torch.full((4 << 20,), float(i))

    loader = DataLoader(Filled(), batch_size=None, prefetch=4, pool_slots=2)
    engine = loader.resources.engine
    engine.debug_delay_cycles = 400_000_000   # ~0.2 s per copy
    it = iter(loader)
    first = next(it)
    assert bool(torch.all(first == 0))
    {ending}
"""


@pytest.mark.parametrize(
    "ending",
    [
        # break + del + close: close must wait for queued copies before unregistering the pool
        "del it\nt = time.perf_counter(); loader.close(); print('closed after', time.perf_counter() - t)\n"
        "assert loader.pool is None\nprint('FREED')",
        # interpreter exit with copies still queued on the copy stream
        "print('FREED')",
    ],
)
def test_shutdown_waits_for_copies_in_flight(ending):
    body = textwrap.dedent(SHUTDOWN_SCRIPT).replace("{ending}", ending)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_LAUNCH_BLOCKING="0")
    result = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr
    assert "FREED" in result.stdout
    assert "CUDA error" not in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.multigpu
def test_non_zero_device_and_its_streams():
    device = torch.device("cuda", 1)
    loader = DataLoader(Filled(6), batch_size=None, device=device)
    with torch.cuda.device(1):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for rows, index in loader:
                assert rows.device == device
                assert bool(torch.all(rows == float(index)))
    assert torch.cuda.current_device() == 0
    assert pipeline_threads() == []


@pytest.mark.parametrize("unsafe", [False, True])
def test_python_pipeline_copies_wait_for_the_training_streams_last_use_of_their_memory(unsafe, monkeypatch):
    """With ``output_stream='consumer'``, the Python pipeline allocates each batch on the
    training loop's stream (here the legacy default, handle 0) from a stage thread; the caching
    allocator may hand it a block whose queued kernels still write it (a fill queued behind a
    sleep). The copy stream waits for that stream up to the allocation (negative control:
    without it the fill lands on the batch)."""
    from torch_fastload import config, transfer

    monkeypatch.setattr(transfer, "UNSAFE_SKIP_ALLOCATION_WAIT", unsafe)
    n, batch, width = 512, 32, 4096
    rows = numbered_rows(n, width)
    with config.override(native="off", output_stream="consumer"):
        loader = DataLoader(TensorDataset(rows), batch_size=batch, prefetch=2)
        it = iter(loader)
        got = []
        for _ in range(len(loader)):
            torch.cuda._sleep(DELAY_CYCLES // 4)  # ~5 ms: the stage threads copy meanwhile
            scratch = torch.full((batch, width), -1, dtype=torch.int64, device="cuda")  # runs after the sleep
            del scratch  # its block is free on this stream at once: a stage thread may take it
            (got_rows,) = next(it)
            got.append(got_rows)
        assert "pinned-pool" in loader.stats().path
        loader.close()
    intact = batches_intact(got, rows, batch)
    assert intact is not unsafe  # the wait is what keeps batches intact


@pytest.mark.parametrize("unsafe", [False, True])
def test_python_pipeline_copies_do_not_rewrite_a_batch_the_training_stream_still_reads(unsafe, monkeypatch):
    """By default the Python pipeline allocates each batch on its copy stream and hands it over
    with record_stream: a batch freed while the training stream's kernels still read it (a
    clone queued behind a sleep) must not take the next batch's copy before they ran (negative
    control: without the record_stream the clone reads the next batch's rows)."""
    from torch_fastload import config, transfer

    monkeypatch.setattr(transfer, "UNSAFE_SKIP_HANDOVER", unsafe)
    n, batch, width = 512, 32, 4096
    rows = numbered_rows(n, width)
    with config.override(native="off", output_stream="copy"):
        loader = DataLoader(TensorDataset(rows), batch_size=batch, prefetch=2)
        seen = []
        for (got_rows,) in loader:
            torch.cuda._sleep(DELAY_CYCLES // 4)  # ~5 ms: the stage threads copy meanwhile
            seen.append(got_rows.clone())  # reads the batch after the sleep
            del got_rows  # free on the copy stream: a stage thread's next allocation may take it
        assert "pinned-pool" in loader.stats().path
        loader.close()
    assert len(seen) == n // batch
    intact = batches_intact(seen, rows, batch)
    assert intact is not unsafe  # the hand-over is what keeps batches intact
