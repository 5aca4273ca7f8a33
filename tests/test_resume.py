"""Exact mid-epoch resume for every source, determinism across thread counts, out-of-order mode.

Each source goes through tests/resume_harness.py: checkpoint after 0, 1, k and the last
batches, resume in a fresh process (other thread counts, another seed for torch's global
generator), compare the rest with an uninterrupted run.
"""

import base64
import json
import os
import random
import tempfile
import time

import numpy as np
import pytest
import torch
from resume_harness import assert_equal, check_resume, to_cpu
from torch.utils.data import Dataset, IterableDataset, RandomSampler

import torch_fastload
from torch_fastload import DataLoader, DistributedSampler, ResumeError, shard_indices

DATA = os.path.join(tempfile.gettempdir(), f"fastload-resume-data-{os.getuid()}")


# -- sources (module-level factories: the harness's child process imports them) -------------
class Augmented(Dataset):
    """Per-sample Python with random augmentation drawn from the batch's generator."""

    def __init__(self, n=57, augment=True):
        self.n = n
        self.augment = augment

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(random.random() * 0.002)  # jitter: threads finish in any order
        noise = torch.rand(3, generator=torch_fastload.batch_generator()) if self.augment else 0.5
        return torch.full((3,), float(i)) + noise, i


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(45):
            yield torch.tensor([i, i * i]), i


def _array_file(rows=300):
    os.makedirs(DATA, exist_ok=True)
    path = os.path.join(DATA, f"rows-{rows}.npy")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp.npy"
        np.save(tmp, np.arange(rows * 5, dtype=np.float32).reshape(rows, 5))
        os.replace(tmp, path)
    return path


def sample_path(seed, fetch_threads=1, prefetch=2, num_workers=0, in_order=True, augment=True):
    torch.manual_seed(seed)
    return DataLoader(
        Augmented(augment=augment),
        batch_size=4,
        shuffle=True,
        device="cpu",
        fetch_threads=fetch_threads,
        prefetch=prefetch,
        num_workers=num_workers,
        in_order=in_order,
    )


def generator_owned(seed, fetch_threads=1):
    torch.manual_seed(seed)
    return DataLoader(
        Augmented(40),
        batch_size=3,
        sampler=RandomSampler(range(40), generator=torch.Generator().manual_seed(7)),
        device="cpu",
        fetch_threads=fetch_threads,
        drop_last=True,
    )


def iterable(seed, num_workers=0):
    torch.manual_seed(seed)
    return DataLoader(Stream(), batch_size=4, device="cpu", num_workers=num_workers)


def arrays(seed, stage_threads=1, prefetch=2):
    torch.manual_seed(seed)
    return DataLoader(
        torch_fastload.ArrayDataset(_array_file()),
        batch_size=16,
        shuffle=True,
        device="cpu",
        stage_threads=stage_threads,
        prefetch=prefetch,
    )


def records(seed, fetch_threads=1):
    os.makedirs(DATA, exist_ok=True)
    root = os.path.join(DATA, "pack")
    if not os.path.exists(os.path.join(root, "meta.json")):
        rng = np.random.default_rng(0)
        items = [(rng.integers(0, 255, int(rng.integers(1, 900)), dtype=np.uint8).tobytes(), i % 5) for i in range(120)]
        torch_fastload.pack(items, root + f".{os.getpid()}", shard_size=16 << 10, progress=False)
        os.replace(root + f".{os.getpid()}", root)
    torch.manual_seed(seed)
    return DataLoader(
        torch_fastload.RecordDataset(root), batch_size=8, shuffle=True, device="cpu", fetch_threads=fetch_threads
    )


def images(seed, stage_threads=1):
    pytest.importorskip("torchvision")
    from torch_fastload.sources import ImageFolder
    from torch_fastload.vision.sample_data import make_image_folder

    os.makedirs(DATA, exist_ok=True)
    root = os.path.join(DATA, "images")
    if not os.path.exists(os.path.join(root, "done")):
        make_image_folder(root, classes=3, train_per_class=6, val_per_class=1, edge_cases=False, progress=False)
        open(os.path.join(root, "done"), "w").close()
    torch.manual_seed(seed)
    dataset = ImageFolder(os.path.join(root, "train"), "train")  # augmentation seed drawn from torch
    return DataLoader(dataset, batch_size=4, shuffle=True, device="cpu", stage_threads=stage_threads)


