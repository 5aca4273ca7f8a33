"""Uniform neighbour sampling over a CSR graph, vectorised in numpy, with prefetched features.

``NeighborBatches(graph, seeds, fanouts, store, batch_size)`` yields ``SampledBatch``es the
way PyG's NeighborLoader does (sampled nodes with the seeds first, ``edge_index`` in local
ids, ``batch_size`` seeds), with ``x`` gathered from a ``FeatureStore`` and ``y`` from the
labels. The next ``prefetch`` batches are sampled and their features gathered on a
background thread while the current step runs: their ids are known ahead.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["CSRGraph", "SampledBatch", "sample_neighbors", "NeighborBatches"]


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


class NeighborBatches:
    """Mini-batches of ``seeds`` with sampled neighbourhoods and prefetched features."""

    def __init__(self, graph: CSRGraph, seeds, fanouts: Sequence[int], store=None, labels=None, *,
                 batch_size: int = 1024, shuffle: bool = True, seed: int = 0, prefetch: int = 2,
                 device=None):
        self.graph = graph
        self.seeds = np.asarray(seeds, dtype=np.int64)
        if len(np.unique(self.seeds)) != len(self.seeds):
            raise ValueError("seed nodes must be unique")
        self.fanouts = [int(f) for f in fanouts]
        self.store = store
        self.labels = None if labels is None else torch.as_tensor(np.asarray(labels))
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = seed
        self.prefetch = max(0, int(prefetch))
        self.device = torch.device(device) if device is not None else (store.device if store is not None else
                                                                       torch.device("cpu"))
        self.epoch = 0

    def __len__(self) -> int:
        return -(-len(self.seeds) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _make(self, batch_seeds: np.ndarray, rng: np.random.Generator) -> SampledBatch:
        n_id, edge_index = sample_neighbors(self.graph, batch_seeds, self.fanouts, rng)
        x = self.store.gather(n_id) if self.store is not None else None
        y = self.labels[torch.from_numpy(batch_seeds)].to(self.device) if self.labels is not None else None
        return SampledBatch(torch.from_numpy(n_id), torch.from_numpy(edge_index).to(self.device), len(batch_seeds),
                            x, y)

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.seeds)) if self.shuffle else np.arange(len(self.seeds))
        chunks = [self.seeds[order[i:i + self.batch_size]] for i in range(0, len(order), self.batch_size)]
        self.epoch += 1
        if self.prefetch == 0:
            for k, chunk in enumerate(chunks):
                yield self._make(chunk, np.random.default_rng([self.seed, self.epoch, k]))
            return
        epoch = self.epoch
        with ThreadPoolExecutor(1, thread_name_prefix="fastload-gnn") as pool:  # ids known ahead: gather ahead
            pending: deque = deque()
            for k, chunk in enumerate(chunks):
                pending.append(pool.submit(self._make, chunk, np.random.default_rng([self.seed, epoch, k])))
                if len(pending) > self.prefetch:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
