"""The C++ steady state on the GPU: batches equal torch's for every source and read path, the
consumer's stream waits on the loop's copies, and a pinned slot is rewritten only after its
copy ran (negative control: without the wait, delayed copies carry the next batch's bytes)."""

import mmap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from batch_memory import PAGE, batches_intact, numbered_rows, on_own_pages
from torch.utils.data import TensorDataset

import torch_fastload
from torch_fastload import ArrayDataset, DataLoader, RecordDataset, native, pack
from torch_fastload.native import NativePipeline

pytestmark = pytest.mark.cuda
DELAY_CYCLES = 200_000_000  # ~100 ms at H100 clocks: the copy stream is busy long after the loop staged


def rows_dataset(n=96, width=4096):
    rows = on_own_pages(torch.arange(n * width, dtype=torch.int32).reshape(n, width))  # pinned in place
    return TensorDataset(rows, torch.arange(n))


def loops_synced(monkeypatch) -> list:
    """The C++ loops of the pipelines that sync their stats from now on (each epoch's end does),
    for reading the loop's own counters after the loader closed."""
    loops = []
    real = NativePipeline.sync_stats

    def keeping_the_loop(self):
        loops.append(self.loop)
        real(self)

    monkeypatch.setattr(NativePipeline, "sync_stats", keeping_the_loop)
    return loops


@pytest.mark.parametrize("width", [4096, 1024])  # 16 KiB rows: DMA from the registered dataset; 4 KiB: slot
def test_tensor_dataset_on_the_loop_equals_torch_and_the_python_pipeline(width):
    data = rows_dataset(width=width)
    kwargs = dict(batch_size=8, shuffle=True)
    theirs = list(torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(1), **kwargs))
    loader = DataLoader(data, generator=torch.Generator().manual_seed(1), **kwargs)
    ours = list(loader)
    stats = loader.stats()
    assert stats.path.startswith("native loop -> cuda")
    assert (stats.io_bytes.get("registered-memory", 0) > 0) == (width * 4 >= native.DMA_MIN_ROW_BYTES), stats.io_bytes
    loader.close()  # unpins the dataset: a second loader registers it again
    with torch_fastload.config.override(native="off"):
        python = list(DataLoader(data, generator=torch.Generator().manual_seed(1), **kwargs))
    for a, b, c in zip(ours, python, theirs, strict=True):
        assert a[0].is_cuda and torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
        assert torch.equal(b[0].cpu(), c[0])


@pytest.mark.parametrize("blocks", ["group", "batch"])
@pytest.mark.parametrize("width", [4096, 1024])  # registered rows (DMA or kernel); 4 KiB rows through pinned slots
def test_a_kept_loop_serves_every_epoch_and_hands_its_slots_on(width, blocks):
    """Epochs run to their end leave the loop, its pinned slots and its plans to the next one:
    every epoch equals torch's, on the same loop; an epoch whose loop differs (copy timing) gets
    the kept one's slots (it runs on the loop, not on the Python pipeline); close() stops it."""
    data = rows_dataset(n=300, width=width)
    kwargs = dict(batch_size=16, shuffle=True)
    theirs = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(4), **kwargs)
    loader = DataLoader(data, generator=torch.Generator().manual_seed(4), **kwargs)
    loops = []
    with torch_fastload.config.override(output_blocks=blocks):
        for every in (16, 16, 16, 4):
            with torch_fastload.config.override(copy_timing_every=every):
                it = iter(loader)
                assert isinstance(it._pipeline, NativePipeline)
                loops.append(it._pipeline.loop)
                for a, c in zip(it, theirs, strict=True):
                    assert a[0].is_cuda and torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
    assert loops[1] is loops[0] and loops[2] is loops[0] and loops[3] is not loops[0]
    assert loader.stats().batches == 4 * len(theirs)
    pool = loader.pool
    if width == 1024:  # the kept loop holds every slot until it is stopped
        assert pool.lease_all() is None
        loader.resources.close_parked()
        slots = pool.lease_all()
        assert slots is not None and len(slots) == pool.num_slots
        for slot in slots:
            pool.release(slot)
    loader.close()


@pytest.mark.parametrize("blocks", ["group", "batch"])
@pytest.mark.parametrize("width", [4096, 1024])
def test_the_turn_thread_allocates_on_the_copy_stream_and_every_epoch_equals_torch(width, blocks):
    """config turn_thread ('auto', the default, for CUDA outputs on the copy stream): the groups'
    outputs allocated and submitted on the pipeline's thread (its own current stream switched to
    the copy stream) while the training thread runs a step that lets go of the GIL (a
    synchronize); every batch equals torch's over three epochs, each read by a kernel on the
    training stream, and the thread took turns."""
    data = rows_dataset(n=600, width=width)
    kwargs = dict(batch_size=16, shuffle=True)
    theirs = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(6), **kwargs)
    loader = DataLoader(data, generator=torch.Generator().manual_seed(6), **kwargs)
    turns = []
    real = NativePipeline._submit_group

    def spy(self, *args, **kw):
        turns.append(threading.current_thread().name)
        return real(self, *args, **kw)

    NativePipeline._submit_group = spy
    try:
        with torch_fastload.config.override(output_blocks=blocks, turn_thread="auto"):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(3):
                    for a, c in zip(loader, theirs, strict=True):
                        total = a[0].double().sum()  # read on the training stream
                        torch.cuda.synchronize()  # the step lets go of the GIL
                        assert torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
                        assert total.item() == c[0].double().sum().item()
    finally:
        NativePipeline._submit_group = real
    loader.close()
    assert turns.count("fastload-turn") > 5
    assert not [t for t in threading.enumerate() if t.name == "fastload-turn" and t.is_alive()]


