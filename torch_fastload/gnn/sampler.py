"""Uniform neighbour sampling over a CSR graph, vectorised in numpy, with prefetched features.

``NeighborBatches(graph, seeds, fanouts, store, batch_size)`` yields ``SampledBatch``es the
way PyG's NeighborLoader does (sampled nodes with the seeds first, ``edge_index`` in local
ids, ``batch_size`` seeds), with ``x`` gathered from a ``FeatureStore`` and ``y`` from the
labels. The next ``prefetch`` batches are sampled and their features gathered on a
background thread while the current step runs: their ids are known ahead.

``NeighborBatches`` shards an epoch across DDP ranks as ``DistributedSampler`` does
(``num_replicas``/``rank``), draws each batch's neighbours from a key of (seed, epoch, global
position) so batches never depend on prefetch depth or threads, and checkpoints an epoch
part-way (``state_dict``/``load_state_dict``) as a global position: the same world resumes
bit-identically, another world size or batch size continues with each seed once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..distributed import world
from ..resume import ResumeError

__all__ = ["CSRGraph", "SampledBatch", "sample_neighbors", "NeighborBatches", "STATE_FORMAT"]


@dataclass
class CSRGraph:
    """Incoming neighbours of node v: ``indices[indptr[v]:indptr[v + 1]]``."""

    indptr: np.ndarray  # int64 (N + 1,)
    indices: np.ndarray  # int64 or int32 (E,)

    def __post_init__(self):
        self.indptr = np.asarray(self.indptr, dtype=np.int64)
        self.indices = np.asarray(self.indices)
        n = len(self.indptr) - 1
        if n < 0 or self.indptr[0] != 0 or (np.diff(self.indptr) < 0).any() or self.indptr[-1] != len(self.indices):
            raise ValueError("indptr must start at 0, never decrease and end at len(indices)")
        if len(self.indices) and (int(self.indices.min()) < 0 or int(self.indices.max()) >= n):
            raise ValueError(f"neighbour ids must lie in [0, {n})")

        self._scratch = threading.local()

    def _scratch_arrays(self):
        """This thread's (stamp, position, generation) over all nodes, generation bumped."""
        local = self._scratch
        if getattr(local, "stamp", None) is None:
            local.stamp = np.zeros(self.num_nodes, dtype=np.int32)
            local.position = np.zeros(self.num_nodes, dtype=np.int64)
            local.generation = 0
        local.generation += 1
        if local.generation >= np.iinfo(np.int32).max:
            local.stamp[:] = 0
            local.generation = 1
        return local.stamp, local.position, local.generation

    @property
    def num_nodes(self) -> int:
        return len(self.indptr) - 1

    def degree(self) -> np.ndarray:
        return np.diff(self.indptr)


@dataclass
class SampledBatch:
    n_id: torch.Tensor  # sampled node ids (global), the seeds first
    edge_index: torch.Tensor  # (2, E) local ids: row 0 source (neighbour), row 1 target
    batch_size: int  # the first batch_size nodes of n_id are the seeds
    x: Optional[torch.Tensor] = None  # features of n_id (on the store's device)
    y: Optional[torch.Tensor] = None  # labels of the seeds


