"""Exact mid-epoch resume: what a loader's ``state_dict`` holds and how an epoch continues.

A state counts batches *yielded to the user* (by their number in the epoch), never those
prefetched. It also holds the random-generator states from the start of the epoch, so a
resumed iterator draws the same shuffle and the same base seed again, and then skips what
was yielded. ``DistributedSampler`` epochs are resumed by global position instead
(``distributed.shard_indices``), which also works at another world size.

NOTE [determinism]: every random draw that decides an epoch happens on the thread that calls
``iter(loader)``, before any pipeline thread starts (the first batch of indices is pulled
there), and per-batch randomness in sources comes from ``batch_key()``: the iterator's base
seed and the batch's number. So thread counts, prefetch depth and timing cannot change a batch.
"""

from __future__ import annotations

import base64
import json
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler

from .distributed import exact_sampler_batches, sampler_batches, shard_indices
from .errors import FastloadError
from .sampling import bulk_batches

__all__ = [
    "ResumeError",
    "batch_key",
    "batch_generator",
    "batch_numpy_rng",
    "STATE_FORMAT",
    "begin_epoch",
    "index_sampler",
]

STATE_FORMAT = "torch_fastload.DataLoader/1"


class ResumeError(FastloadError, ValueError):
    """A state that this loader cannot continue from (the reason and the values are in the message)."""


# -- per-batch keys: randomness that does not depend on which thread runs a batch -------------
_local = threading.local()


@dataclass(frozen=True)
class BatchKey:
    base_seed: int  # drawn once per iterator from the loader's generator (torch's _base_seed)
    number: int  # the batch's number in the epoch


def batch_key() -> BatchKey | None:
    """The key of the batch being fetched on this thread (None outside a fastload fetch)."""
    return getattr(_local, "key", None)


class _KeyScope:
    def __init__(self, key: BatchKey | None):
        self.key = key

    def __enter__(self):
        self.saved = getattr(_local, "key", None)
        _local.key = self.key
        self.generators = getattr(_local, "generators", None)
        _local.generators = None

    def __exit__(self, *exc):
        _local.key = self.saved
        _local.generators = self.generators


def batch_generator() -> torch.Generator:
    """A torch generator for the batch being fetched, seeded by its key: draw per-sample
    augmentation from it (instead of torch's global generator) and a batch is the same whatever
    thread fetched it, whatever ran beside it. Outside a fetch: torch's default generator."""
    key = batch_key()
    if key is None:
        return torch.default_generator
    generators = _local.generators = getattr(_local, "generators", None) or {}
    if "torch" not in generators:
        generators["torch"] = torch.Generator().manual_seed(_mix(key.base_seed, key.number))
    return generators["torch"]


def batch_numpy_rng():
    """As ``batch_generator``, for numpy (a ``np.random.Generator``)."""
    import numpy as np

    key = batch_key()
    if key is None:  # seeded from torch's generator, so torch.manual_seed and worker seeds apply
        return np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))
    generators = _local.generators = getattr(_local, "generators", None) or {}
    if "numpy" not in generators:
        generators["numpy"] = np.random.default_rng([key.base_seed & (2**63 - 1), key.number])
    return generators["numpy"]


def _mix(a: int, b: int) -> int:
    return (a * 6364136223846793005 + b * 1442695040888963407 + 1) & (2**63 - 1)


# -- random generator states ------------------------------------------------------------
def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def generators_of(loader) -> dict[str, torch.Generator]:
    """The generators an epoch of ``loader`` draws from: its own, its sampler's, torch's default."""
    found = {"global": torch.default_generator}
    if loader.generator is not None:
        found["loader"] = loader.generator
    sampler = getattr(loader.batch_sampler, "sampler", None) if loader.batch_sampler is not None else None
    for name, obj in (("sampler", loader.sampler), ("batch_sampler_sampler", sampler)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found.values()):
            found[name] = gen
    return found


def capture(generators: dict[str, torch.Generator]) -> dict[str, str]:
    return {name: _encode(gen.get_state()) for name, gen in generators.items()}


def restore(generators: dict[str, torch.Generator], states: dict[str, str]) -> None:
    missing = set(states) - set(generators)
    if missing:
        raise ResumeError(
            f"the state holds generator(s) {sorted(missing)} that this loader does not have "
            f"(it has {sorted(generators)}): build the loader with the same generator and sampler"
        )
    for name, text in states.items():
        generators[name].set_state(_decode(text))