def test_outputs_allocated_on_the_consumer_stream_keep_their_turns_in_next():
    """output_stream='consumer' allocates on the training thread's stream, which only next()
    knows: 'auto' starts no turn thread there, and the epoch still equals torch's."""
    data = rows_dataset(n=200)
    kwargs = dict(batch_size=16, shuffle=True)
    theirs = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(2), **kwargs)
    with torch_fastload.config.override(output_stream="consumer", turn_thread="auto"):
        loader = DataLoader(data, generator=torch.Generator().manual_seed(2), **kwargs)
        it = iter(loader)
        assert it._pipeline._turns is None
        for a, c in zip(it, theirs, strict=True):
            assert torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
    loader.close()


@pytest.mark.parametrize("width", [4096, 12345])  # 16 KiB rows; 49,380-byte rows (not 16-byte multiples)
def test_registered_rows_by_the_gather_kernel_equal_torch_every_epoch(width):
    """memory_rows='kernel': the dataset's registered rows read by the gather kernel, its table
    in the slot; batches equal torch's over three epochs (slots reused: a table rewritten too
    early would send wrong rows)."""
    data = rows_dataset(n=200, width=width)
    kwargs = dict(batch_size=16, shuffle=True)
    theirs = [
        list(torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(e), **kwargs)) for e in range(3)
    ]
    with torch_fastload.config.override(memory_rows="kernel"):
        for epoch in range(3):
            loader = DataLoader(data, generator=torch.Generator().manual_seed(epoch), prefetch=6, **kwargs)
            ours = list(loader)
            assert loader.stats().io_bytes.get("registered-memory", 0) == len(data) * width * 4
            for a, c in zip(ours, theirs[epoch], strict=True):
                assert torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
            loader.close()


@pytest.mark.parametrize("merge", ["1", "0"])
@pytest.mark.parametrize("route", ["dma", "kernel"])
def test_slot_parts_ride_along_the_rows_copy_and_equal_torch(monkeypatch, route, merge):
    """Two registered row fields (different tensors, 16 KiB and 49,380-byte rows), labels, a small
    float field and 8 KiB rows gathered into the slot (128 KiB a batch: more than the kernel's
    piece, so they keep a copy of their own on the kernel route). The slot's parts go in the
    rows' one batched copy or gather launch (merge '1'; '0': a cuMemcpyHtoDAsync each, the
    before): every batch equals torch's over two epochs."""
    monkeypatch.setenv("TORCH_FASTLOAD_MERGE_PARTS", merge)
    n = 160
    wide = on_own_pages(torch.arange(n * 4096, dtype=torch.int32).reshape(n, 4096))
    odd = on_own_pages(torch.arange(n * 12345, dtype=torch.int32).reshape(n, 12345) * 7)
    small = torch.arange(n * 2048, dtype=torch.int32).reshape(n, 2048) - 5  # under DMA_MIN_ROW_BYTES
    data = TensorDataset(wide, torch.arange(n), odd, torch.rand(n, 3), small)
    kwargs = dict(batch_size=16, shuffle=True)
    with torch_fastload.config.override(memory_rows=route):
        loader = DataLoader(data, generator=torch.Generator().manual_seed(4), prefetch=6, **kwargs)
        reference = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(4), **kwargs)
        for _ in range(2):
            it = iter(loader)
            assert isinstance(it._pipeline, NativePipeline)
            got = list(it)
            for a, b in zip(got, list(reference), strict=True):
                assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b, strict=True))
        assert loader.stats().io_bytes.get("registered-memory", 0) > 0, loader.stats().io_bytes
        loader.close()


def test_auto_rows_route_chooses_once_and_later_epochs_keep_it():
    """memory_rows='auto' (the default): the copy engines while the first batches are watched,
    then the chosen route; every batch equals torch's across the switch, and the loader's next
    epoch starts on the choice. (128 KiB rows: rows under 64 KiB take the kernel from the start.)"""
    data = rows_dataset(n=400, width=32768)
    kwargs = dict(batch_size=8, shuffle=True)
    theirs = list(torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(3), **kwargs))
    loader = DataLoader(data, generator=torch.Generator().manual_seed(3), **kwargs)
    x = torch.zeros(1, device="cuda")
    ours = []
    for batch in loader:
        for _ in range(50):  # a launch-bound step
            x.add_(1)
        ours.append(batch)
    assert loader.resources.copy_route in ("kernel", "dma"), loader.stats().path
    assert "registered rows:" in loader.stats().path
    for a, c in zip(ours, theirs, strict=True):
        assert torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
    it = iter(loader)
    assert it._pipeline._copy_route is None and it._pipeline.loop.rows_kernel == (
        loader.resources.copy_route == "kernel"
    )
    it.close()


@pytest.mark.parametrize("across", [True, False])
def test_the_route_trial_goes_on_across_epochs_shorter_than_it(monkeypatch, across):
    """memory_rows='auto' watches ~32 batches before it chooses. Epochs of 10 batches hand the
    count on, so the fourth epoch chooses; the control (each epoch starting the trial over) never
    leaves the copy engines. Every batch equals torch's across the switch."""
    monkeypatch.setattr(native, "ROUTE_TRIAL_ACROSS_EPOCHS", across)
    data = rows_dataset(n=80, width=32768)  # 128 KiB rows: the copy engines until the trial chooses
    kwargs = dict(batch_size=8, shuffle=True)
    loader = DataLoader(data, generator=torch.Generator().manual_seed(5), **kwargs)
    torch_loader = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(5), **kwargs)
    x = torch.zeros(1, device="cuda")
    for _epoch in range(5):
        theirs = list(torch_loader)
        ours = []
        for batch in loader:
            for _ in range(50):  # a launch-bound step
                x.add_(1)
            ours.append(batch)
        assert len(ours) == 10
        for a, c in zip(ours, theirs, strict=True):
            assert torch.equal(a[0].cpu(), c[0]) and torch.equal(a[1].cpu(), c[1])
    if across:
        assert loader.resources.copy_route in ("kernel", "dma"), loader.stats().path
        assert loader.resources.copy_route_trial is None
    else:
        assert loader.resources.copy_route is None
    loader.close()