def distributed(seed, rank=0, num_replicas=2, epoch=3, batch_size=5, fetch_threads=1):
    torch.manual_seed(seed)
    sampler = DistributedSampler(range(53), num_replicas=num_replicas, rank=rank, shuffle=True, seed=11)
    sampler.set_epoch(epoch)
    return DataLoader(Augmented(53), batch_size=batch_size, sampler=sampler, device="cpu", fetch_threads=fetch_threads)


def _state_after(loader, batches: int) -> dict:
    """The loader's state once ``batches`` batches were taken (the iterator then dropped)."""
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    del iterator
    return state


# -- the harness over every source -----------------------------------------------------
@pytest.mark.parametrize(
    "spec, kwargs, child",
    [
        ("sample_path", {}, {"fetch_threads": 4, "prefetch": 5}),
        ("sample_path", {"fetch_threads": 3}, {"fetch_threads": 1}),
        ("generator_owned", {}, {"fetch_threads": 2}),
        ("iterable", {}, {}),
        ("arrays", {}, {"stage_threads": 3, "prefetch": 1}),
        ("records", {}, {"fetch_threads": 2}),
        ("distributed", {}, {"fetch_threads": 3}),
    ],
)
def test_resume_in_a_fresh_process(spec, kwargs, child):
    check_resume(f"test_resume:{spec}", kwargs, child_overrides=child)


def test_resume_images_in_a_fresh_process():
    pytest.importorskip("torchvision")
    full = check_resume("test_resume:images", {}, points=(0, 2, 4), child_overrides={"stage_threads": 2})
    assert full[0][0].shape == (4, 3, 224, 224)


def test_resume_with_worker_processes():
    """The epoch's indices resume exactly (random draws inside worker processes follow torch's
    per-worker seeding, not per batch: README, "Resuming")."""
    check_resume(
        "test_resume:sample_path",
        {"num_workers": 2, "augment": False},
        points=(0, 3),
        child_overrides={"num_workers": 1},
        fresh_process=False,
    )


# -- determinism ----------------------------------------------------------------------
def _epoch(loader):
    return [to_cpu(b) for b in loader]


@pytest.mark.parametrize("spec", ["sample_path", "images"])
def test_same_seed_same_batches_whatever_the_threads_and_prefetch(spec):
    factory = {"sample_path": sample_path, "images": images}[spec]
    thread_arg = "fetch_threads" if spec == "sample_path" else "stage_threads"
    reference = _epoch(factory(0, **{thread_arg: 1}))
    for threads in (2, 5):
        assert_equal(reference, _epoch(factory(0, **{thread_arg: threads})), f"{spec} with {threads} threads")
    if spec == "sample_path":
        assert_equal(reference, _epoch(sample_path(0, fetch_threads=3, prefetch=1)), "prefetch 1")


def test_global_generator_draws_on_the_calling_thread():
    """The epoch's shuffle and base seed are drawn inside iter(): the main thread's own draws
    afterwards (a model's dropout) cannot interleave with them."""
    torch.manual_seed(0)
    loader = DataLoader(Augmented(20), batch_size=4, shuffle=True, device="cpu")
    iterator = iter(loader)
    after_iter = torch.get_rng_state()
    first = [to_cpu(b) for b in iterator]
    torch.manual_seed(0)
    iter(DataLoader(Augmented(20), batch_size=4, shuffle=True, device="cpu")).close()
    assert torch.equal(after_iter, torch.get_rng_state())
    torch.manual_seed(0)
    iterator = iter(DataLoader(Augmented(20), batch_size=4, shuffle=True, device="cpu"))
    torch.rand(1000)  # the training step draws while the fetch thread runs
    assert_equal(first, [to_cpu(b) for b in iterator], "batches")


