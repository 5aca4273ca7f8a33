"""GNN mini-batches: a uniform neighbour sampler over CSR, a synthetic graph generator, and
mini-batch iteration whose node-feature gathers (``sources.FeatureStore``) are prefetched."""

from .sampler import CSRGraph, NeighborBatches, SampledBatch, batch_key, sample_neighbors, sample_neighbors_numpy
from .synthetic import make_graph

__all__ = [
    "CSRGraph",
    "NeighborBatches",
    "SampledBatch",
    "batch_key",
    "sample_neighbors",
    "sample_neighbors_numpy",
    "make_graph",
]