@pytest.mark.parametrize("table", ["slot", "ring"])
@pytest.mark.parametrize(
    "mapped_copy,map_budget", [("kernel", "25%"), ("kernel", "100%"), ("dma", "25%"), ("kernel", 0)]
)
def test_file_sources_on_the_loop_equal_torch(tmp_path, mapped_copy, map_budget, table, monkeypatch):
    """ArrayDataset (two files) and RecordDataset (shards, records of 0-5,000 bytes) on the loop,
    some files mapped or all or none; the gather kernel's table of mapped ranges (and record
    offsets) in the batch's slot, one launch a batch (table 'slot'), or the ring's launch a file
    (the before)."""
    monkeypatch.setenv("TORCH_FASTLOAD_MAPPED_TABLE", table)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((301, 257)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 9, 301))
    blobs = [(rng.integers(0, 256, int(rng.integers(0, 5000)), dtype=np.uint8).tobytes(), i % 7) for i in range(150)]
    pack(blobs, tmp_path / "pack", shard_size=64 << 10, progress=False)
    arrays = ArrayDataset(tmp_path / "x.npy", tmp_path / "y.npy")
    records = RecordDataset(tmp_path / "pack")
    for dataset, collate in ((arrays, None), (records, records.collate)):
        with torch_fastload.config.override(mapped_copy=mapped_copy):
            loader = DataLoader(
                dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3), map_budget=map_budget
            )
            ours = list(loader)
        theirs = list(
            torch.utils.data.DataLoader(
                dataset, batch_size=16, shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(3)
            )
        )
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            for x, y in zip(a, b):
                assert x.is_cuda and x.dtype == y.dtype and torch.equal(x.cpu(), y)
        stats = loader.stats()
        assert stats.path.startswith("native loop") and stats.batches == len(theirs)
        assert (stats.io_bytes.get("mapped", 0) > 0) == (map_budget != 0), stats.io_bytes


BACK_TO_BACK_SCRIPT = """
import sys
import numpy as np, torch
from torch_fastload import ArrayDataset, DataLoader
root, rows, width = sys.argv[1], 1024, 49152  # 192 KiB float32 rows: a 256-row field is 48 MiB
np.save(f"{root}/x.npy", np.arange(rows * width, dtype=np.float32).reshape(rows, width))
np.save(f"{root}/y.npy", np.arange(rows, dtype=np.int64) * 7)
x, y = np.load(f"{root}/x.npy"), np.load(f"{root}/y.npy")
loader = DataLoader(ArrayDataset(f"{root}/x.npy", f"{root}/y.npy"), batch_size=256, shuffle=True,
                    generator=torch.Generator().manual_seed(0), map_budget=0, device="cuda")
adjacent = 0
for features, labels in loader:
    ends = {features.data_ptr() + features.nbytes, labels.data_ptr() + labels.nbytes}
    adjacent += features.data_ptr() in ends or labels.data_ptr() in ends
    ids = labels.cpu().numpy() // 7
    assert np.array_equal(features.cpu().numpy(), x[ids]), "features"
    assert np.array_equal(labels.cpu().numpy(), y[ids]), "labels"
print("ring", loader.stats().io_bytes.get("engine-posix", 0) > 0, "adjacent", adjacent)
"""


def test_ring_reads_into_output_fields_that_lie_back_to_back(tmp_path):
    """Each output field is its own tensor; a fresh process puts a 48 MiB field's segment right
    before the next field's, so a pinned-ring copy coalesced across the boundary spans two
    allocations and the driver refuses it (found on the H100: every ArrayDataset(features,
    labels) epoch through the ring failed at batch 0). Run in a fresh process: the layout that
    exposes it is the allocator's first one."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", BACK_TO_BACK_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ring True" in done.stdout, done.stdout
    assert "adjacent 0" not in done.stdout, f"no batch had back-to-back fields (case not exercised): {done.stdout}"


@pytest.mark.parametrize("mapped_copy,kernel", [("kernel", True), ("dma", False)])
def test_mapped_copy_names_the_route_of_mapped_files(tmp_path, mapped_copy, kernel):
    """mapped_copy picks how mapped file ranges move on the loop, whatever memory_rows says (it
    used to be ignored there: any loader that could launch the kernel used it)."""
    x = np.random.default_rng(0).standard_normal((257, 4096)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    with torch_fastload.config.override(mapped_copy=mapped_copy):
        loader = DataLoader(ArrayDataset(tmp_path / "x.npy"), batch_size=16, map_budget="100%")
    it = iter(loader)
    assert it._pipeline.loop.mapped_kernel == kernel and it._pipeline._copy_route is None
    ours = torch.cat([b.cpu() for b in it])
    assert torch.equal(ours, torch.from_numpy(x)) and loader.stats().io_bytes.get("mapped", 0) == x.nbytes


def test_auto_mapped_copy_chooses_once_for_the_loader(tmp_path):
    """mapped_copy='auto' (the default): the copy engines while the first batches are watched,
    then the chosen route; the batches equal the file's rows across the switch and the next
    epoch starts on the choice."""
    x = np.random.default_rng(1).standard_normal((400, 32768)).astype(np.float32)  # 128 KiB rows
    np.save(tmp_path / "x.npy", x)
    loader = DataLoader(ArrayDataset(tmp_path / "x.npy"), batch_size=8, map_budget="100%")
    it = iter(loader)
    assert it._pipeline._copy_route is not None and not it._pipeline.loop.mapped_kernel
    y = torch.zeros(1, device="cuda")
    ours = []
    for batch in it:
        for _ in range(50):  # a launch-bound step
            y.add_(1)
        ours.append(batch.cpu())
    assert torch.equal(torch.cat(ours), torch.from_numpy(x))
    assert loader.resources.copy_route in ("kernel", "dma") and "mapped files:" in loader.stats().path
    it = iter(loader)
    assert it._pipeline._copy_route is None
    assert it._pipeline.loop.mapped_kernel == (loader.resources.copy_route == "kernel")
    it.close()


@pytest.mark.parametrize("source", ["tensor", "file"])
def test_auto_sends_short_rows_by_the_kernel_from_the_first_batch(tmp_path, source):
    """Rows shorter than KERNEL_BELOW_BYTES never reach the link's rate one DMA copy each (16 KiB
    rows: 12 GB/s against the kernel's 36), so 'auto' does not try the copy engines on them."""
    x = torch.arange(300 * 4096, dtype=torch.float32).reshape(300, 4096)  # 16 KiB rows
    if source == "tensor":
        dataset = TensorDataset(on_own_pages(x))
    else:
        np.save(tmp_path / "x.npy", x.numpy())
        dataset = ArrayDataset(tmp_path / "x.npy")
    loader = DataLoader(dataset, batch_size=16, map_budget="100%")
    it = iter(loader)
    pipeline = it._pipeline
    assert pipeline._copy_route is None
    assert pipeline.loop.rows_kernel if source == "tensor" else pipeline.loop.mapped_kernel
    assert "gather kernel" in loader.stats().path
    ours = torch.cat([(b[0] if source == "tensor" else b).cpu() for b in it])
    assert torch.equal(ours, x)