def sample_neighbors(graph: CSRGraph, seeds: np.ndarray, fanouts: Sequence[int], rng: np.random.Generator):
    """``(n_id, edge_index)``: up to ``fanout`` uniform neighbours (with replacement, duplicates
    merged) per node, hop by hop; ``n_id`` starts with the seeds in their order.

    Per-thread scratch arrays over all nodes (a generation stamp and a local position) find a
    hop's new nodes and relabel edges without sorting the sampled set."""
    seeds = np.asarray(seeds, dtype=np.int64)
    stamp, position, generation = graph._scratch_arrays()
    n = graph.num_nodes
    stamp[seeds] = generation
    position[seeds] = np.arange(len(seeds))
    all_nodes = [seeds]
    src_parts, dst_parts = [], []
    count = len(seeds)
    frontier = seeds
    for fanout in fanouts:
        start = graph.indptr[frontier]
        degree = graph.indptr[frontier + 1] - start
        has = degree > 0
        f = frontier[has]
        picks = rng.integers(0, np.iinfo(np.int64).max, size=(len(f), fanout)) % degree[has][:, None]
        neighbours = graph.indices[start[has][:, None] + picks].astype(np.int64).reshape(-1)
        keys = np.unique(np.repeat(f, fanout) * n + neighbours)  # one sort of the hop's pairs
        dst, src = np.divmod(keys, n)
        dst_parts.append(dst)
        src_parts.append(src)
        fresh = src[stamp[src] != generation]
        new = np.unique(fresh)
        stamp[new] = generation
        position[new] = count + np.arange(len(new))
        count += len(new)
        all_nodes.append(new)
        frontier = new
    nodes = np.concatenate(all_nodes)
    src = np.concatenate(src_parts) if src_parts else np.zeros(0, dtype=np.int64)
    dst = np.concatenate(dst_parts) if dst_parts else np.zeros(0, dtype=np.int64)
    return nodes, np.stack([position[src], position[dst]])


STATE_FORMAT = "torch_fastload.gnn.NeighborBatches/1"


@dataclass
class _Progress:
    """The iteration handed out last: which epoch, from which global position, how far."""

    epoch: int
    start: int  # global position of the epoch's order this iteration began at (0 unless resumed)
    batches: int  # batches this iteration yields (per rank)
    yielded: int = 0  # batches handed to the user (not those prefetched)
    exhausted: bool = False  # StopIteration reached


