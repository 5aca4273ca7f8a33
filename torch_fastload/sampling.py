"""An epoch's index batches drawn in bulk where the sampler is torch's own.

torch's ``BatchSampler`` builds every batch as a Python list, one int at a time: ~15 us a batch
of 128 on the training thread of a real loop, where the native loop's ``next()`` runs. Where the
batch sampler is torch's ``BatchSampler`` over an unmodified ``RandomSampler`` (without
replacement) or ``SequentialSampler``, the epoch's order is one tensor, drawn with the
sampler's own calls on the same generators when the sampler would make them (at the epoch's
first batch), and every batch is a slice of it: a list for the Python pipeline, an int64 array
for the native loop (``arrays()``). The emulation is checked against torch's sampler once per
process; where torch draws differently, the sampler is iterated as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

__all__ = ["OrderBatches", "OrderPass", "bulk_batches"]


class OrderBatches:
    """Batches of ``batch_size`` consecutive positions of an order tensor (given, or drawn by
    ``draw()`` at the first batch of each pass), as torch's ``BatchSampler`` cuts them."""

    def __init__(self, order: torch.Tensor | Callable[[], torch.Tensor], count: int, batch_size: int, drop_last: bool):
        self._order = order if isinstance(order, torch.Tensor) else None
        self._draw = None if isinstance(order, torch.Tensor) else order
        self.count = count
        self.batch_size = batch_size
        self.drop_last = drop_last

    @property
    def indices(self) -> torch.Tensor:
        """The order (a drawn order is drawn anew here, as a new pass over torch's sampler would)."""
        return self._order if self._draw is None else self._drawn()

    def _drawn(self) -> torch.Tensor:
        order = self._draw()
        if order.numel() != self.count:
            raise RuntimeError(f"the sampler drew {order.numel()} indices, {self.count} were expected")
        return order

    def __len__(self) -> int:
        n = self.count
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> OrderPass:
        return OrderPass(self)


class OrderPass:
    """One pass over ``OrderBatches``: the order is drawn at its first batch (or by ``draw()``),
    as torch's sampler draws at its first; batches come as lists (``next()``) or, from the same
    position on, as int64 arrays (``arrays()``)."""

    def __init__(self, batches: OrderBatches):
        self._batches = batches
        self._order: torch.Tensor | None = None
        self._flat: np.ndarray | None = None
        self._position = 0
        self._end = len(batches) * batches.batch_size

    @property
    def batch_size(self) -> int:
        return self._batches.batch_size

    def draw(self) -> None:
        """Make the pass's draws now (the first batch's moment, NOTE [determinism] in resume.py)."""
        if self._order is None:
            self._order = self._batches.indices

    def __iter__(self) -> OrderPass:
        return self

    def __next__(self) -> list:
        self.draw()
        if self._position >= self._end:
            raise StopIteration
        at, self._position = self._position, self._position + self._batches.batch_size
        return self._order[at : self._position].tolist()

    def arrays(self) -> Iterator[np.ndarray]:
        """The rest of the pass as int64 arrays (views of one array): no Python int per sample."""
        flat = self._flat_order()
        size = self._batches.batch_size
        while self._position < self._end:
            at, self._position = self._position, self._position + size
            yield flat[at : self._position]

    def full_batches(self, most: int) -> np.ndarray | None:
        """Up to ``most`` of the next batches, all of the full batch size, as the rows of one
        ``(k, batch_size)`` view (a group's indices without a copy), or None where the next batch
        is short or the pass is over (``arrays()`` hands those out, from the same position)."""
        flat = self._flat_order()
        size = self._batches.batch_size
        k = min(most, (min(self._end, len(flat)) - self._position) // size)
        if k < 1:
            return None
        at, self._position = self._position, self._position + k * size
        return flat[at : self._position].reshape(k, size)

    def _flat_order(self) -> np.ndarray:
        self.draw()
        if self._flat is None:
            self._flat = np.ascontiguousarray(self._order.numpy(), dtype=np.int64)
        return self._flat


def _random_order(sampler: RandomSampler) -> torch.Tensor:
    """``RandomSampler.__iter__``'s draws (without replacement), as one tensor."""
    n = len(sampler.data_source)
    if sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    parts = [torch.randperm(n, generator=generator) for _ in range(sampler.num_samples // n)]
    if sampler.num_samples % n or sampler.generator is not None:
        # torch draws this permutation even for no samples; it only matters to a generator that
        # outlives the epoch (the sampler's own), not to the seeded one made above and dropped
        parts.append(torch.randperm(n, generator=generator)[: sampler.num_samples % n])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


_EMULATION_MATCHES: bool | None = None


def _emulation_matches() -> bool:
    """Whether ``_random_order`` draws what this torch's ``RandomSampler`` yields (own
    generator, and torch's global one), checked once; the global generator is left as found."""
    global _EMULATION_MATCHES
    if _EMULATION_MATCHES is None:
        saved = torch.get_rng_state()
        try:
            ok = True
            for num_samples in (None, 29, 50):
                sampler = RandomSampler(range(13), num_samples=num_samples, generator=torch.Generator().manual_seed(7))
                expected = list(sampler)
                sampler.generator.manual_seed(7)
                ok = ok and _random_order(sampler).tolist() == expected
                unseeded = RandomSampler(range(13), num_samples=num_samples)
                torch.manual_seed(11)
                expected = list(unseeded)
                torch.manual_seed(11)
                ok = ok and _random_order(unseeded).tolist() == expected
        except Exception:
            ok = False
        finally:
            torch.set_rng_state(saved)
        _EMULATION_MATCHES = ok
    return _EMULATION_MATCHES


def bulk_batches(loader) -> OrderBatches | None:
    """The epoch's batches as ``OrderBatches`` where ``loader``'s batch sampler is torch's
    ``BatchSampler`` over an unmodified ``RandomSampler`` (no replacement) or
    ``SequentialSampler``; None otherwise (the sampler is then iterated as usual)."""
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler or not loader._auto_collation:
        return None
    sampler = batches.sampler
    try:
        n = len(sampler.data_source)
    except (AttributeError, TypeError):
        return None
    if type(sampler) is SequentialSampler:
        return OrderBatches(lambda: torch.arange(n), n, batches.batch_size, batches.drop_last)
    if type(sampler) is not RandomSampler or sampler.replacement or n <= 0 or not _emulation_matches():
        return None
    if sampler.generator is not None and not isinstance(sampler.generator, torch.Generator):
        return None
    return OrderBatches(lambda: _random_order(sampler), sampler.num_samples, batches.batch_size, batches.drop_last)