def test_consumer_stream_waits_for_delayed_loop_copies():
    data = rows_dataset()
    loader = DataLoader(data, batch_size=8, prefetch=3)
    with torch.cuda.stream(loader.resources.engine.stream):
        torch.cuda._sleep(DELAY_CYCLES)  # every copy the loop enqueues now waits behind this
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for rows, _ in loader:
            sums.append(rows.sum(dtype=torch.int64))
    torch.cuda.synchronize()
    expected = [int(data.tensors[0][i * 8 : (i + 1) * 8].sum()) for i in range(12)]
    assert [int(s) for s in sums] == expected


@pytest.mark.parametrize("slot_event", ["ready", "own"])
@pytest.mark.parametrize("enqueue", ["next", "workers"])
@pytest.mark.parametrize("unsafe", [False, True])
def test_slot_is_rewritten_only_after_its_copy_ran(unsafe, enqueue, slot_event, monkeypatch):
    """One slot reused every batch while its copy waits behind a sleep (negative control: reused
    without the wait, batches come out wrong). slot_event='ready': the batch's ready event is the
    slot's, and next() of a batch whose slot was taken again skips its wait."""
    monkeypatch.setattr(native, "UNSAFE_SLOT_REUSE", unsafe)
    monkeypatch.setenv("TORCH_FASTLOAD_SLOT_EVENT", slot_event)
    monkeypatch.setattr(native, "SMALL_SLOT_BYTES", 0)  # pool_slots=1 holds: one slot, reused every batch
    monkeypatch.setenv("TORCH_FASTLOAD_COPY_ENQUEUE", enqueue)
    data = rows_dataset(n=64, width=2048)  # 8 KiB rows: gathered into the slot (not DMA'd from the dataset)
    loader = DataLoader(data, batch_size=8, pool_slots=1, prefetch=2)
    with torch.cuda.stream(loader.resources.engine.stream):
        torch.cuda._sleep(DELAY_CYCLES)  # the slot's H2D copy waits while the loop stages the next batch
    it = iter(loader)
    assert isinstance(it._pipeline, NativePipeline)
    got = [rows.cpu() for rows, _ in it]
    intact = all(torch.equal(g, data.tensors[0][i * 8 : (i + 1) * 8]) for i, g in enumerate(got))
    assert intact is not unsafe  # the wait is what keeps batches intact


