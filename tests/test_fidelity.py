"""Drop-in fidelity and hardening against torch's own DataLoader on the same input (issue 18):
exit never waits on a stuck ``__getitem__``, collate adoption, generics, the IterableDataset
length warning, read-ahead bounds, a global patch, the iterator's torch attributes."""

import functools
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.utils.data as tud

import torch_fastload
from torch_fastload import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(body: str, timeout: float, **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **environ)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=timeout, env=env
    )


# -- item 3: a __getitem__ that never returns does not hang interpreter exit -----------------
def test_exit_does_not_wait_on_a_stuck_getitem_with_fetch_threads():
    body = """
    import threading, torch
    from torch.utils.data import Dataset
    from torch_fastload import DataLoader

    class Stuck(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i):
            if i >= 8:
                threading.Event().wait()  # never returns
            return torch.tensor(i)

    loader = DataLoader(Stuck(), batch_size=4, fetch_threads=4, timeout=1, device="cpu")
    seen = []
    try:
        for batch in loader:
            seen.append(batch.tolist())
    except RuntimeError as exc:
        print("TIMED OUT:", exc, flush=True)
    print("SEEN", seen, flush=True)
    """
    try:  # a regression hangs at exit: the bound turns it into a failure
        result = run_script(body, timeout=90, TORCH_FASTLOAD_SHUTDOWN_TIMEOUT="1")
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"interpreter exit waited on the stuck __getitem__: {exc.stdout!r}")
    assert result.returncode == 0, result.stderr
    assert "TIMED OUT: DataLoader timed out after 1 seconds" in result.stdout
    assert "SEEN [[0, 1, 2, 3], [4, 5, 6, 7]]" in result.stdout


