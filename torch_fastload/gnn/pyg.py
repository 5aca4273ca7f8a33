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
PyG's NeighborLoader needs pyg-lib or torch-sparse for its sampler; without them
``torch_fastload.gnn.NeighborBatches`` samples over the same CSR.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch_geometric.data import EdgeAttr, GraphStore, TensorAttr
from torch_geometric.data import FeatureStore as PyGFeatureStore

from ..sources.features import FeatureStore

__all__ = ["FastloadFeatureStore", "CSRGraphStore"]


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

    def _get_tensor(self, attr: TensorAttr) -> Optional[torch.Tensor]:
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
        self.put_edge_index((row, colptr), edge_type=edge_type, layout="csc", size=(num_nodes, num_nodes),
                            is_sorted=True)