@pytest.mark.parametrize("mark", ["group", "batch"])
@pytest.mark.parametrize("unsafe", [False, True])
@pytest.mark.parametrize(
    "width, route",
    [(1, "auto"), (4096, "dma"), (4096, "kernel")],  # 8-byte rows through a slot; 32 KiB rows from the dataset
)
def test_outputs_are_written_after_the_training_streams_last_use_of_their_memory(
    unsafe, width, route, mark, monkeypatch
):
    """Outputs allocated on the consumer's stream, a plain loop on the legacy default stream
    (handle 0): the caching allocator gives a batch's output memory that the stream's queued
    kernels still write (here a fill queued behind a sleep). The loop's copies must wait for them
    (negative control: without the wait the fill lands on top of the batch, as the labels
    nll_loss once found out of range)."""
    monkeypatch.setattr(native, "UNSAFE_SKIP_ALLOCATION_WAIT", unsafe)
    monkeypatch.setenv("TORCH_FASTLOAD_ALLOCATION_MARK", mark)  # group: one event (and wait) a group
    n, batch = 512, 32
    rows = numbered_rows(n, width)
    with torch_fastload.config.override(memory_rows=route, output_stream="consumer"):
        loader = DataLoader(TensorDataset(rows), batch_size=batch, prefetch=2)
        it = iter(loader)
        assert isinstance(it._pipeline, NativePipeline)
        got = []
        for _ in range(len(loader)):
            torch.cuda._sleep(DELAY_CYCLES // 20)  # ~5 ms: the loop stages meanwhile
            scratch = torch.full((batch, width), -1, dtype=torch.int64, device="cuda")  # runs after the sleep
            del scratch  # its memory is free on this stream at once: next() allocates a batch there
            (got_rows,) = next(it)
            got.append(got_rows)
        with pytest.raises(StopIteration):
            next(it)
        loader.close()
    intact = batches_intact(got, rows, batch)
    assert intact is not unsafe  # the wait is what keeps batches intact


@pytest.mark.parametrize("unsafe", [False, True])
@pytest.mark.parametrize("width, route", [(1, "auto"), (4096, "dma"), (4096, "kernel")])
@pytest.mark.parametrize("ahead, blocks", [(1, "batch"), (4, "batch"), (4, "group")])
def test_copy_stream_outputs_are_not_rewritten_while_the_training_stream_reads_them(
    unsafe, width, route, ahead, blocks, monkeypatch
):
    """Outputs allocated on the copy stream (the default), one batch at a time or several
    (``allocate_ahead``): a batch freed by the training loop while its kernels still read it (a
    clone queued behind a sleep) must not be handed to later batches' copies before those kernels
    ran. next()'s record_stream is what holds the block back (negative control: without it the
    clone reads a later batch's rows)."""
    monkeypatch.setattr(native, "UNSAFE_SKIP_HANDOVER", unsafe)
    n, batch = 512, 32
    rows = numbered_rows(n, width)
    with torch_fastload.config.override(
        memory_rows=route, output_stream="copy", allocate_ahead=ahead, output_blocks=blocks
    ):
        loader = DataLoader(TensorDataset(rows), batch_size=batch, prefetch=2)
        it = iter(loader)
        assert isinstance(it._pipeline, NativePipeline)
        seen = []
        for (got_rows,) in it:
            torch.cuda._sleep(DELAY_CYCLES // 20)  # ~5 ms: the loop stages the next batches meanwhile
            seen.append(got_rows.clone())  # reads the batch after the sleep
            del got_rows  # free on the copy stream: the next allocation there may take its block
        loader.close()
    assert len(seen) == n // batch
    intact = batches_intact(seen, rows, batch)
    assert intact is not unsafe  # the hand-over is what keeps batches intact


def _overlapping_views():
    """Two tensors of 64 KiB rows on one storage whose page ranges overlap: CUDA registers a
    page once, so the second registration is refused. The storage is a mapping of its own: from
    the heap it could share a page with memory an earlier test left registered."""
    mapping = mmap.mmap(-1, 80 * 16384 * 4)
    storage = torch.frombuffer(mapping, dtype=torch.int32)
    storage.copy_(torch.arange(80 * 16384, dtype=torch.int32))
    first = storage[: 40 * 16384].view(40, 16384)
    second = storage[40 * 16384 - 100 : 40 * 16384 - 100 + 30 * 16384].view(30, 16384)
    return first, second


@pytest.mark.parametrize("route", ["driver", "runtime"])
def test_a_refused_registration_does_not_surface_in_torchs_next_launch(route):
    """A refused registration (pages already registered) is the loader's business: it gathers
    those rows on the CPU. Through the runtime the refusal stays in the thread's last-error slot
    and torch's next launch check raises it (the control, run to show the test sees it)."""
    from torch_fastload import engine

    first, second = _overlapping_views()
    assert engine.host_register(first.data_ptr(), first.numel() * 4) == 0
    try:
        if route == "driver":
            assert engine.host_register(second.data_ptr(), second.numel() * 4) != 0
            torch.ones(4, device="cuda").add_(1)
        else:
            assert int(torch.cuda.cudart().cudaHostRegister(second.data_ptr(), second.numel() * 4, 0)) != 0
            with pytest.raises(RuntimeError):
                torch.ones(4, device="cuda").add_(1)
        torch.cuda.synchronize()
    finally:
        assert engine.host_unregister(first.data_ptr()) == 0


def test_loaders_over_tensors_sharing_pages_deliver_both():
    """The second loader's rows cannot be registered (their pages are the first's); they are
    gathered on the CPU, and both loaders' batches equal their tensors."""
    first, second = _overlapping_views()
    one = DataLoader(TensorDataset(first), batch_size=8, map_budget="100%")
    it_one = iter(one)
    assert one.resources._registered  # registered where it lies
    two = DataLoader(TensorDataset(second), batch_size=8, map_budget="100%")
    got_two = torch.cat([b.cpu() for (b,) in two])
    got_one = torch.cat([b.cpu() for (b,) in it_one])
    assert not two.resources._registered
    assert torch.equal(got_one, first) and torch.equal(got_two, second)


@pytest.mark.parametrize("checked", [True, False])
def test_a_tensor_sharing_its_last_page_is_not_pinned_in_place(monkeypatch, checked):
    """CUDA pins whole pages: a dataset tensor ending inside a page that also starts another
    buffer (here a neighbour on the same mapping; in the wild, the next heap allocation) would
    make every CUDA copy of that buffer fail with "invalid argument" while the loader runs. The
    loader gathers such a tensor's rows on the CPU and says so; its batches are unchanged.
    Control (``checked=False``): pinned anyway, the neighbour's copy fails."""
    from torch_fastload import resources

    if not checked:
        monkeypatch.setattr(resources, "tail_page_private", lambda tensor: True)
    mapping = mmap.mmap(-1, 32 * PAGE)
    start = PAGE // 2  # 5 rows of 16 KiB from half a page in: the tensor ends mid-page
    rows = torch.frombuffer(mapping, dtype=torch.int32, count=5 * 4096, offset=start).view(5, 4096)
    rows.copy_(torch.arange(5 * 4096, dtype=torch.int32).view(5, 4096))
    neighbour = torch.frombuffer(mapping, dtype=torch.uint8, count=2 * PAGE, offset=start + rows.nbytes)
    loader = DataLoader(TensorDataset(rows), batch_size=2, map_budget="100%")
    it = iter(loader)
    got = [next(it)[0]]
    assert bool(loader.resources._registered) is not checked
    assert ("not pinned in place" in loader.stats().path) is checked
    src = (torch.arange(2 * PAGE, device="cuda") % 251).to(torch.uint8)
    if checked:
        neighbour.copy_(src)
        assert torch.equal(neighbour, src.cpu())
    else:
        with pytest.raises(RuntimeError, match="invalid argument"):
            neighbour.copy_(src)
            torch.cuda.synchronize()
    got += [b[0] for b in it]
    assert torch.equal(torch.cat(got).cpu(), rows)
    loader.close()


@pytest.mark.parametrize("released", [True, False])
def test_a_loader_collected_unclosed_unregisters_its_tensors(monkeypatch, released):
    """A loader dropped without close() takes its tensors' registrations with it. Kept, they
    outlive the tensor (the pages stay registered after it is freed), and later allocations
    landing there break copies to them. Control (``released=False``): a finalizer that does
    nothing leaves the pages registered."""
    import gc
    import weakref

    from torch_fastload import engine, resources

    if not released:
        monkeypatch.setattr(resources, "_release_registrations", lambda registered, engines: None)
    mapping = mmap.mmap(-1, 64 * 16384 * 4)  # pages of their own: no earlier registration shares them
    x = torch.frombuffer(mapping, dtype=torch.int32).view(64, 16384)  # 64 KiB rows: registered
    loader = DataLoader(TensorDataset(x), batch_size=8, map_budget="100%")
    assert sum(int(b[0].sum()) for b in loader) == int(x.sum())
    assert loader.resources._registered
    alive = weakref.ref(loader.resources)
    del loader
    gc.collect()
    assert alive() is None
    code = engine.host_register(x.data_ptr(), x.numel() * 4)  # refused (712) while still registered
    try:
        assert (code == 0) is released
    finally:
        engine.host_unregister(x.data_ptr())
        resources._REGISTRATIONS._ranges.pop(resources._HostRegistrations._pages(x.data_ptr(), x.numel() * 4), None)


def test_planned_batches_are_allocated_several_at_a_time_on_the_copy_stream(monkeypatch):
    """``allocate_ahead``: the copy stream is switched to once per group of four batches of the
    planned size (plus the first batch and the short last one, each alone); the epoch still
    equals torch's, each field its own tensor."""
    rows = torch.arange(1000 * 6, dtype=torch.float32).view(1000, 6)
    labels = torch.arange(1000)
    engine_calls = []
    from torch_fastload.transfer import CopyEngine

    real = CopyEngine.allocate_on

    def counting(self, stream, shapes):
        engine_calls.append(len(shapes))
        return real(self, stream, shapes)

    monkeypatch.setattr(CopyEngine, "allocate_on", counting)
    with torch_fastload.config.override(output_stream="copy", allocate_ahead=4, output_blocks="batch"):
        loader = DataLoader(TensorDataset(rows, labels), batch_size=64)
        got = list(loader)
        loader.close()
    assert len(got) == 16  # 15 of 64 rows, then 40
    assert engine_calls == [2, 8, 8, 8, 4, 2]  # batch 0 alone; 1-4, 5-8, 9-12, 13-14; the last alone
    assert torch.equal(torch.cat([x for x, _ in got]).cpu(), rows)
    assert torch.equal(torch.cat([y for _, y in got]).cpu(), labels)
    assert all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x, y in got)


def test_group_blocks_hand_out_views_of_one_block_a_field():
    """``output_blocks='group'`` (the default): a field of ``allocate_ahead`` batches is one
    device block and each batch a view of it starting on a 512-byte boundary (one record_stream
    a block, not a tensor); the labels stay a block apart from the images, and the epoch equals
    torch's, for rows whose batch is not a multiple of 512 bytes too."""
    rows = torch.arange(1000 * 7, dtype=torch.float32).view(1000, 7)
    labels = torch.arange(1000, dtype=torch.int16)
    with torch_fastload.config.override(output_stream="copy", allocate_ahead=4, output_blocks="group"):
        loader = DataLoader(TensorDataset(rows, labels), batch_size=63)
        got = list(loader)
        loader.close()
    assert torch.equal(torch.cat([x for x, _ in got]).cpu(), rows)
    assert torch.equal(torch.cat([y for _, y in got]).cpu(), labels)
    bases = [x.untyped_storage().data_ptr() for x, _ in got]
    assert bases[1] == bases[2] == bases[3] == bases[4] != bases[5]  # batch 0 alone, then 1-4 in one block
    block, view = got[2][0].untyped_storage().nbytes(), got[2][0].nbytes  # 63 x 7 x 4 = 1764 bytes a view
    assert block % 512 == 0 and 4 * view <= block < 4 * (view + 512 + 256)  # four views, each padded to 512s
    assert all(x.data_ptr() % 512 == 0 and y.data_ptr() % 512 == 0 for x, y in got)
    assert all(x.is_contiguous() and x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x, y in got)


@pytest.mark.parametrize("every", [1, 4, 0])
def test_one_batch_in_copy_timing_every_has_its_copies_timed(monkeypatch, every):
    """``copy_timing_every``: the loop's threads time the copies of one batch in that many with a
    pair of CUDA events (four driver calls beside the training thread's launches, so not every
    batch); the stats' copy seconds are scaled from those batches by bytes, and none are reported
    where no batch was timed."""
    loops = loops_synced(monkeypatch)
    data = rows_dataset(n=256)  # 16 KiB rows: 32 batches of 8, the rows by DMA, the labels by the slot
    with torch_fastload.config.override(copy_timing_every=every, memory_rows="dma"):
        loader = DataLoader(data, batch_size=8)
        got = list(loader)
        stats = loader.stats()
        loader.close()
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([x for x, _ in got]).cpu(), data.tensors[0])
    final = loops[-1].stats()  # every copy has completed: each timed batch is measured now
    batch_bytes = 8 * 4096 * 4 + 8 * 8
    assert final["copied_bytes"] == 32 * batch_bytes
    assert final["timed_bytes"] == (32 // every * batch_bytes if every else 0)
    assert (final["copy_s"] > 0) == bool(every)
    assert stats.stage_bytes["copy"] == 32 * batch_bytes
    assert (stats.stage_s["copy"] > 0) == bool(every), stats.stage_s


@pytest.mark.parametrize("width", [4096, 1024])  # 16 KiB rows by DMA from the dataset; 4 KiB rows through slots
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("enqueue", ["next", "workers"])
def test_each_batchs_copies_enter_the_copy_stream_after_the_earlier_batches(monkeypatch, ordered, width, enqueue):
    """The loop's one copy stream runs copies in the order they were enqueued: a batch whose
    worker got there after a later batch's waited behind that one's copies (an epoch's second
    batch, ~1-1.8 ms of the GPU idle an epoch on the H200). With workers finishing their staging
    out of order (jitter), copies still go in the batches' order: next() enqueues the staged
    batches in order, and workers enqueueing their own wait for their turn; the control (workers,
    unordered) shows late ones. Batches equal torch's either way."""
    monkeypatch.setattr(native, "DEBUG_JITTER_US", 3000)
    monkeypatch.setattr(native, "ORDERED_COPIES", ordered)
    monkeypatch.setenv("TORCH_FASTLOAD_COPY_ENQUEUE", enqueue)
    loops = loops_synced(monkeypatch)
    data = rows_dataset(n=512, width=width)
    kwargs = dict(batch_size=8, shuffle=True)
    theirs = list(torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(6), **kwargs))
    loader = DataLoader(data, generator=torch.Generator().manual_seed(6), pool_slots=4, **kwargs)
    ours = list(loader)
    loader.close()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])
    late = loops[-1].stats()["late_copies"]
    assert (late == 0) if (ordered or enqueue == "next") else (late > 0), late


