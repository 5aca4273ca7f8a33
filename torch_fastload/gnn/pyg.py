"""PyG integration: torch_fastload's FeatureStore behind PyG's FeatureStore / GraphStore API.

    from torch_fastload.gnn.pyg import FastloadFeatureStore, CSRGraphStore
    feature_store = FastloadFeatureStore()
    feature_store["paper", "x", None] = FeatureStore("features.npy", cache_ids=hot, pin=True)
    feature_store["paper", "y", None] = labels                 # plain tensors work too
    graph_store = CSRGraphStore()
    graph_store.put_csr(indptr, indices, ("paper", "cites", "paper"), num_nodes)
    loader = NeighborLoader((feature_store, graph_store), num_neighbors=[15, 10],
                            input_nodes=("paper", train_ids), batch_size=1024)

PyG's loaders then call ``feature_store.multi_get_tensor`` with each mini-batch's node ids,
which become ``FeatureStore.gather`` calls (GPU cache, zero-copy host rows, engine reads).

PyG's NeighborLoader needs pyg-lib or torch-sparse for its sampler. Without them (no wheels
for every torch build), PyG's ``NodeLoader`` runs on torch_fastload's C++ sampler instead:

    sampler = FastloadNeighborSampler.from_graph_store(graph_store, ("paper", "cites", "paper"), [15, 10])
    loader = NodeLoader((feature_store, graph_store), node_sampler=sampler, input_nodes=train_ids,
                        batch_size=1024, shuffle=True)
"""

from __future__ import annotations

import numpy as np
import torch
from torch_geometric.data import EdgeAttr, GraphStore, TensorAttr
from torch_geometric.data import FeatureStore as PyGFeatureStore
from torch_geometric.sampler import BaseSampler, NodeSamplerInput, SamplerOutput

from ..sources.features import FeatureStore
from .sampler import CSRGraph, batch_key, sample_neighbors

__all__ = ["FastloadFeatureStore", "CSRGraphStore", "FastloadNeighborSampler"]


def _key(attr) -> tuple:
    group = attr.group_name if attr.is_set("group_name") else None
    return group, attr.attr_name


class FastloadFeatureStore(PyGFeatureStore):
    """PyG FeatureStore whose tensors are torch_fastload ``FeatureStore``s (or plain tensors)."""

    def __init__(self):
        super().__init__()
        self._items: dict = {}

    def _put_tensor(self, tensor, attr: TensorAttr) -> bool:
        if attr.is_set("index") and attr.index is not None:
            raise ValueError("torch_fastload FeatureStores are written whole (to a file), not by index")
        self._items[_key(attr)] = tensor
        return True

    def _get_tensor(self, attr: TensorAttr) -> torch.Tensor | None:
        item = self._items.get(_key(attr))
        if item is None:
            return None
        index = attr.index if attr.is_set("index") else None
        if isinstance(item, FeatureStore):
            if index is None:
                index = np.arange(len(item))
            elif isinstance(index, slice):
                index = np.arange(len(item))[index]
            return item.gather(index)
        return item if index is None else item[index]

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        return self._items.pop(_key(attr), None) is not None

    def _get_tensor_size(self, attr: TensorAttr):
        item = self._items.get(_key(attr))
        if item is None:
            return None
        return tuple(item.shape)

    def get_all_tensor_attrs(self) -> list:
        return [TensorAttr(group, name) for group, name in self._items]


class CSRGraphStore(GraphStore):
    """An in-memory GraphStore of CSR/COO edge indices (PyG ships only abstract ones)."""

    def __init__(self):
        super().__init__()
        self._edges: dict = {}

    def _put_edge_index(self, edge_index, edge_attr: EdgeAttr) -> bool:
        self._edges[(edge_attr.edge_type, edge_attr.layout)] = (edge_index, edge_attr)
        return True

    def _get_edge_index(self, edge_attr: EdgeAttr):
        found = self._edges.get((edge_attr.edge_type, edge_attr.layout))
        return None if found is None else found[0]

    def _remove_edge_index(self, edge_attr: EdgeAttr) -> bool:
        return self._edges.pop((edge_attr.edge_type, edge_attr.layout), None) is not None

    def get_all_edge_attrs(self) -> list:
        return [attr for _, attr in self._edges.values()]

    def put_csr(self, indptr, indices, edge_type, num_nodes: int) -> None:
        """Store a graph given as incoming-neighbour CSR (``indices[indptr[v]:indptr[v+1]]`` are
        the sources of v's edges): PyG's CSC layout of (source -> target) edges."""
        colptr = torch.as_tensor(np.asarray(indptr, dtype=np.int64))
        row = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        self.put_edge_index(
            (row, colptr), edge_type=edge_type, layout="csc", size=(num_nodes, num_nodes), is_sorted=True
        )


