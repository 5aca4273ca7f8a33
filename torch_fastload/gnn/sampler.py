"""Uniform neighbour sampling over a CSR graph (C++, multi-threaded), with prefetched features.

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

``sample_neighbors`` runs ``torch_fastload._C.NeighborSampler`` (csrc/sampler.cpp) where the
extension is built: sampling bounds GNN training (the numpy version took ~22 ms per batch of
1,024 seeds on a 2M-node graph), and its reads into ``indices`` are memory-latency bound, so
several threads (the GIL released) and prefetches keep many cache misses in flight. Its draws
come from a counter-based hash of (key, hop, frontier position, draw number), so the result is
a pure function of (graph, seeds, fanouts, key) whatever the thread count.
``sample_neighbors_numpy`` is the vectorised reference and the fallback without the extension:
the same distribution, other draws for the same key.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from ..distributed import world
from ..resume import ResumeError

try:
    from .. import _C
except ImportError:  # not built: the numpy sampler serves
    _C = None

__all__ = [
    "CSRGraph",
    "SampledBatch",
    "sample_neighbors",
    "sample_neighbors_numpy",
    "batch_key",
    "default_sampler_threads",
    "NeighborBatches",
    "STATE_FORMAT",
]

_KEY_MASK = (1 << 64) - 1


@dataclass
class CSRGraph:
    """Incoming neighbours of node v: ``indices[indptr[v]:indptr[v + 1]]``."""

    indptr: np.ndarray  # int64 (N + 1,)
    indices: np.ndarray  # int64 or int32 (E,)

    def __post_init__(self):
        # contiguous (no copy when they already are): the C++ sampler reads them in place
        self.indptr = np.ascontiguousarray(self.indptr, dtype=np.int64)
        self.indices = np.ascontiguousarray(self.indices)
        n = len(self.indptr) - 1
        if n < 0 or self.indptr[0] != 0 or (np.diff(self.indptr) < 0).any() or self.indptr[-1] != len(self.indices):
            raise ValueError("indptr must start at 0, never decrease and end at len(indices)")
        if len(self.indices) and (int(self.indices.min()) < 0 or int(self.indices.max()) >= n):
            raise ValueError(f"neighbour ids must lie in [0, {n})")

        self._scratch = threading.local()
        self._native = None
        self._native_lock = threading.Lock()

    def native_sampler(self):
        """This graph's ``_C.NeighborSampler`` (made on first use, then shared by every thread: it
        keeps a small pool of per-call scratch), or None where the extension lacks it. It reads
        ``indptr``/``indices`` in place; indices of a dtype other than int32/int64 are widened
        once to int64."""
        if self._native is None and _C is not None and hasattr(_C, "NeighborSampler"):
            with self._native_lock:
                if self._native is None:
                    indices = self.indices
                    if indices.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
                        indices = indices.astype(np.int64)
                    self._native = _C.NeighborSampler(self.indptr, indices)
        return self._native

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
    x: torch.Tensor | None = None  # features of n_id (on the store's device)
    y: torch.Tensor | None = None  # labels of the seeds


def default_sampler_threads() -> int:
    """min(8, usable CPUs / processes on this node): DDP runs one process per GPU (torchrun sets
    ``LOCAL_WORLD_SIZE``), and more threads than cores only add contention."""
    return min(8, config.cpus_per_process())


def batch_key(*words: int) -> int:
    """A 64-bit sampling key from non-negative ints (``SeedSequence``: well mixed, stable across
    numpy versions), e.g. ``batch_key(seed, epoch, 1, position)`` as ``NeighborBatches`` does."""
    return int(np.random.SeedSequence([int(w) for w in words]).generate_state(1, np.uint64)[0])


def _check(graph: CSRGraph, seeds: np.ndarray, fanouts: Sequence[int]) -> list:
    n = graph.num_nodes
    bad = seeds[(seeds < 0) | (seeds >= n)]
    if len(bad):
        raise ValueError(
            f"{len(bad)} seed(s) outside [0, {n}): {', '.join(map(str, bad[:8].tolist()))}"
            + (", ..." if len(bad) > 8 else "")
        )
    fanouts = [int(f) for f in fanouts]
    if any(f < 0 for f in fanouts):
        raise ValueError(f"fanouts must be >= 0 (0: no neighbours at that hop), got {fanouts}")
    return fanouts


def sample_neighbors(
    graph: CSRGraph,
    seeds,
    fanouts: Sequence[int],
    rng: np.random.Generator | None = None,
    *,
    key: int | None = None,
    num_threads: int | None = None,
):
    """``(n_id, edge_index)``, int64 numpy: per hop, each frontier node of degree d > 0 draws
    ``fanout`` neighbours uniformly with replacement (duplicates merged; degree 0: no edges);
    the next frontier is the hop's new nodes. ``n_id`` holds the (unique) seeds in their order,
    then each hop's new nodes; ``edge_index`` (2, E) local ids: row 0 the sampled neighbour,
    row 1 the frontier node it was drawn for (PyG's NeighborLoader convention).

    The draws come from the 64-bit ``key`` (any int, taken modulo 2**64); without one, a key
    is drawn from ``rng`` (one draw, so a seeded Generator still gives reproducible batches), or
    from fresh entropy. The result is a pure function of (graph, seeds, fanouts, key) for a
    given backend: the C++ sampler on ``num_threads`` threads (default
    ``default_sampler_threads()``; any count gives the same result), or, where the extension
    is not built, ``sample_neighbors_numpy`` (with ``rng`` if given, else ``default_rng(key)``).
    ValueError names seeds outside [0, num_nodes) and negative fanouts."""
    seeds = np.ascontiguousarray(seeds, dtype=np.int64)
    if num_threads is not None and int(num_threads) < 1:
        raise ValueError(f"num_threads must be >= 1 (or None for the default), got {num_threads}")
    sampler = graph.native_sampler()
    if sampler is None:
        if key is not None or rng is None:
            rng = np.random.default_rng(None if key is None else int(key) & _KEY_MASK)
        return sample_neighbors_numpy(graph, seeds, fanouts, rng)
    if key is None:
        source = rng if rng is not None else np.random.default_rng()
        key = int(source.integers(0, _KEY_MASK, dtype=np.uint64, endpoint=True))
    threads = default_sampler_threads() if num_threads is None else int(num_threads)
    n_id, edge_index = sampler.sample(seeds, [int(f) for f in fanouts], int(key) & _KEY_MASK, threads)
    return np.asarray(n_id), np.asarray(edge_index)  # views of the C++ result, no copy


def sample_neighbors_numpy(graph: CSRGraph, seeds, fanouts: Sequence[int], rng: np.random.Generator):
    """The vectorised numpy sampler: ``sample_neighbors``' semantics, draws from ``rng`` (other
    draws than the C++ sampler's). The reference for tests, and the fallback without ``_C``.

    Per-thread scratch arrays over all nodes (a generation stamp and a local position) find a
    hop's new nodes and relabel edges without sorting the sampled set."""
    seeds = np.asarray(seeds, dtype=np.int64)
    fanouts = _check(graph, seeds, fanouts)
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

    Sampling runs the C++ sampler on ``sampler_threads`` threads (default
    ``default_sampler_threads()``), off the GIL, on the prefetch thread when ``prefetch`` > 0.

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

    Determinism: a batch's neighbour sampling draws from the key
    ``batch_key(seed, epoch, 1, position)``, where ``position`` is the global position of the
    batch's first seed in the (padded) epoch order: prefetch depth, ``sampler_threads``, world
    size and timing cannot change a batch (the key, not a Generator's state, decides it). The
    C++ and numpy samplers draw differently from one key: a run resumes bit-identically where
    the extension is built (or missing) on both sides, as usual.

    Resume: ``state_dict()`` records where the epoch stands as a global position (batches
    *yielded to the user*, not prefetched: ``start + batches * batch_size * num_replicas``).
    After ``load_state_dict`` the next ``iter()`` yields the rest of that epoch: at the same
    world and batch size exactly the batches the uninterrupted run had left; at another one the
    rest of the order dealt out for the new world (no seed repeated or skipped, apart from the
    padding). The state of rank 0 serves every rank, provided all ranks yielded the same number
    of batches (true at a step boundary of synchronous training).
    """

    def __init__(
        self,
        graph: CSRGraph,
        seeds,
        fanouts: Sequence[int],
        store=None,
        labels=None,
        *,
        batch_size: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        prefetch: int = 2,
        device=None,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        sampler_threads: int | None = None,
    ):
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
        self.device = (
            torch.device(device) if device is not None else (store.device if store is not None else torch.device("cpu"))
        )
        if num_replicas is None or rank is None:
            world_size, world_rank = world()
            num_replicas = world_size if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"rank {rank} of num_replicas {num_replicas}: need num_replicas >= 1 and 0 <= rank < num_replicas"
            )
        self.drop_last = bool(drop_last)
        if sampler_threads is not None and int(sampler_threads) < 1:
            raise ValueError(f"sampler_threads must be >= 1 (or None for the default), got {sampler_threads}")
        self.sampler_threads = None if sampler_threads is None else int(sampler_threads)  # C++ sampler's threads
        self.epoch = 0
        self._progress: _Progress | None = None  # the iteration handed out last
        self._resume: tuple[int, int] | None = None  # (epoch, global position) for the next iter()
        self._digest: str | None = None

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
        mine = rest[self.rank : total : world_size]
        size = self.batch_size
        return [(start + self.rank + i * world_size, self.seeds[mine[i : i + size]]) for i in range(0, len(mine), size)]

    def _make(self, batch_seeds: np.ndarray, key: int) -> SampledBatch:
        n_id, edge_index = sample_neighbors(
            self.graph, batch_seeds, self.fanouts, key=key, num_threads=self.sampler_threads
        )
        x = self.store.gather(n_id) if self.store is not None else None
        y = self.labels[torch.from_numpy(batch_seeds)].to(self.device) if self.labels is not None else None
        return SampledBatch(
            torch.from_numpy(n_id), torch.from_numpy(edge_index).to(self.device), len(batch_seeds), x, y
        )

    def __iter__(self):
        """This rank's batches of epoch ``self.epoch`` (the rest of it after ``load_state_dict``);
        ``self.epoch`` advances by one here, when ``iter()`` is called."""
        epoch, start = self.epoch, 0
        if self._resume is not None:
            resume_epoch, start = self._resume
            if resume_epoch != epoch:
                raise ResumeError(
                    f"the loaded state is in epoch {resume_epoch} but NeighborBatches is at epoch "
                    f"{epoch}: call set_epoch({resume_epoch}) (or none) before iterating"
                )
            self._resume = None
        plan = self._plan(epoch, start)
        progress = _Progress(epoch, start, len(plan))
        self._progress = progress
        self.epoch = epoch + 1
        cuda_index = None
        if self.device.type == "cuda" and self.prefetch:
            cuda_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return self._generate(plan, epoch, progress, cuda_index)

    def _generate(self, plan: list, epoch: int, progress: _Progress, cuda_index: int | None):
        def make(position: int, chunk: np.ndarray) -> SampledBatch:
            return self._make(chunk, batch_key(self.seed, epoch, 1, position))

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
        state = {
            "format": STATE_FORMAT,
            "epoch": int(epoch),
            "in_progress": in_progress,
            "position": int(position),
            "start": int(start),
            "batches_yielded": int(yielded),
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_seeds": n,
            "seeds_digest": self._seeds_digest(),
            "fanouts": list(self.fanouts),
        }
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
            raise ResumeError(
                f"the state is for another set (or order) of seed nodes ({state['num_seeds']} seeds, "
                f"digest {state['seeds_digest']}), these are {n} seeds, digest {self._seeds_digest()}"
            )
        for key in ("shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise ResumeError(
                    f"the state's epoch order was drawn with {key}={state[key]!r}, this NeighborBatches "
                    f"has {key}={getattr(self, key)!r}: the rest of the epoch would not be the rest"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= n:
            raise ResumeError(f"the state's epoch {epoch} is negative or its position {position} is outside [0, {n}]")
        self.epoch = epoch
        self._progress = None
        self._resume = (epoch, position) if state["in_progress"] else None