def counted_driver_calls(script: str, *args: str, **env: str) -> tuple[str, dict]:
    """Runs ``script`` in a fresh process with the engine's driver calls counted per thread
    (TORCH_FASTLOAD_COUNT_DRIVER_CALLS=1, read at its first call); the script prints a
    ``training [...]`` and a ``loader [...]`` line of (entry point, calls). Its stdout, and those
    calls by side."""
    import os
    import re
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TORCH_FASTLOAD_COUNT_DRIVER_CALLS="1", **env),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sides: dict = {"training": {}, "loader": {}}
    for line in done.stdout.splitlines():
        side, _, rest = line.partition(" ")
        if side in sides:
            sides[side] = {name: int(n) for name, n in re.findall(r"\('(\w+)', (\d+)\)", rest)}
    return done.stdout, sides


SUBMITS = ("cuEventRecord", "cuLaunchKernel", "cuMemcpyHtoDAsync", "cuMemcpyBatchAsync", "cuStreamWaitEvent")
COUNT_CALLS_SCRIPT = """
import sys, threading, torch
from torch.utils.data import TensorDataset
import torch_fastload
from torch_fastload import DataLoader, engine
options = dict(arg.split("=", 1) for arg in sys.argv[2:])  # batch_size=N, or config options
batch_size = int(options.pop("batch_size", 64))
labels = options.pop("labels", "0") == "1"
own_pages = options.pop("own_pages", "0") == "1"  # where the loader can pin the rows in place
options = {k: int(v) if v.isdigit() else v for k, v in options.items()}
torch_fastload.config.set(copy_enqueue=sys.argv[1], **options)
rows = torch.arange(512 * 4096, dtype=torch.float32).reshape(512, 4096)
if own_pages:
    import mmap
    mapping = mmap.mmap(-1, rows.numel() * 4)
    rows = torch.frombuffer(mapping, dtype=torch.float32).view(512, 4096).copy_(rows)
data = TensorDataset(rows, torch.arange(512)) if labels else TensorDataset(rows)
seen = sum(int(b[0].sum().item() != 0) for b in DataLoader(data, batch_size=batch_size, shuffle=True))
counts = engine._require().driver_call_counts()
me = threading.get_native_id()
sides = {"training": {}, "loader": {}}
for tid, calls in counts.items():
    side = sides["training" if tid == me else "loader"]
    for name, n in calls.items():
        side[name] = side.get(name, 0) + n
print("batches", seen)
print("training", sorted(sides["training"].items()))
print("loader", sorted(sides["loader"].items()))
"""


