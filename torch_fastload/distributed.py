"""Sharding across ranks with ``DistributedSampler`` semantics, resumable at any world size.

The epoch's global order is world-size independent: one permutation of the dataset drawn
from ``seed + epoch``; rank ``r`` of ``W`` takes every ``W``-th index from position ``r``
(torch's ``DistributedSampler``). After every rank has yielded ``k`` batches of ``B``
samples, the first ``k * B * W`` positions of the order are consumed whatever ``W`` was,
so an epoch can continue at another world size from that position with no sample repeated
or skipped: the rest is padded (or truncated, ``drop_last``) for the new world and dealt
out the same way. ``torch.utils.data.DistributedSampler`` needs no replacement: the loader's
``load_state_dict`` rebuilds a resumed epoch's indices from its attributes with
``shard_indices``.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler  # re-exported: the loader resumes it

__all__ = ["DistributedSampler", "shard_indices", "world"]


def world() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, ``(1, 0)`` outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> list:
    """The epoch's global order, exactly as torch's ``DistributedSampler`` draws it."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(length, generator=generator).tolist()
    return list(range(length))


def shard_indices(length: int, *, num_replicas: int, rank: int, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, drop_last: bool = False, start: int = 0) -> list:
    """Rank ``rank``'s indices of the epoch, from global position ``start`` on.

    ``start == 0`` gives torch's ``DistributedSampler`` order exactly (padding repeats the
    first indices; ``drop_last`` truncates to a multiple of ``num_replicas``).
    """
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    if not 0 <= start <= length:
        raise ValueError(f"start position {start} is outside the epoch of {length} samples")
    rest = epoch_order(length, seed, epoch, shuffle)[start:]
    if drop_last:
        total = (len(rest) // num_replicas) * num_replicas
        rest = rest[:total]
    else:
        total = math.ceil(len(rest) / num_replicas) * num_replicas
        padding = total - len(rest)
        if padding and rest:
            rest += (rest * math.ceil(padding / len(rest)))[:padding]
    return rest[rank:total:num_replicas]
