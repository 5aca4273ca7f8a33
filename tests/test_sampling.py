"""Index batches drawn in bulk (sampling.py): the same batches, and the same generator states
after them, as torch's BatchSampler over RandomSampler / SequentialSampler; torch's own
sampler wherever the emulation does not apply."""

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, TensorDataset

import torch_fastload
import torch_fastload.sampling as sampling
from torch_fastload import DataLoader
from torch_fastload.sampling import OrderBatches, bulk_batches


class _Loader:  # what bulk_batches reads of a DataLoader
    def __init__(self, batch_sampler):
        self.batch_sampler = batch_sampler
        self._auto_collation = True


@pytest.mark.parametrize("num_samples", [None, 7, 64, 100])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("own_generator", [False, True])
def test_random_sampler_batches_and_generator_states_equal_torch(num_samples, drop_last, own_generator):
    def make():
        gen = torch.Generator().manual_seed(3) if own_generator else None
        return BatchSampler(RandomSampler(range(41), num_samples=num_samples, generator=gen), 6, drop_last)

    torch.manual_seed(9)
    theirs_sampler = make()
    theirs = list(theirs_sampler)
    theirs_global = torch.get_rng_state()
    torch.manual_seed(9)
    ours_sampler = make()
    ours = bulk_batches(_Loader(ours_sampler))
    assert isinstance(ours, OrderBatches) and len(ours) == len(theirs_sampler)
    assert list(ours) == theirs
    assert torch.equal(torch.get_rng_state(), theirs_global)  # the same draws from the global generator
    if own_generator:
        assert torch.equal(ours_sampler.sampler.generator.get_state(), theirs_sampler.sampler.generator.get_state())


def test_the_order_is_drawn_at_the_first_batch_not_before():
    batches = bulk_batches(_Loader(BatchSampler(RandomSampler(range(10)), 4, False)))
    before = torch.get_rng_state()
    len(batches)
    assert torch.equal(torch.get_rng_state(), before)
    it = iter(batches)
    assert torch.equal(torch.get_rng_state(), before)
    next(it)
    assert not torch.equal(torch.get_rng_state(), before)


def test_a_pass_continues_as_arrays_from_where_its_lists_stopped():
    batches = bulk_batches(
        _Loader(BatchSampler(RandomSampler(range(10), generator=torch.Generator().manual_seed(3)), 3, False))
    )
    theirs = list(BatchSampler(RandomSampler(range(10), generator=torch.Generator().manual_seed(3)), 3, False))
    it = iter(batches)
    first = next(it)
    rest = [a.tolist() for a in it.arrays()]
    assert [first, *rest] == theirs
    assert next(it, None) is None


def test_arrays_are_the_same_batches_as_int64_arrays():
    batches = bulk_batches(_Loader(BatchSampler(SequentialSampler(range(10)), 4, False)))
    got = list(iter(batches).arrays())
    assert [a.dtype for a in got] == [np.int64] * 3
    assert [a.tolist() for a in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_other_samplers_are_iterated_as_usual():
    class MySampler(RandomSampler):
        pass

    assert bulk_batches(_Loader(BatchSampler(MySampler(range(10)), 4, False))) is None
    assert bulk_batches(_Loader(BatchSampler(RandomSampler(range(10), replacement=True), 4, False))) is None
    assert bulk_batches(_Loader([[0, 1], [2, 3]])) is None


def test_a_torch_that_draws_differently_gets_its_own_sampler(monkeypatch):
    monkeypatch.setattr(sampling, "_EMULATION_MATCHES", None)
    monkeypatch.setattr(sampling, "_random_order", lambda sampler: torch.arange(len(sampler.data_source)))
    assert bulk_batches(_Loader(BatchSampler(RandomSampler(range(10)), 4, False))) is None
    assert sampling._EMULATION_MATCHES is False


def test_the_native_loop_takes_the_arrays_and_matches_torch():
    data = TensorDataset(torch.arange(50) * 10, torch.arange(50))
    torch.manual_seed(4)
    theirs = [b[0].tolist() for b in torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)]
    after_theirs = torch.get_rng_state()
    torch.manual_seed(4)
    loader = DataLoader(data, batch_size=8, shuffle=True, device="cpu")
    it = iter(loader)
    assert it._pipeline._index_arrays is not None
    ours = [b[0].tolist() for b in it]
    assert ours == theirs
    assert torch.equal(torch.get_rng_state(), after_theirs)
    assert loader.stats().path.startswith("native loop")
    with torch_fastload.config.override(native="off"):
        torch.manual_seed(4)
        assert [b[0].tolist() for b in DataLoader(data, batch_size=8, shuffle=True, device="cpu")] == theirs


def test_every_pass_draws_anew_as_torch_does_and_an_empty_pass_still_draws():
    def make():
        return BatchSampler(RandomSampler(range(5), generator=torch.Generator().manual_seed(1)), 8, True)

    theirs_sampler = make()
    theirs = [list(theirs_sampler) for _ in range(2)]
    ours_sampler = make()
    ours = bulk_batches(_Loader(ours_sampler))
    assert [list(ours) for _ in range(2)] == theirs == [[], []]
    assert torch.equal(ours_sampler.sampler.generator.get_state(), theirs_sampler.sampler.generator.get_state())
    sampler = BatchSampler(RandomSampler(range(9), generator=torch.Generator().manual_seed(2)), 4, False)
    theirs = [list(sampler) for _ in range(3)]
    sampler.sampler.generator.manual_seed(2)
    ours = bulk_batches(_Loader(sampler))
    assert [list(ours) for _ in range(3)] == theirs and theirs[0] != theirs[1]


@pytest.mark.parametrize("drop_last", [False, True])
def test_full_batches_hand_out_the_next_full_batches_as_rows_of_the_order(drop_last):
    """A group's indices in one slice (the native loop's groups): the same batches, in order,
    wherever a pass goes on as arrays or as runs; none where only a short batch is left."""

    def make():
        return BatchSampler(RandomSampler(range(23), generator=torch.Generator().manual_seed(5)), 4, drop_last)

    theirs = list(make())
    it = iter(bulk_batches(_Loader(make())))
    arrays = it.arrays()
    got = [next(arrays).tolist()]
    run = it.full_batches(3)
    assert run.shape == (3, 4) and run.dtype == np.int64 and run.base is not None  # a view, no copy
    got += run.tolist()
    run = it.full_batches(10)  # one full batch is left of five
    assert run.shape == (1, 4)
    got += run.tolist()
    assert it.full_batches(10) is None  # the short last batch (or nothing) goes as an array
    got += [a.tolist() for a in arrays]
    assert got == theirs and len(got) == (5 if drop_last else 6)
    assert it.full_batches(1) is None