def test_negative_control_a_state_without_the_epochs_generators_resumes_the_wrong_batches():
    """The harness's comparison is sensitive: the generators' states are what makes it pass."""
    loader = sample_path(0)
    iterator = iter(loader)
    head = [to_cpu(next(iterator)) for _ in range(2)]
    state = loader.state_dict()
    rest = [to_cpu(b) for b in iterator]
    torch.manual_seed(99)
    state["rng"] = torch_fastload.resume.capture(torch_fastload.resume.generators_of(loader))
    resumed = sample_path(1)
    resumed.load_state_dict(state)
    with pytest.raises(AssertionError, match="values differ"):
        assert_equal(rest, [to_cpu(b) for b in resumed], "rest")
    assert len(head) == 2


def test_resume_keeps_the_users_global_generator():
    state = _state_after(sample_path(0), 1)
    resumed = sample_path(5)
    torch.manual_seed(123)
    expected = torch.get_rng_state()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert torch.equal(torch.get_rng_state(), expected), "resuming must not move the user's generator"
    iterator.close()


# -- out-of-order mode ------------------------------------------------------------------
class Straggler(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.05 if i % 16 == 0 else 0.001)
        return i


def test_out_of_order_delivers_each_sample_once_and_overtakes_stragglers():
    loader = DataLoader(Straggler(), batch_size=4, device="cpu", fetch_threads=4, in_order=False)
    batches = [b.tolist() for b in loader]
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(64))
    assert [b[0] for b in batches] != sorted(b[0] for b in batches), "no batch overtook a straggler"
    in_order = [b.tolist() for b in DataLoader(Straggler(), batch_size=4, device="cpu", fetch_threads=4)]
    assert in_order == [list(range(i, i + 4)) for i in range(0, 64, 4)]


def test_out_of_order_resume_yields_exactly_the_rest():
    loader = DataLoader(Straggler(), batch_size=4, device="cpu", fetch_threads=4, in_order=False)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(6)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    assert state["batches_yielded"] + len(state["yielded_out_of_order"]) == 6
    resumed = DataLoader(Straggler(), batch_size=4, device="cpu", fetch_threads=2, in_order=False)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert sorted(i for b in head + rest for i in b) == list(range(64))


# -- distributed: sharding and resuming at another world size ----------------------------
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_indices_is_torch_distributed_sampler(drop_last):
    for n in (0, 1, 10, 11, 53):
        for world in (1, 2, 3, 4):
            for rank in range(world):
                sampler = torch.utils.data.DistributedSampler(range(n), world, rank, seed=4, drop_last=drop_last)
                sampler.set_epoch(2)
                assert list(sampler) == shard_indices(
                    n, num_replicas=world, rank=rank, seed=4, epoch=2, drop_last=drop_last
                )


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_draws_distributed_batches_as_torch_does(drop_last, batch_drop_last, shuffle):
    """The loader slices a DistributedSampler's batches itself (no epoch-long list first): the
    same batches as torch's BatchSampler over the sampler, for every size, world and rank."""
    for n in (0, 1, 10, 11, 53):
        for world in (1, 2, 3):
            for rank in range(world):
                sampler = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=4, drop_last=drop_last)
                sampler.set_epoch(3)
                want = list(torch.utils.data.BatchSampler(sampler, 4, batch_drop_last))
                loader = DataLoader(
                    torch.arange(n), batch_size=4, sampler=sampler, drop_last=batch_drop_last, device="cpu"
                )
                drawn = torch_fastload.distributed.exact_sampler_batches(loader)
                assert drawn is not None and len(drawn) == len(want) == len(loader)
                assert list(drawn) == want
                assert [b.tolist() for b in loader] == want


def test_distributed_batches_fall_back_to_the_sampler_when_they_cannot_be_exact():
    """A subclass that re-orders, a custom batch sampler, or a dataset that changed size since
    the sampler was made: the sampler itself is iterated (torch's own checks apply)."""

    class Reversed(DistributedSampler):
        def __iter__(self):
            return reversed(list(super().__iter__()))

    data = list(range(20))
    loader = DataLoader(data, batch_size=4, sampler=Reversed(data, 2, 0, shuffle=False), device="cpu")
    assert torch_fastload.distributed.exact_sampler_batches(loader) is None
    assert [b.tolist() for b in loader][0] == [18, 16, 14, 12]
    batches = torch.utils.data.BatchSampler(DistributedSampler(data, 2, 0), 4, False)
    assert (
        torch_fastload.distributed.exact_sampler_batches(DataLoader(data, batch_sampler=batches, device="cpu")) is None
    )
    sampler = DistributedSampler(data, 2, 0)
    data.extend(range(20, 30))
    grown = DataLoader(data, batch_size=4, sampler=sampler, device="cpu")
    assert torch_fastload.distributed.exact_sampler_batches(grown) is None
    with pytest.raises(AssertionError, match="total_size"):
        list(grown)