# -- progress of the epoch being iterated ------------------------------------------------
@dataclass
class EpochProgress:
    """Which batches of the epoch the user has received; the state at the epoch's start."""

    rng: dict  # generator states at the start of the epoch
    sampler: dict  # how the epoch's indices were made (kind, and for distributed: position)
    base_seed: int = 0
    prefix: int = 0  # batches 0..prefix-1 were all yielded
    extra: set = field(default_factory=set)  # yielded numbers >= prefix (out-of-order mode)
    samples: int = 0
    finished: bool = False
    numbers: deque | None = None  # epoch numbers of the batches pulled so far (resumed epochs)
    counter: int = 0
    discard_prefix: int = 0  # an IterableDataset cannot skip: batches fetched again and dropped
    discard: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_number(self) -> int:
        """The epoch number of the next batch in fetch order."""
        with self.lock:
            if self.numbers is not None:
                return self.numbers.popleft()
            self.counter += 1
            return self.counter - 1

    def next_numbers(self, count: int) -> list:
        """``next_number()`` for the next ``count`` batches, under one lock."""
        with self.lock:
            if self.numbers is not None:
                return [self.numbers.popleft() for _ in range(count)]
            first, self.counter = self.counter, self.counter + count
            return list(range(first, first + count))

    def yielded(self, number: int, samples: int) -> None:
        with self.lock:
            self.extra.add(number)
            while self.prefix in self.extra:
                self.extra.discard(self.prefix)
                self.prefix += 1
            self.samples += samples


class NumberedBatches:
    """A batch sampler's batches with the ones already yielded left out; the epoch number of each
    batch it hands out is queued on ``numbers`` (the fetch side takes them in the same order)."""

    def __init__(self, batches, skip_prefix: int, skip: set, numbers: deque, total: int | None):
        self.batches = batches
        self.skip_prefix = skip_prefix
        self.skip = skip
        self.numbers = numbers
        self.total = total

    def __iter__(self) -> Iterator:
        for number, batch in enumerate(self.batches):
            if number < self.skip_prefix or number in self.skip:
                continue
            self.numbers.append(number)
            yield batch

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("the resumed sampler has no length")
        return self.total - self.skip_prefix - len(self.skip)


def is_distributed(sampler) -> bool:
    """A DistributedSampler whose order is torch's (subclasses that re-order are not)."""
    return isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__


def describe_sampler(loader) -> dict:
    if isinstance(loader.dataset, IterableDataset):
        return {"kind": "iterable", "num_workers": loader.num_workers}
    sampler = loader.sampler
    if is_distributed(sampler):
        return {
            "kind": "distributed",
            "num_replicas": sampler.num_replicas,
            "rank": sampler.rank,
            "epoch": sampler.epoch,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
            "start": 0,
        }
    return {
        "kind": "map",
        "sampler": type(sampler).__name__,
        "batch_sampler": type(loader.batch_sampler).__name__ if loader.batch_sampler is not None else None,
    }


def state_of(loader, progress: EpochProgress | None) -> dict:
    """The JSON-serializable state (see ``DataLoader.state_dict``)."""
    in_progress = progress is not None and not progress.finished
    state = {
        "format": STATE_FORMAT,
        "epoch_in_progress": in_progress,
        "batches_yielded": progress.prefix if in_progress else 0,
        "yielded_out_of_order": sorted(progress.extra) if in_progress else [],
        "samples_yielded": progress.samples if in_progress else 0,
        "dataset_length": _length(loader.dataset),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
    }
    if in_progress:
        state["rng"] = dict(progress.rng)
        state["sampler"] = dict(progress.sampler)
    else:  # between epochs: the next one draws from the generators as they are now
        gens = {k: v for k, v in generators_of(loader).items() if k != "global"}
        state["rng"] = capture(gens)
        state["sampler"] = describe_sampler(loader)
    dataset_state = getattr(loader.dataset, "state_dict", None)
    if callable(dataset_state):
        state["dataset"] = dataset_state()
    json.dumps(state)  # a state that is not JSON is a bug here, not in the user's checkpoint
    return state


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def distributed_plan(loader, state: dict) -> tuple[int, int, set]:
    """``(start position, batches to skip, out-of-order numbers to skip)`` of a resumed
    DistributedSampler epoch on this loader (same or another world size / batch size)."""
    sampler = loader.sampler
    saved = state["sampler"]
    if sampler.epoch != saved["epoch"]:
        raise ResumeError(
            f"the checkpoint is in epoch {saved['epoch']} but the DistributedSampler is at epoch "
            f"{sampler.epoch}: call sampler.set_epoch({saved['epoch']}) before iterating"
        )
    start = saved["start"]
    prefix, extra = state["batches_yielded"], set(state["yielded_out_of_order"])
    if saved["num_replicas"] == sampler.num_replicas and state["batch_size"] == loader.batch_size:
        return start, prefix, extra
    consumed = start + prefix * state["batch_size"] * saved["num_replicas"]
    return min(consumed, len(loader.dataset)), 0, set()