@pytest.mark.parametrize("enqueue", ["next", "workers"])
def test_batches_copies_are_handed_to_the_gpu_by_the_thread_config_names(enqueue):
    """TORCH_FASTLOAD_COUNT_DRIVER_CALLS=1 counts the engine's driver calls per thread. With
    copy_enqueue='next' the training thread (in next()) makes every copy and event record of a
    TensorDataset's batches and the loop's threads none (another thread's submits make the
    training thread's launches wait in the driver); 'workers' is the control: the loop's threads
    make them."""
    out, sides = counted_driver_calls(COUNT_CALLS_SCRIPT, enqueue)
    assert "batches 8" in out, out

    def calls(side: str, names) -> int:
        return sum(sides[side].get(name, 0) for name in names)

    copies = ("cuLaunchKernel", "cuMemcpyBatchAsync", "cuMemcpyHtoDAsync")
    by, other = ("training", "loader") if enqueue == "next" else ("loader", "training")
    assert calls(by, copies) >= 8 and calls(by, ["cuEventRecord"]) >= 8, out
    assert calls(other, copies) == 0 and calls(other, ["cuEventRecord"]) == 0, out
    if enqueue == "next":
        assert calls("loader", SUBMITS) == 0, out


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("output_stream", ["copy", "consumer"])
def test_a_batch_costs_one_event_record_and_a_group_one_wait(output_stream, before):
    """The calls other threads' launches queue behind: one record a batch (a slotted batch's ready
    event is its slot's) and, for outputs allocated on the consumer's stream, one allocation event and one
    copy-stream wait on it a group. The control, the tree before (TORCH_FASTLOAD_SLOT_EVENT=own,
    TORCH_FASTLOAD_ALLOCATION_MARK=batch): two records a batch, three and a wait with
    output_stream='consumer'."""
    env = dict(TORCH_FASTLOAD_SLOT_EVENT="own", TORCH_FASTLOAD_ALLOCATION_MARK="batch") if before else {}
    # 32 batches, 4 groups; the gather kernel's table of rows is in a pinned slot
    options = ["batch_size=16", "copy_timing_every=0", "memory_rows=kernel", f"output_stream={output_stream}"]
    out, calls = counted_driver_calls(COUNT_CALLS_SCRIPT, "workers", *options, **env)
    assert "batches 32" in out, out
    records = calls["training"].get("cuEventRecord", 0) + calls["loader"].get("cuEventRecord", 0)
    waits = calls["loader"].get("cuStreamWaitEvent", 0)  # the copy stream's (the consumer's are next()'s)
    marked = output_stream == "consumer"
    if before:
        assert records >= (3 if marked else 2) * 32 and waits >= (32 if marked else 0), out
    elif marked:
        assert 32 <= records <= 32 + 8 and 1 <= waits <= 8, out
    else:
        assert records == 32 and waits == 0, out