class FastloadNeighborSampler(BaseSampler):
    """A PyG ``BaseSampler`` (``NodeLoader(..., node_sampler=...)``) over torch_fastload's C++
    uniform neighbour sampler: PyG's loaders where pyg-lib and torch-sparse are missing.

    Homogeneous graphs, seeds unique within a mini-batch (PyG's shuffled ``input_nodes``). Mini-batch
    ``k`` of this sampler draws from ``batch_key(seed, k)``: reproducible in one process."""

    def __init__(self, graph: CSRGraph, num_neighbors, *, seed: int = 0, num_threads: int | None = None):
        self.graph = graph
        self.num_neighbors = [int(f) for f in num_neighbors]
        self.seed = int(seed)
        self.num_threads = num_threads
        self._calls = 0

    @classmethod
    def from_graph_store(cls, graph_store: GraphStore, edge_type, num_neighbors, **kwargs) -> FastloadNeighborSampler:
        """The sampler over ``edge_type``'s CSC edges (``CSRGraphStore.put_csr``'s layout)."""
        row, colptr = graph_store.get_edge_index(edge_type, "csc")
        return cls(CSRGraph(colptr.numpy(), row.numpy()), num_neighbors, **kwargs)

    def sample_from_nodes(self, index: NodeSamplerInput, **kwargs) -> SamplerOutput:
        seeds = index.node.numpy() if isinstance(index.node, torch.Tensor) else np.asarray(index.node)
        if len(np.unique(seeds)) != len(seeds):
            raise ValueError(
                "FastloadNeighborSampler takes unique seeds in a mini-batch (the seeds are the "
                "first nodes of the sampled subgraph)"
            )
        key = batch_key(self.seed, self._calls)
        self._calls += 1
        n_id, edge_index = sample_neighbors(
            self.graph, seeds, self.num_neighbors, key=key, num_threads=self.num_threads
        )
        nodes, edges = _per_hop(len(seeds), n_id, edge_index, len(self.num_neighbors))
        return SamplerOutput(
            node=torch.from_numpy(n_id),
            row=torch.from_numpy(edge_index[0]),
            col=torch.from_numpy(edge_index[1]),
            edge=None,
            num_sampled_nodes=nodes,
            num_sampled_edges=edges,
            metadata=(index.input_id, index.time),
        )

    def sample_from_edges(self, index, neg_sampling=None):
        raise NotImplementedError("FastloadNeighborSampler samples from nodes only (NodeLoader)")

    @property
    def edge_permutation(self):
        return None


def _per_hop(num_seeds: int, n_id: np.ndarray, edge_index: np.ndarray, hops: int) -> tuple[list, list]:
    """PyG's ``num_sampled_nodes`` / ``num_sampled_edges``: the sampler lists each hop's new nodes
    and edges after the previous hop's, and a hop's targets are the previous hop's new nodes."""
    nodes, edges = [num_seeds], []
    first_new, edge_at = num_seeds, 0
    targets = edge_index[1]
    for _ in range(hops):
        later = np.flatnonzero(targets[edge_at:] >= first_new)  # the next hop's edges target newer nodes
        end = edge_at + int(later[0]) if len(later) else len(targets)
        hop_sources = edge_index[0, edge_at:end]
        new = max(int(hop_sources.max()) + 1 - first_new, 0) if end > edge_at else 0
        edges.append(end - edge_at)
        nodes.append(new)
        first_new, edge_at = first_new + new, end
    if first_new != len(n_id) or edge_at != edge_index.shape[1]:
        raise AssertionError("sampled nodes or edges are not in hop order")
    return nodes, edges