def distributed_batches(loader, start: int):
    sampler = loader.sampler
    size = loader.batch_size
    if size is None or not loader._auto_collation:  # one sample per "batch"
        return shard_indices(
            len(loader.dataset),
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            seed=sampler.seed,
            epoch=sampler.epoch,
            shuffle=sampler.shuffle,
            drop_last=sampler.drop_last,
            start=start,
        )
    return sampler_batches(sampler, size, loader.drop_last, length=len(loader.dataset), start=start)


# -- the start of an epoch: every draw that decides it, on the thread calling iter() ---------
def begin_epoch(loader, state: dict | None, make_source) -> tuple[Any, EpochProgress]:
    """``(source, progress)`` of a new epoch: ``make_source()`` builds the torch-side iterator
    (which draws the shuffle and the base seed) while ``loader._index_sampler`` answers with
    this epoch's index batches. For a checkpointed epoch (``state``, from ``load_state_dict``)
    the generators are first put back to the epoch's start, so the same draws are made again,
    and the batches already yielded are left out; torch's global generator is then restored to
    where the user had it. NOTE [determinism] above."""
    generators = generators_of(loader)
    resuming = state is not None and state["epoch_in_progress"]
    before = {name: gen.get_state() for name, gen in generators.items()}
    try:
        if state is not None:
            restore(generators, state["rng"])
        rng_at_start = dict(state["rng"]) if resuming else capture(generators)
        progress = EpochProgress(rng=rng_at_start, sampler=describe_sampler(loader))
        batches = resumed_batches(loader, state, progress)
        if batches is None and progress.discard_prefix == 0:
            batches = exact_sampler_batches(loader)
            if batches is None:
                batches = bulk_batches(loader)
        loader._epoch_index_sampler = batches
        source = make_source()
    except BaseException:  # a checkpoint's epoch did not begin: every generator is as the user had it
        if state is not None:
            for name, gen in generators.items():
                gen.set_state(before[name])
        raise
    finally:
        loader._epoch_index_sampler = None
    if resuming:  # the epoch's draws are redone: torch's global generator goes back to the user's
        torch.default_generator.set_state(before["global"])
    progress.base_seed = int(source._base_seed) & (2**63 - 1)
    return source, progress


def index_sampler(loader, torch_index_sampler: Callable[[], Any]):
    """What ``loader._index_sampler`` answers: the epoch's batches drawn by ``begin_epoch``
    while it builds the iterator (a resumed epoch, a DistributedSampler's sliced lazily), else
    torch's own (``torch_index_sampler()``)."""
    drawn = loader.__dict__.get("_epoch_index_sampler")
    return drawn if drawn is not None else torch_index_sampler()


def resumed_batches(loader, state: dict | None, progress: EpochProgress) -> NumberedBatches | None:
    """The index batches left in a checkpointed epoch, numbered as in the epoch; None when the
    epoch starts from its beginning (or is an iterable's, replayed and dropped instead)."""
    if state is None or not state["epoch_in_progress"]:
        return None
    progress.samples = state["samples_yielded"]
    prefix, extra = state["batches_yielded"], set(state["yielded_out_of_order"])
    kind = state["sampler"]["kind"]
    if kind == "iterable":  # no indices to skip: the batches are fetched again and dropped
        progress.prefix = progress.discard_prefix = prefix
        progress.extra, progress.discard = set(extra), set(extra)
        return None
    numbers: deque = deque()
    progress.numbers = numbers
    if kind == "distributed":
        start, prefix, extra = distributed_plan(loader, state)
        progress.sampler["start"] = start
        batches = distributed_batches(loader, start)
        total = len(batches)
    else:
        batches = loader._index_sampler  # torch's: begin_epoch sets the epoch's own only after this
        try:
            total = len(batches)
        except TypeError:
            total = None
        if total is not None and prefix + len(extra) > total:
            raise ResumeError(f"the state has {prefix + len(extra)} batches yielded, the epoch has {total}")
    progress.prefix, progress.extra = prefix, set(extra)
    return NumberedBatches(batches, prefix, extra, numbers, total)