class NeighborBatches:
    """Mini-batches of ``seeds`` with sampled neighbourhoods and prefetched features.

    Epochs: ``iter()`` uses ``self.epoch`` and then advances it by one, so a plain loop draws
    a new shuffle each epoch. Code written for ``DistributedSampler`` calls ``set_epoch(e)``
    before each epoch and gets epoch ``e`` whatever happened before; both work. Under DDP every
    rank must iterate the same epoch: call ``set_epoch`` on each rank (recommended), or iterate
    the same number of times on each.

    Sharding (``DistributedSampler`` semantics): ``num_replicas``/``rank`` default to the
    initialized process group's (1/0 outside one). The epoch's global order of the seeds is
    world-size independent (``np.random.default_rng([seed, epoch])``); rank ``r`` takes
    positions ``r, r + W, r + 2W, ...`` of it, padded by repeating the order's first seeds to a
    multiple of ``W`` (``drop_last=False``) or cut to one (``drop_last=True``). Every rank yields
    ``len(self)`` batches.

    Determinism: a batch's neighbour sampling draws from
    ``np.random.default_rng([seed, epoch, 1, position])``, where ``position`` is the global
    position of the batch's first seed in the (padded) epoch order: prefetch depth, threads and
    timing cannot change a batch.

    Resume: ``state_dict()`` records where the epoch stands as a global position (batches
    *yielded to the user*, not prefetched: ``start + batches * batch_size * num_replicas``).
    After ``load_state_dict`` the next ``iter()`` yields the rest of that epoch: at the same
    world and batch size exactly the batches the uninterrupted run had left; at another one the
    rest of the order dealt out for the new world (no seed repeated or skipped, apart from the
    padding). The state of rank 0 serves every rank, provided all ranks yielded the same number
    of batches (true at a step boundary of synchronous training).
    """

    def __init__(self, graph: CSRGraph, seeds, fanouts: Sequence[int], store=None, labels=None, *,
                 batch_size: int = 1024, shuffle: bool = True, seed: int = 0, prefetch: int = 2,
                 device=None, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 drop_last: bool = False):
        self.graph = graph
        self.seeds = np.asarray(seeds, dtype=np.int64)
        if len(np.unique(self.seeds)) != len(self.seeds):
            raise ValueError("seed nodes must be unique")
        self.fanouts = [int(f) for f in fanouts]
        self.store = store
        self.labels = None if labels is None else torch.as_tensor(np.asarray(labels))
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        self.prefetch = max(0, int(prefetch))
        self.device = torch.device(device) if device is not None else (store.device if store is not None else
                                                                       torch.device("cpu"))
        if num_replicas is None or rank is None:
            world_size, world_rank = world()
            num_replicas = world_size if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {rank} of num_replicas {num_replicas}: need num_replicas >= 1 and "
                             f"0 <= rank < num_replicas")
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._progress: Optional[_Progress] = None  # the iteration handed out last
        self._resume: Optional[tuple[int, int]] = None  # (epoch, global position) for the next iter()
        self._digest: Optional[str] = None

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (the same on every rank)."""
        return -(-self._shard_length(len(self.seeds)) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` draws (as ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)

    # -- the epoch's order and this rank's share of it ------------------------------------------
    def _shard_length(self, rest: int) -> int:
        """How many of ``rest`` remaining positions each rank takes."""
        return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)

    def _order(self, epoch: int) -> np.ndarray:
        """Positions into ``self.seeds``: the epoch's global order (world-size independent)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(len(self.seeds))
        return np.arange(len(self.seeds))

    def _plan(self, epoch: int, start: int) -> list:
        """``(global position of its first seed, seeds)`` of each batch this rank yields when the
        epoch runs from global position ``start``: the rest of the order, padded with the order's
        first seeds (or cut) to a multiple of ``num_replicas``, every ``num_replicas``-th from ``rank``."""
        order = self._order(epoch)
        rest = order[start:]
        world_size = self.num_replicas
        total = self._shard_length(len(rest)) * world_size
        if total > len(rest):  # np.resize repeats the order when the padding exceeds it
            rest = np.concatenate([rest, np.resize(order, total - len(rest))])
        mine = rest[self.rank:total:world_size]
        size = self.batch_size
        return [(start + self.rank + i * world_size, self.seeds[mine[i:i + size]]) for i in range(0, len(mine), size)]

    def _make(self, batch_seeds: np.ndarray, rng: np.random.Generator) -> SampledBatch:
        n_id, edge_index = sample_neighbors(self.graph, batch_seeds, self.fanouts, rng)
        x = self.store.gather(n_id) if self.store is not None else None
        y = self.labels[torch.from_numpy(batch_seeds)].to(self.device) if self.labels is not None else None
        return SampledBatch(torch.from_numpy(n_id), torch.from_numpy(edge_index).to(self.device), len(batch_seeds),
                            x, y)

    def __iter__(self):
        """This rank's batches of epoch ``self.epoch`` (the rest of it after ``load_state_dict``);
        ``self.epoch`` advances by one here, when ``iter()`` is called."""
        epoch, start = self.epoch, 0
        if self._resume is not None:
            resume_epoch, start = self._resume
            if resume_epoch != epoch:
                raise ResumeError(f"the loaded state is in epoch {resume_epoch} but NeighborBatches is at epoch "
                                  f"{epoch}: call set_epoch({resume_epoch}) (or none) before iterating")
            self._resume = None
        plan = self._plan(epoch, start)
        progress = _Progress(epoch, start, len(plan))
        self._progress = progress
        self.epoch = epoch + 1
        cuda_index = None
        if self.device.type == "cuda" and self.prefetch:
            cuda_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return self._generate(plan, epoch, progress, cuda_index)

    def _generate(self, plan: list, epoch: int, progress: _Progress, cuda_index: Optional[int]):
        def make(position: int, chunk: np.ndarray) -> SampledBatch:
            return self._make(chunk, np.random.default_rng([self.seed, epoch, 1, position]))

        if self.prefetch == 0:
            for position, chunk in plan:
                batch = make(position, chunk)
                progress.yielded += 1  # counted before the yield: the user holds it from here on
                yield batch
        else:
            # the worker's current CUDA device is this rank's: CUDA's current device is per thread, and
            # left at 0, pinned or device allocations there would open a context on another rank's GPU
            setup = {}
            if cuda_index is not None:
                setup = dict(initializer=torch.cuda.set_device, initargs=(cuda_index,))
            with ThreadPoolExecutor(1, thread_name_prefix="fastload-gnn", **setup) as pool:  # ids known ahead
                pending: deque = deque()
                for position, chunk in plan:
                    pending.append(pool.submit(make, position, chunk))
                    if len(pending) > self.prefetch:
                        batch = pending.popleft().result()
                        progress.yielded += 1
                        yield batch
                while pending:
                    batch = pending.popleft().result()
                    progress.yielded += 1
                    yield batch
        progress.exhausted = True

    # -- checkpointing --------------------------------------------------------------------------
    def _seeds_digest(self) -> str:
        if self._digest is None:
            self._digest = hashlib.sha256(np.ascontiguousarray(self.seeds).tobytes()).hexdigest()[:16]
        return self._digest

    def state_dict(self) -> dict:
        """Where the epoch stands, JSON-serializable: ``epoch``, ``in_progress`` and ``position``
        (global positions of the epoch's order consumed: ``start + batches_yielded * batch_size *
        num_replicas``, all of it once this rank yielded its last batch), with the settings the
        order depends on. Between epochs (nothing iterated yet, or the iteration exhausted):
        ``in_progress`` False and ``epoch`` the one the next ``iter()`` draws."""
        n = len(self.seeds)
        if self._resume is not None:  # loaded, not iterated yet: the loaded position
            epoch, start = self._resume
            in_progress, yielded, position = True, 0, start
        elif self._progress is not None and not self._progress.exhausted:
            p = self._progress
            epoch, start, yielded, in_progress = p.epoch, p.start, p.yielded, True
            position = n if yielded >= p.batches else min(n, start + yielded * self.batch_size * self.num_replicas)
        else:
            epoch, start, yielded, position, in_progress = self.epoch, 0, 0, 0, False
        state = {"format": STATE_FORMAT, "epoch": int(epoch), "in_progress": in_progress, "position": int(position),
                 "start": int(start), "batches_yielded": int(yielded), "batch_size": self.batch_size,
                 "num_replicas": self.num_replicas, "rank": self.rank, "drop_last": self.drop_last,
                 "shuffle": self.shuffle, "seed": self.seed, "num_seeds": n, "seeds_digest": self._seeds_digest(),
                 "fanouts": list(self.fanouts)}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue the checkpointed epoch from its global position (at
        this object's world size, rank and batch size, which may differ from the state's), or start
        the state's next epoch. Raises ``ResumeError`` (a ``ValueError``) with the values for a state
        of another seed-node set, shuffle or seed; nothing is changed then."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ResumeError(f"not a NeighborBatches state (format {got!r}, expected {STATE_FORMAT!r})")
        n = len(self.seeds)
        if state["num_seeds"] != n or state["seeds_digest"] != self._seeds_digest():
            raise ResumeError(f"the state is for another set (or order) of seed nodes ({state['num_seeds']} seeds, "
                              f"digest {state['seeds_digest']}), these are {n} seeds, digest {self._seeds_digest()}")
        for key in ("shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise ResumeError(f"the state's epoch order was drawn with {key}={state[key]!r}, this NeighborBatches "
                                  f"has {key}={getattr(self, key)!r}: the rest of the epoch would not be the rest")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= n:
            raise ResumeError(f"the state's epoch {epoch} is negative or its position {position} is outside [0, {n}]")
        self.epoch = epoch
        self._progress = None
        self._resume = (epoch, position) if state["in_progress"] else None