def _samples(batches):
    return [int(i) for b in batches for i in b[1]]


@pytest.mark.parametrize("old_world, new_world, new_batch", [(2, 1, 5), (2, 3, 5), (3, 2, 4), (2, 2, 7)])
def test_resume_at_another_world_size_covers_the_epoch_once(old_world, new_world, new_batch):
    """Every rank checkpoints after k batches (rank 0's state is saved); the epoch continues on
    another number of ranks: no sample repeated or skipped, apart from the new padding."""
    k = 3
    seen = []
    for rank in range(old_world):
        loader = distributed(0, rank=rank, num_replicas=old_world)
        iterator = iter(loader)
        seen += _samples([next(iterator) for _ in range(k)])
        if rank == 0:
            state = json.loads(json.dumps(loader.state_dict()))
        del iterator
    for rank in range(new_world):
        loader = distributed(1, rank=rank, num_replicas=new_world, batch_size=new_batch)
        loader.load_state_dict(state)
        seen += _samples(loader)
    counts = np.bincount(seen, minlength=53)
    assert (counts >= 1).all(), f"skipped samples {np.flatnonzero(counts == 0).tolist()}"
    assert counts.sum() - 53 < new_world, f"repeated samples beyond padding: {np.flatnonzero(counts > 1).tolist()}"


def test_distributed_resume_needs_the_checkpoint_epoch():
    state = _state_after(distributed(0), 1)
    resumed = distributed(0, epoch=4)
    resumed.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"epoch 3 .* epoch 4: call sampler.set_epoch\(3\)"):
        iter(resumed)


# -- bad states -------------------------------------------------------------------------
def test_bad_states_are_refused_with_the_values():
    state = _state_after(sample_path(0), 1)
    with pytest.raises(ResumeError, match="format"):
        sample_path(0).load_state_dict({"batches": 3})
    other = DataLoader(Augmented(58), batch_size=4, shuffle=True, device="cpu")
    with pytest.raises(ResumeError, match="58"):
        other.load_state_dict(state)
    with pytest.raises(ResumeError, match="batch_size/drop_last were 4/False .* are 5/False"):
        DataLoader(Augmented(), batch_size=5, shuffle=True, device="cpu").load_state_dict(state)
    with pytest.raises(ResumeError, match="RandomSampler .* SequentialSampler"):
        DataLoader(Augmented(), batch_size=4, device="cpu").load_state_dict(state)
    with pytest.raises(ResumeError, match="'map' sampler, this loader has a 'distributed' one"):
        DataLoader(
            Augmented(), batch_size=4, sampler=DistributedSampler(range(57), 1, 0), device="cpu"
        ).load_state_dict(state)


def test_state_between_epochs_and_after_the_end():
    loader = sample_path(0)
    assert loader.state_dict()["epoch_in_progress"] is False
    batches = _epoch(loader)
    state = loader.state_dict()
    assert state["epoch_in_progress"] is False
    resumed = sample_path(0)
    resumed.load_state_dict(state)
    assert len(_epoch(resumed)) == len(batches)


class BrokenSampler(torch.utils.data.Sampler):
    def __len__(self):
        return 4

    def __iter__(self):
        raise RuntimeError("sampler broke")
        yield 0


def test_a_failing_sampler_raises_at_next_not_at_iter():
    loader = DataLoader(Augmented(), batch_size=2, sampler=BrokenSampler(), device="cpu")
    iterator = iter(loader)
    with pytest.raises(RuntimeError, match="sampler broke"):
        next(iterator)


