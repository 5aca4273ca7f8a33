"""Drop-in behaviour of torch_fastload.DataLoader against torch's DataLoader (CPU device)."""

import collections
import gc
import random
import time
import traceback

import numpy as np
import pytest
import torch
from conftest import pipeline_threads
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
    get_worker_info,
)

import torch_fastload
from torch_fastload import BatchTooLargeError, DataLoader

Point = collections.namedtuple("Point", ["x", "label"])


def assert_same(a, b, path="batch"):
    """Same structure, container types, dtypes, shapes and values."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.cpu(), b.cpu()), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def both(dataset, **kwargs):
    """Batches of torch's DataLoader and of ours, built with identical arguments and seeds."""
    seed = kwargs.pop("seed", 0)
    ours_kwargs = {
        k: kwargs.pop(k) for k in ("stage_threads", "fetch_threads", "prefetch", "pool_slots") if k in kwargs
    }
    theirs = list(torch.utils.data.DataLoader(dataset, generator=torch.Generator().manual_seed(seed), **kwargs))
    ours = list(
        DataLoader(dataset, generator=torch.Generator().manual_seed(seed), device="cpu", **kwargs, **ours_kwargs)
    )
    return ours, theirs


class Nested(Dataset):
    """Samples shaped like real ones: dicts, tuples, namedtuples, numpy, numbers, strings."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return {
            "image": torch.from_numpy(rng.standard_normal((3, 8, 8)).astype(np.float32)),
            "mask": rng.random((8, 8)) > 0.5,
            "tokens": torch.arange(i, i + 5, dtype=torch.int32),
            "meta": (i, float(i) / 3, f"sample-{i}"),
            "point": Point(torch.tensor([i, -i], dtype=torch.float16), i % 3),
            "bf16": torch.full((2,), float(i), dtype=torch.bfloat16),
        }


class Ids(Dataset):
    def __init__(self, n, jitter=0.0):
        self.n, self.jitter = n, jitter

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.jitter:
            time.sleep(random.random() * self.jitter)
        return torch.tensor(i), torch.full((16,), i, dtype=torch.float32)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_as_torch(num_workers, shuffle, drop_last):
    ours, theirs = both(Nested(), batch_size=5, shuffle=shuffle, drop_last=drop_last, num_workers=num_workers, seed=7)
    assert len(ours) == len(theirs) == (7 if drop_last else 8)
    for a, b in zip(ours, theirs):
        assert_same(a, b)


@pytest.mark.parametrize("fetch_threads,stage_threads,prefetch", [(1, 1, 1), (4, 3, 4), (3, 8, 2)])
def test_thread_counts_do_not_change_batches(fetch_threads, stage_threads, prefetch):
    ours, theirs = both(
        Nested(),
        batch_size=4,
        shuffle=True,
        seed=3,
        fetch_threads=fetch_threads,
        stage_threads=stage_threads,
        prefetch=prefetch,
    )
    for a, b in zip(ours, theirs, strict=True):
        assert_same(a, b)


def test_large_rows_are_staged_by_several_threads():
    data = torch.randn(64, 1 << 16)  # 256 KiB rows, 16 MiB batches: the chunked copy path
    ours, theirs = both(TensorDataset(data, torch.arange(64)), batch_size=64, stage_threads=4)
    assert_same(ours, theirs)


def test_samplers_batch_samplers_and_collate_fn():
    data = TensorDataset(torch.randn(30, 3), torch.arange(30))
    ours, theirs = both(data, batch_sampler=BatchSampler(SequentialSampler(data), 7, drop_last=False))
    assert_same(ours, theirs)

    def collate(samples):
        xs, ys = zip(*samples)
        return {"x": torch.stack(xs).double(), "y": list(ys), "n": len(samples)}

    for workers in (0, 2):
        ours, theirs = both(data, batch_size=4, collate_fn=collate, num_workers=workers)
        assert_same(ours, theirs)


def test_batch_size_none_passes_ready_made_batches():
    batches = [torch.randn(4, 5) for _ in range(6)]
    ours, theirs = both(batches, batch_size=None)
    assert_same(ours, theirs)


def test_distributed_sampler_with_set_epoch():
    data = TensorDataset(torch.arange(50))
    for epoch in (0, 1):
        sampler_a = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5)
        sampler_b = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5)
        sampler_a.set_epoch(epoch)
        sampler_b.set_epoch(epoch)
        theirs = list(torch.utils.data.DataLoader(data, batch_size=6, sampler=sampler_a))
        ours = list(DataLoader(data, batch_size=6, sampler=sampler_b, device="cpu"))
        assert_same(ours, theirs)


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"i": i, "x": torch.full((3,), float(i))}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset(num_workers):
    ours, theirs = both(Stream(23), batch_size=4, num_workers=num_workers)
    assert_same(ours, theirs)


def test_persistent_workers_across_epochs_and_len():
    data = TensorDataset(torch.arange(40).float())
    loader = DataLoader(
        data,
        batch_size=8,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        device="cpu",
        generator=torch.Generator().manual_seed(1),
    )
    ref = torch.utils.data.DataLoader(
        data,
        batch_size=8,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(1),
    )
    assert len(loader) == len(ref) == 5
    for _ in range(3):
        it = iter(loader)
        assert len(it) == 5
        assert_same(list(it), list(ref))
    loader.close()


@pytest.mark.parametrize("num_workers,fetch_threads", [(0, 1), (0, 4), (2, 1)])
def test_every_sample_exactly_once_under_jitter(num_workers, fetch_threads):
    n = 300
    for trial in range(3):
        loader = DataLoader(
            Ids(n, jitter=0.002),
            batch_size=7,
            shuffle=True,
            num_workers=num_workers,
            fetch_threads=fetch_threads,
            stage_threads=1 + trial,
            prefetch=1 + 2 * trial,
            pool_slots=1 + trial,
            device="cpu",
        )
        seen = []
        for ids, rows in loader:
            assert torch.equal(rows, ids[:, None].float().expand(-1, 16))  # each row is its own sample
            seen.extend(ids.tolist())
        assert sorted(seen) == list(range(n)), f"trial {trial}: lost or repeated samples"


class Flaky(Dataset):
    def __init__(self, bad):
        self.bad = set(bad)

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i in self.bad:
            raise KeyError(f"sample {i} is broken")
        return torch.tensor([i])


@pytest.mark.parametrize("num_workers,fetch_threads", [(0, 1), (0, 3), (2, 1)])
def test_error_reaches_next_with_type_traceback_and_later_batches_work(num_workers, fetch_threads, no_leaked_threads):
    loader = DataLoader(Flaky({13}), batch_size=4, num_workers=num_workers, fetch_threads=fetch_threads, device="cpu")
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    with pytest.raises(KeyError) as info:
        next(it)
    assert "sample 13 is broken" in str(info.value)
    where = "".join(traceback.format_exception(info.value))
    assert "__getitem__" in where  # the original traceback: in the worker's message or as frames
    assert "raised in the fetch stage" in where and "batch 3" in where
    got += list(it)  # torch goes on with the next batch after a failed one; so do we
    assert [b.flatten().tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert loader.stats().errors == 1
    del it


def failing_init(worker_id):
    raise OSError(f"worker {worker_id} cannot open its shard")


def test_startup_error_in_worker_init_fn():
    loader = DataLoader(Flaky(()), batch_size=4, num_workers=1, worker_init_fn=failing_init, device="cpu")
    it = iter(loader)
    with pytest.raises(OSError, match="cannot open its shard"):
        next(it)
    it.close()


class Slow(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(1.0 if i == 4 else 0)
        return torch.tensor(i)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_timeout_raises_like_torch(num_workers):
    loader = DataLoader(Slow(), batch_size=4, num_workers=num_workers, timeout=0.3, device="cpu")
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="timed out after 0.3 seconds"):
        next(it)
    it.close()


def test_timeout_validation_matches_torch():
    with pytest.raises(ValueError, match="timeout option should be non-negative"):
        DataLoader(Slow(), timeout=-1, device="cpu")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_break_and_del_shut_down_cleanly(num_workers, no_leaked_threads):
    loader = DataLoader(Ids(200), batch_size=4, num_workers=num_workers, device="cpu", prefetch=4)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    gc.collect()
    assert pipeline_threads() == []
    assert loader.pool.idle()
    it = iter(loader)
    next(it)
    del it
    gc.collect()
    assert pipeline_threads() == []
    loader.close()
    assert loader.pool is None


def test_exception_in_training_loop_shuts_down(no_leaked_threads):
    loader = DataLoader(Ids(100), batch_size=4, device="cpu")

    def train():
        for step, _ in enumerate(loader):
            if step == 2:
                raise ArithmeticError("loss is nan")

    with pytest.raises(ArithmeticError):
        train()
    gc.collect()
    assert pipeline_threads() == []


def test_oversize_error_and_grow():
    sizes = [4, 4, 16, 4, 32]

    class Growing(Dataset):
        def __len__(self):
            return len(sizes)

        def __getitem__(self, i):
            return torch.full((sizes[i], 1024), float(i))

    strict = DataLoader(Growing(), batch_size=None, oversize="error", device="cpu")
    it = iter(strict)
    next(it), next(it)
    with pytest.raises(BatchTooLargeError, match="batch 2 needs 65536 bytes") as info:
        next(it)
    assert info.value.batch_index == 2 and "the stage/copy stage" in "".join(traceback.format_exception(info.value))
    assert torch.all(next(it) == 3)  # a stage-thread error spoils only its own batch
    it.close()

    growing = DataLoader(Growing(), batch_size=None, device="cpu")
    out = list(growing)
    assert [b.shape[0] for b in out] == sizes and all(torch.all(b == i) for i, b in enumerate(out))
    stats = growing.stats()
    # two stage threads: the 32-row batch may be staged before the 16-row one grew the pool
    assert stats.pool_regrows in (1, 2) and stats.pool_slot_bytes >= 32 * 1024 * 4


def test_exact_slot_size_from_first_batch():
    with torch_fastload.config.override(native="off"):  # the Python pipeline's pool (the C++ loop needs none on a CPU)
        loader = DataLoader(TensorDataset(torch.randn(40, 1000)), batch_size=10, device="cpu")
    list(loader)
    assert loader.pool.slot_bytes == 40960  # 40000 bytes rounded to one 4 KiB page, no power of two


def test_config_env_and_override(monkeypatch):
    monkeypatch.setenv("TORCH_FASTLOAD_STAGE_THREADS", "3")
    assert DataLoader(Ids(4), device="cpu").stage_threads == 3
    with torch_fastload.config.override(stage_threads=5, prefetch=6):
        loader = DataLoader(Ids(4), device="cpu")
        assert (loader.stage_threads, loader.prefetch) == (5, 6)
    assert DataLoader(Ids(4), device="cpu", stage_threads=2).stage_threads == 2
    monkeypatch.setenv("TORCH_FASTLOAD_POOL_SLOTS", "zero")
    with pytest.raises(ValueError, match="TORCH_FASTLOAD_POOL_SLOTS"):
        DataLoader(Ids(4), device="cpu")
    monkeypatch.delenv("TORCH_FASTLOAD_POOL_SLOTS")
    with pytest.raises(ValueError, match="'oversize' must be one of"):
        DataLoader(Ids(4), device="cpu", oversize="maybe")
    with pytest.raises(TypeError, match="unexpected keyword"):
        DataLoader(Ids(4), device="cpu", prefetch_depth=3)


def test_output_stream_reaches_the_copy_engine_and_is_validated(monkeypatch):
    """Where batches are allocated (``output_stream``): the copy stream by default, the
    consumer's by config or environment; anything else is refused with the option's name."""
    assert DataLoader(Ids(4), device="cpu").resources.engine.output_stream == "copy"
    with torch_fastload.config.override(output_stream="consumer"):
        assert DataLoader(Ids(4), device="cpu").resources.engine.output_stream == "consumer"
    monkeypatch.setenv("TORCH_FASTLOAD_OUTPUT_STREAM", "consumer")
    assert DataLoader(Ids(4), device="cpu").resources.engine.output_stream == "consumer"
    monkeypatch.setenv("TORCH_FASTLOAD_OUTPUT_STREAM", "training")
    with pytest.raises(ValueError, match="'output_stream' must be one of"):
        DataLoader(Ids(4), device="cpu")


def test_stats_report_wait_and_stages():
    loader = DataLoader(Ids(64, jitter=0.001), batch_size=8, device="cpu")
    for _ in loader:
        time.sleep(0.002)
    stats = loader.stats()
    assert stats.batches == 8 and stats.samples == 64 and stats.bytes == 8 * (8 * 8 + 8 * 64)
    assert 0 < stats.wait_fraction < 1 and stats.stage_s["fetch"] > 0 and stats.stage_s["stage"] > 0
    text = str(stats)
    assert "input wait" in text and "fetch" in text and "GB/s" in text
    assert stats.as_dict()["batches"] == 8
    assert loader.stats(reset=True).batches == 8 and loader.stats().batches == 0
    assert loader.stats().path == stats.path and loader.stats().pool_slots == stats.pool_slots  # state survives


class ListSampler(torch.utils.data.Sampler):
    def __init__(self, indices):
        self.indices = indices

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_tensor_dataset_rows_are_gathered_without_per_sample_python(backend, monkeypatch):
    from torch_fastload import staging
    from torch_fastload.fetch import batch_reader

    if backend == "numpy":  # the Python pipeline's stager without the C++ engine
        monkeypatch.setattr(staging, "_native_copy", None)
        monkeypatch.setattr(torch_fastload.engine, "available", lambda: False)
    data = TensorDataset(torch.randn(50, 3, 7), torch.arange(50), torch.randn(7, 50).t())  # last: strided
    loader = DataLoader(data, batch_size=8, shuffle=True, device="cpu", generator=torch.Generator().manual_seed(2))
    assert batch_reader(loader) is not None
    theirs = list(
        torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    )
    assert_same(list(loader), theirs)

    negative = DataLoader(data, batch_size=3, sampler=ListSampler([-1, 0, -50, 4]), device="cpu")
    assert_same(
        list(negative), list(torch.utils.data.DataLoader(data, batch_size=3, sampler=ListSampler([-1, 0, -50, 4])))
    )

    it = iter(DataLoader(data, batch_size=2, sampler=ListSampler([1, 2, 50, 3, 4, 5]), device="cpu"))
    assert next(it)[1].tolist() == [1, 2]
    with pytest.raises(IndexError, match="index 50 is out of range for a TensorDataset of 50 samples"):
        next(it)
    assert next(it)[1].tolist() == [4, 5]  # only the bad batch is lost