# -- a) collate adoption only through the explicit hook ------------------------------------
class Squares(tud.Dataset):
    """A map-style dataset with an unrelated callable ``collate`` (as datapipes have)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([i, i * i])

    def collate(self, *args, **kwargs):
        return "a new pipeline, not a batch"


def _batches(loader):
    return [b.tolist() if isinstance(b, torch.Tensor) else [x.tolist() for x in b] for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_method_named_collate_is_not_adopted(num_workers):
    want = _batches(tud.DataLoader(Squares(), batch_size=3, num_workers=num_workers))
    got = _batches(DataLoader(Squares(), batch_size=3, num_workers=num_workers, device="cpu"))
    assert got == want == [[[0, 0], [1, 1], [2, 4]], [[3, 9], [4, 16], [5, 25]], [[6, 36], [7, 49], [8, 64]], [[9, 81]]]


def test_an_iterdatapipe_collate_is_not_adopted():
    datapipes = pytest.importorskip("torch.utils.data.datapipes.iter")
    pipe = datapipes.IterableWrapper(range(10))
    assert callable(pipe.collate)
    want = _batches(tud.DataLoader(pipe, batch_size=3))
    assert _batches(DataLoader(pipe, batch_size=3, device="cpu")) == want


def test_own_source_collate_is_adopted_through_its_hook(tmp_path):
    items = [(bytes(range(i % 7 + 1)), i % 3) for i in range(12)]
    torch_fastload.pack(items, str(tmp_path / "pack"), progress=False)
    records = torch_fastload.RecordDataset(str(tmp_path / "pack"))
    want = list(tud.DataLoader(records, batch_size=5, collate_fn=records.__fastload_collate__))
    got = list(DataLoader(records, batch_size=5, device="cpu"))
    assert len(got) == len(want) == 3
    for a, b in zip(want, got):
        assert type(b).__name__ == "RecordBatch"
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- b) subscriptable as torch's Generic loader ------------------------------------------
def test_subscriptable_like_torch():
    assert tud.DataLoader[int] is not None
    alias = DataLoader[int]
    assert alias.__origin__ is DataLoader
    loader = alias(tud.TensorDataset(torch.arange(4)), batch_size=2, device="cpu")
    assert isinstance(loader, DataLoader) and isinstance(loader, tud.DataLoader)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3]]


# -- e) installed as torch.utils.data.DataLoader (a global patch) -------------------------
class Counting(tud.IterableDataset):
    def __iter__(self):
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, 11, step))


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_installed_as_torch_dataloader_does_not_recurse(num_workers, persistent):
    inputs = [tud.TensorDataset(torch.arange(10.0)), Counting()]
    kwargs = dict(batch_size=3, num_workers=num_workers, persistent_workers=persistent)
    want = [_batches(tud.DataLoader(d, **kwargs)) for d in inputs]
    torchs = tud.DataLoader
    patched = {tud: "DataLoader", torch.utils.data.dataloader: "DataLoader"}
    for module, name in patched.items():
        setattr(module, name, DataLoader)
    try:
        loaders = [torch.utils.data.DataLoader(d, device="cpu", **kwargs) for d in inputs]
        assert all(type(loader) is DataLoader for loader in loaders)
        assert len(loaders[0]) == 4
        for _ in range(2):  # a second epoch (persistent workers reuse torch's iterator)
            assert [_batches(loader) for loader in loaders] == want
        for loader in loaders:
            loader.close()
    finally:
        for module, name in patched.items():
            setattr(module, name, torchs)
    assert tud.DataLoader is torchs


def _both(**kwargs):
    """torch's loader and torch_fastload's on the same arguments."""
    return {
        "torch": functools.partial(tud.DataLoader, **kwargs),
        "fastload": functools.partial(DataLoader, device="cpu", **kwargs),
    }


# -- c) the IterableDataset length warning comes from the next() that passes the length -----
class Overlong(tud.IterableDataset):
    """Reports 2 samples, yields 5."""

    def __len__(self):
        return 2

    def __iter__(self):
        return iter(range(5))


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("kind", ["torch", "fastload"])
def test_length_warning_is_raised_by_the_next_that_passes_the_length(kind, num_workers):
    loader = _both(batch_size=1, num_workers=num_workers)[kind](Overlong())
    assert len(loader) == 2  # torch warns only once len() was asked
    iterator = iter(loader)
    with warnings.catch_warnings(record=True) as early:
        warnings.simplefilter("always")
        assert [next(iterator).item() for _ in range(2)] == [0, 1]
        time.sleep(0.2)  # a fetch side reading ahead would warn meanwhile
    assert [str(w.message) for w in early if "IterableDataset" in str(w.message)] == []
    with pytest.warns(
        UserWarning, match=r"was reported to be 2\(when accessing len\(dataloader\)\), but 3 samples"
    ) as got:
        assert next(iterator).item() == 2
    assert [w.filename for w in got if "IterableDataset" in str(w.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each later next() warns again, as torch's does
        assert [b.item() for b in iterator] == [3, 4]


# -- f) the iterator's torch attributes with a public meaning --------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterator_offers_torch_attributes(num_workers):
    seen = {}
    for kind, make in _both(batch_size=2, num_workers=num_workers).items():
        iterator = iter(make(tud.TensorDataset(torch.arange(10))))
        counts = [iterator._num_yielded]
        for _ in range(3):
            next(iterator)
            counts.append(iterator._num_yielded)
        workers = [w.is_alive() for w in iterator._workers] if hasattr(iterator, "_workers") else None
        if kind == "fastload" or num_workers > 0:  # torch's single-process iterator has none
            iterator._shutdown_workers()
            iterator._shutdown_workers()  # idempotent
        if workers is not None:
            assert not any(w.is_alive() for w in iterator._workers)
        seen[kind] = counts, workers
    assert seen["fastload"] == seen["torch"]
    assert seen["torch"][0] == [0, 1, 2, 3]
    assert seen["torch"][1] == (None if num_workers == 0 else [True, True])


def test_shutdown_workers_stops_a_fastload_iterator_early():
    loader = DataLoader(tud.TensorDataset(torch.arange(10)), batch_size=2, device="cpu", fetch_threads=3)
    iterator = iter(loader)
    next(iterator)
    iterator._shutdown_workers()
    assert iterator._pipeline.finished
    with pytest.raises(StopIteration):
        next(iterator)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # a new epoch is whole


# -- d) read-ahead bounded by torch's rule (plus prefetch) ------------------------------------
class FetchLog(tud.Dataset):
    """Records each fetched index and whether the consumer's flag (a file) was set by then;
    a file, so that worker processes record too."""

    def __init__(self, root, n=96):
        self.log, self.flag, self.n = str(root / "log"), str(root / "flag"), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        seen = os.path.exists(self.flag)
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{i} {int(seen)}\n".encode())
        finally:
            os.close(fd)
        return torch.tensor(i)

    def before_flag(self, batch_size) -> set:
        """The batches with a sample fetched before the flag was set."""
        with open(self.log) as f:
            return {int(i) // batch_size for i, seen in (line.split() for line in f) if seen == "0"}


def _batches_before_flag(make, root, k, batch_size=4, **kwargs) -> set:
    """Take batches 0..k, let any read-ahead run, set the flag, drain the epoch."""
    dataset = FetchLog(root)
    iterator = iter(make(dataset, batch_size=batch_size, **kwargs))
    for _ in range(k + 1):
        next(iterator)
    time.sleep(0.3)  # room for a fetch side that runs ahead (the bound holds whatever the timing)
    open(dataset.flag, "w").close()
    assert sum(1 for _ in iterator) == 96 // batch_size - k - 1
    return dataset.before_flag(batch_size)


@pytest.mark.parametrize("fetch_threads", [1, 3])
def test_no_workers_fetches_nothing_ahead_like_torch(tmp_path, fetch_threads):
    k = 5
    (tmp_path / "torch").mkdir()
    (tmp_path / "fastload").mkdir()
    want = _batches_before_flag(tud.DataLoader, tmp_path / "torch", k)
    assert want == set(range(k + 1))
    got = _batches_before_flag(
        functools.partial(DataLoader, device="cpu", prefetch=0, fetch_threads=fetch_threads), tmp_path / "fastload", k
    )
    assert got == want


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_counts_batches_beyond_torchs_bound(tmp_path, prefetch):
    k = 5
    got = _batches_before_flag(functools.partial(DataLoader, device="cpu", prefetch=prefetch), tmp_path, k)
    assert set(range(k + 1)) <= got <= set(range(k + 1 + prefetch))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_with_workers_read_ahead_is_torchs_prefetch_factor_bound(tmp_path, prefetch):
    k, workers, factor = 5, 2, 2
    bound = k + workers * factor  # torch hands this batch to a worker as batch k's next() returns
    (tmp_path / "torch").mkdir()
    (tmp_path / "fastload").mkdir()
    kwargs = dict(num_workers=workers, prefetch_factor=factor)
    want = _batches_before_flag(tud.DataLoader, tmp_path / "torch", k, **kwargs)
    assert set(range(k + 1)) <= want <= set(range(bound + 1))
    got = _batches_before_flag(
        functools.partial(DataLoader, device="cpu", prefetch=prefetch), tmp_path / "fastload", k, **kwargs
    )
    assert set(range(k + 1)) <= got <= set(range(bound + prefetch + 1))


class Numbers(tud.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor(i)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_next_grants_its_credit_after_the_hand_off_when_the_batch_was_staged(monkeypatch, prefetch):
    """The credit wakes the fetch thread, whose Python (torch's worker iterator rebuilding a
    batch) would hold the GIL while next() still hands its batch over: a batch already staged
    is handed over first. A batch not staged yet gets the credit before the wait (with
    ``prefetch=0`` that batch cannot be fetched without it)."""
    iterator = iter(DataLoader(Numbers(), batch_size=4, prefetch=prefetch, device="cpu"))  # the Python pipeline
    pipeline = iterator._pipeline
    order: list = []
    grant, hand_off = pipeline.read_ahead.grant, pipeline.engine.hand_off
    monkeypatch.setattr(pipeline.read_ahead, "grant", lambda: (order.append("grant"), grant())[1])
    monkeypatch.setattr(pipeline.engine, "hand_off", lambda copy: (order.append("hand_off"), hand_off(copy))[1])
    assert torch.equal(next(iterator), torch.arange(4))
    if prefetch == 0:  # nothing may be fetched before the first next(): its credit comes first
        assert order == ["grant", "hand_off"]
    else:
        deadline = time.monotonic() + 10
        while pipeline.ready.qsize() + len(pipeline._reorder) < prefetch and time.monotonic() < deadline:
            time.sleep(0.01)  # batches 1 and 2 staged ahead (stage threads finish out of order)
        order.clear()
        assert torch.equal(next(iterator), torch.arange(4, 8))
        assert order == ["hand_off", "grant"]
    assert sum(len(b) for b in iterator) == 40 - 4 * (1 if prefetch == 0 else 2)


def test_shutdown_workers_of_persistent_workers_then_a_new_epoch():
    loader = DataLoader(
        tud.TensorDataset(torch.arange(10)), batch_size=2, num_workers=2, persistent_workers=True, device="cpu"
    )
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)
    iterator._shutdown_workers()
    assert not any(w.is_alive() for w in workers)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # fresh workers
    loader.close()


# -- NOTE [held batches]: a failed batch kept by the user does not keep the threads running --
class FailsAt5(tud.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        if i == 5:
            raise ValueError("sample 5 is bad")
        return torch.tensor(i)


@pytest.mark.parametrize("num_workers, fetch_threads", [(0, 1), (0, 3), (2, 1)])
def test_a_raised_batch_does_not_keep_a_dropped_iterator_alive(num_workers, fetch_threads, no_leaked_threads):
    loader = DataLoader(
        FailsAt5(), batch_size=4, num_workers=num_workers, fetch_threads=fetch_threads, prefetch=0, device="cpu"
    )
    with pytest.raises(ValueError, match="sample 5") as kept:  # its traceback holds the iterator
        for _ in loader:
            pass
    assert kept.value is not None  # the fixture checks, once the test dropped it, that threads stopped