# -- tampered states: every field is checked by load_state_dict, nothing half-applied ------
def _tampered(state: dict, path: tuple, value) -> dict:
    state = json.loads(json.dumps(state))
    where = state
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    return state


_NOT_A_STATE = base64.b64encode(b"not a generator state").decode()


@pytest.mark.parametrize(
    "path, value",
    [
        (("batches_yielded",), -1),
        (("batches_yielded",), True),
        (("batches_yielded",), 2.0),
        (("batches_yielded",), 10**6),  # beyond the epoch: refused at load, not at iter()
        (("samples_yielded",), -8),
        (("yielded_out_of_order",), [1]),  # not ahead of batches_yielded
        (("yielded_out_of_order",), [7, 7]),
        (("epoch_in_progress",), 1),
        (("drop_last",), "no"),
        (("rng", "global"), "!!not base64!!"),
        (("rng", "global"), _NOT_A_STATE),
        (("rng", "elsewhere"), _NOT_A_STATE),
    ],
)
def test_tampered_field_is_refused_by_load_state_dict(path, value):
    state = _tampered(_state_after(sample_path(0), 2), path, value)
    loader = sample_path(0)
    field = ".".join(path) if path[0] != "rng" or path[1] != "elsewhere" else "elsewhere"
    with pytest.raises(ResumeError, match=field.replace(".", r"\.")):
        loader.load_state_dict(state)
    assert loader._pending_resume is None


@pytest.mark.parametrize(
    "key, value", [("num_replicas", 0), ("num_replicas", True), ("rank", 2), ("rank", -1), ("start", -5)]
)
def test_tampered_distributed_sampler_is_refused_by_load_state_dict(key, value):
    state = _tampered(_state_after(distributed(0), 1), ("sampler", key), value)
    with pytest.raises(ResumeError, match=rf"sampler\.{key}"):
        distributed(0).load_state_dict(state)


def test_a_bad_generator_state_leaves_every_generator_unchanged():
    state = _tampered(_state_after(generator_owned(0), 2), ("rng", "sampler"), _NOT_A_STATE)
    loader = generator_owned(1)
    torch.manual_seed(99)
    user_global, user_sampler = torch.get_rng_state(), loader.sampler.generator.get_state()
    with pytest.raises(ResumeError, match=r"rng\.sampler"):
        loader.load_state_dict(state)
        iter(loader)
    assert torch.equal(torch.get_rng_state(), user_global)
    assert torch.equal(loader.sampler.generator.get_state(), user_sampler)


def _distributed_with_generator(epoch: int):
    sampler = DistributedSampler(range(53), num_replicas=2, rank=0, shuffle=True, seed=11)
    sampler.set_epoch(epoch)
    generator = torch.Generator().manual_seed(5)
    return DataLoader(Augmented(53), batch_size=5, sampler=sampler, generator=generator, device="cpu")


def test_a_failed_iter_changes_no_generator_and_a_retry_resumes_the_epoch():
    reference = _epoch(_distributed_with_generator(3))
    state = _state_after(_distributed_with_generator(3), 2)
    resumed = _distributed_with_generator(4)
    resumed.load_state_dict(state)
    torch.manual_seed(99)
    user_global, user_loader = torch.get_rng_state(), resumed.generator.get_state()
    with pytest.raises(ResumeError, match=r"call sampler.set_epoch\(3\)"):
        iter(resumed)
    assert torch.equal(torch.get_rng_state(), user_global)
    assert torch.equal(resumed.generator.get_state(), user_loader)
    resumed.sampler.set_epoch(3)
    rest = _epoch(resumed)  # the checkpoint's epoch, not a fresh one
    assert len(rest) == len(reference) - 2
    for k, (want, got) in enumerate(zip(reference[2:], rest)):
        assert_equal(want, got, f"batch {k + 2}")


@pytest.mark.parametrize("field", ["samples_yielded", "yielded_out_of_order", "rng"])
def test_a_missing_field_is_refused_by_load_state_dict(field):
    state = _state_after(sample_path(0), 2)
    del state[field]
    with pytest.raises(ResumeError, match=f"no field '{field}'"):
        sample_path(0).load_state_dict(state)
