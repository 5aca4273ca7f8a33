"""The source protocol as README's "Writing your own source" shows it, run as a user would."""

import os
import threading

import numpy as np
import pytest
import torch

from torch_fastload import DataLoader
from torch_fastload.sources import ArrayDataset, ImageFolder
from torch_fastload.sources.protocol import BatchSource, FinishingSource, hooks_of
from torch_fastload.staging import PendingConcat, PendingRead


class FixedRecords(torch.utils.data.Dataset):  # README.md: N records of 4 KiB in one file
    def __init__(self, path):
        self.path, self.n = path, os.path.getsize(path) // 4096
        self.batches = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(self.path, "rb") as f:
            f.seek(4096 * i)
            return torch.frombuffer(bytearray(f.read(4096)), dtype=torch.uint8)

    def __fastload_batch__(self, indices):
        self.batches += 1
        offsets = np.asarray(indices, dtype=np.int64) * 4096
        return PendingRead(self.path, offsets, 4096, (len(offsets), 4096), torch.uint8)


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "records.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096 * 37, dtype=np.uint8).tobytes())
    return FixedRecords(str(path))


def test_readme_source_reads_whole_batches_like_torch_reads_samples(records):
    ours = DataLoader(records, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3), device="cpu")
    theirs = torch.utils.data.DataLoader(
        records, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    got, want = list(ours), list(theirs)
    assert records.batches == len(want) == 5  # the batch path ran, once per batch
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_protocol_classes_name_the_hooks_each_source_implements(records, tmp_path):
    assert isinstance(records, BatchSource) and not isinstance(records, FinishingSource)
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    assert isinstance(ArrayDataset(str(tmp_path / "x.npy")), BatchSource)
    assert issubclass(ImageFolder, FinishingSource)
    assert not isinstance(torch.utils.data.TensorDataset(torch.zeros(3)), BatchSource)
    hooks = hooks_of(records)
    assert hooks.batch is not None and hooks.finish is hooks.slot_bytes is hooks.delivered is None


def test_delivered_hook_runs_for_every_batch_source_with_the_wait(records):
    seen = []
    records.__fastload_delivered__ = lambda device, waited: seen.append((str(device), waited))
    batches = list(DataLoader(records, batch_size=10, device="cpu"))
    assert len(seen) == len(batches) == 4
    assert all(device == "cpu" and waited >= 0 for device, waited in seen)


def test_requested_hook_runs_before_each_delivery(records):
    """next() calls the requested hook as it is entered, then the delivered hook: in turn."""
    seen = []
    records.__fastload_requested__ = lambda device: seen.append("requested")
    records.__fastload_delivered__ = lambda device, waited: seen.append("delivered")
    batches = list(DataLoader(records, batch_size=10, device="cpu"))
    assert seen[: 2 * len(batches)] == ["requested", "delivered"] * len(batches)
    assert seen[2 * len(batches) :] == ["requested"]  # the call that ends the epoch


def test_bind_hook_runs_once_per_iterator_before_its_first_fetch(records):
    """Each iterator binds the source to its device before any batch is fetched (the Parquet
    source sets its pinned decode up there), once, also when num_workers is set: a batch
    source reads whole batches in the loader's threads whatever the worker count."""
    seen = []
    fetch = records.__fastload_batch__
    records.__fastload_bind__ = lambda device: seen.append(("bind", str(device))) or f"bound to {device}"
    records.__fastload_batch__ = lambda indices: seen.append(("batch", None)) or fetch(indices)
    loader = DataLoader(records, batch_size=10, device="cpu")
    for _ in range(2):
        assert len(list(loader)) == 4
    assert loader.stats().path.endswith("; bound to cpu")  # the source's word, in the path
    binds = [i for i, (what, _) in enumerate(seen) if what == "bind"]
    assert len(binds) == 2 and binds[0] == 0 and seen[0] == ("bind", "cpu")
    assert binds[1] == 5 and [what for what, _ in seen].count("batch") == 8
    seen.clear()
    with pytest.warns(UserWarning):
        assert len(list(DataLoader(records, batch_size=10, device="cpu", num_workers=2))) == 4
    assert seen[0] == ("bind", "cpu") and [what for what, _ in seen].count("bind") == 1


class InMemory(torch.utils.data.Dataset):
    """A batch source of in-memory columns: one plain tensor and one joined from two chunks."""

    def __init__(self, direct: bool):
        self.values = torch.arange(100, dtype=torch.int64)
        if direct:
            self.__fastload_direct_cpu__ = True

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return {"x": self.values[i], "y": self.values[i] * 2}

    def __fastload_batch__(self, indices):
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        half = len(index) // 2
        y = self.values[index] * 2
        return {"x": self.values[index], "y": PendingConcat([y[:half], y[half:]])}


@pytest.mark.parametrize("direct", [True, False])
def test_direct_cpu_sources_are_copied_once_into_their_batch_without_a_slot(direct):
    source = InMemory(direct)
    loader = DataLoader(source, batch_size=16, device="cpu")
    batches = list(loader)
    assert [b["x"].tolist() for b in batches] == [list(range(k, min(k + 16, 100))) for k in range(0, 100, 16)]
    assert all(torch.equal(b["y"], 2 * b["x"]) for b in batches)
    assert hooks_of(source).direct_cpu is direct
    assert (loader.pool is None) is direct  # no pageable slot pool: the batch is the only copy
    assert ("copied once" in loader.stats().path) is direct
    assert batches[0]["x"].data_ptr() != source.values.data_ptr()  # never the source's memory
    batches[0]["x"].fill_(-1)
    assert int(source.values[0]) == 0


class Staged(FixedRecords):
    """FixedRecords asking for ``want`` batches staged at once."""

    def __init__(self, path, want):
        super().__init__(path)
        self.__fastload_staged_at_once__ = want


@pytest.mark.parametrize(
    "want, prefetch, threads",
    [(None, 2, 2), (4, 2, 3), (4, 0, 2), (3, 5, 3), (6, 5, 6), (True, 4, 2), (-1, 4, 2), (2.5, 4, 2)],
)
def test_a_source_may_ask_for_more_batches_staged_at_once(tmp_path, no_leaked_threads, want, prefetch, threads):
    """``__fastload_staged_at_once__``: more stage threads than the default two, never more than
    the prefetch + 1 batches a loader has in flight, never fewer than two; a value that is not a
    positive int is ignored."""
    path = tmp_path / "records.bin"
    path.write_bytes(np.arange(64 * 4096 // 8, dtype=np.int64).tobytes())
    ds = FixedRecords(str(path)) if want is None else Staged(str(path), want)
    loader = DataLoader(ds, batch_size=4, device="cpu", prefetch=prefetch)
    it = iter(loader)
    first = next(it)
    names = [t.name for t in threading.enumerate() if t.name.startswith("fastload-stage")]
    assert len(names) == threads, names
    rest = list(it)
    every_row = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).view(-1, 4096)
    assert torch.equal(torch.cat([first, *rest]).view(-1, 4096), every_row)  # all, in order