@pytest.mark.parametrize("merge", ["1", "0"])
@pytest.mark.parametrize("route", ["dma", "kernel", "gather"])
def test_a_batch_with_labels_costs_one_copy_call_and_one_record(route, merge):
    """Rows and their labels (the labels packed in the pinned slot): the loop's threads hand a
    batch to the GPU in two calls, the rows' batched copy or gather launch carrying the labels
    too (rows gathered into the slot by the CPU: one batched copy of both parts), and the ready
    event. Control (TORCH_FASTLOAD_MERGE_PARTS=0): the labels' own cuMemcpyHtoDAsync, three."""
    options = ["batch_size=16", "labels=1", "own_pages=1", "copy_timing_every=0", f"memory_rows={route}"]
    out, sides = counted_driver_calls(COUNT_CALLS_SCRIPT, "workers", *options, TORCH_FASTLOAD_MERGE_PARTS=merge)
    assert "batches 32" in out, out
    calls = sides["loader"]
    submits = sum(calls.get(name, 0) for name in SUBMITS)
    assert submits == (2 if merge == "1" else 3) * 32, out
    own_copy = 32 if route != "gather" else 64  # the labels' (and the gathered rows')
    assert calls.get("cuMemcpyHtoDAsync", 0) == (0 if merge == "1" else own_copy), out
    assert (calls.get("cuLaunchKernel", 0) == 32) is (route == "kernel"), out


FILE_COUNT_SCRIPT = """
import sys, threading, numpy as np, torch
import torch_fastload
from torch_fastload import ArrayDataset, DataLoader, RecordDataset, engine, pack
root, kind = sys.argv[1], sys.argv[2]
torch_fastload.config.set(mapped_copy="kernel", copy_timing_every=0)
if kind == "arrays":
    np.save(f"{root}/x.npy", np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024))
    dataset = ArrayDataset(f"{root}/x.npy")
else:
    blobs = [(bytes([i % 251]) * (100 + i), i % 7) for i in range(512)]
    pack(blobs, f"{root}/pack", shard_size=16 << 10, progress=False)
    dataset = RecordDataset(f"{root}/pack")
loader = DataLoader(dataset, batch_size=16, shuffle=True, map_budget="100%")
seen = sum(1 for _ in loader)
assert loader.stats().io_bytes.get("mapped", 0) > 0, loader.stats().io_bytes
me = threading.get_native_id()
calls = {}
for tid, counted in engine._require().driver_call_counts().items():
    if tid != me:
        for name, n in counted.items():
            calls[name] = calls.get(name, 0) + n
print("batches", seen)
print("loader", sorted(calls.items()))
"""


@pytest.mark.parametrize("table", ["slot", "ring"])
@pytest.mark.parametrize("kind", ["arrays", "records"])
def test_a_mapped_batch_costs_one_gather_launch_and_one_record(tmp_path, kind, table):
    """Mapped files on the gather kernel: the batch's ranges (and a RecordDataset's offsets) in
    one launch whose table lies in the batch's slot, and its ready event, from the loop's
    threads. Control (TORCH_FASTLOAD_MAPPED_TABLE=ring, the before): the ring's launch with its
    table in a ring chunk and that chunk's event, and the offsets' own copy."""
    out, sides = counted_driver_calls(FILE_COUNT_SCRIPT, str(tmp_path), kind, TORCH_FASTLOAD_MAPPED_TABLE=table)
    assert "batches 32" in out, out
    calls = sides["loader"]
    submits = sum(calls.get(name, 0) for name in SUBMITS)
    if table == "slot":
        assert calls.get("cuLaunchKernel", 0) == 32 and submits == 2 * 32, out
    else:
        assert calls.get("cuLaunchKernel", 0) >= 32 and submits >= (3 if kind == "arrays" else 4) * 32, out


@pytest.mark.parametrize("enqueue", ["next", "workers"])
def test_staged_batches_holding_every_slot_do_not_stall_the_one_next_waits_for(monkeypatch, enqueue):
    """Two big slots, workers finishing out of order: later batches may stage first and hold
    both slots while the batch next() waits for has none. next() then enqueues their copies so
    the slots come back (copy_enqueue='next'); every epoch equals torch's, in time."""
    monkeypatch.setattr(native, "DEBUG_JITTER_US", 2000)
    monkeypatch.setattr(native, "SMALL_SLOT_BYTES", 0)
    monkeypatch.setenv("TORCH_FASTLOAD_COPY_ENQUEUE", enqueue)
    data = rows_dataset(n=384, width=1024)  # 4 KiB rows: gathered into the slots
    kwargs = dict(batch_size=8, shuffle=True)
    loader = DataLoader(data, generator=torch.Generator().manual_seed(3), pool_slots=2, timeout=60, **kwargs)
    reference = torch.utils.data.DataLoader(data, generator=torch.Generator().manual_seed(3), **kwargs)
    started = time.monotonic()
    for _ in range(2):
        for a, b in zip(list(loader), list(reference), strict=True):
            assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])
    assert time.monotonic() - started < 30  # no batch sat out next()'s poll for a slot each time
    loader.close()


@pytest.mark.parametrize("enqueue", ["next", "workers"])
def test_an_epoch_left_with_batches_staged_gives_every_slot_back(monkeypatch, enqueue):
    """Copies held back for next() (and ones in flight) when the iterator is dropped midway: the
    loop stops, every pinned slot returns to the pool, and the next epoch is exact."""
    monkeypatch.setenv("TORCH_FASTLOAD_COPY_ENQUEUE", enqueue)
    data = rows_dataset(n=256, width=1024)
    loader = DataLoader(data, batch_size=8, prefetch=4)
    with torch.cuda.stream(loader.resources.engine.stream):
        torch.cuda._sleep(DELAY_CYCLES)  # copies queue behind this while the workers stage ahead
    it = iter(loader)
    first = [rows.cpu() for rows, _ in (next(it), next(it))]
    time.sleep(0.05)  # the workers stage the batches in flight meanwhile
    del it
    ours = torch.cat([rows.cpu() for rows, _ in loader])
    assert torch.equal(ours, data.tensors[0]) and torch.equal(torch.cat(first), data.tensors[0][:16])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pool warns of slots never given back, or still copying
        loader.close()
    assert loader.resources.pool is None or loader.resources.pool.closed
