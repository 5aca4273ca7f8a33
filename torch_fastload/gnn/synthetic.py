"""A power-law graph with communities, community-correlated features on disk, and labels.

Degrees follow a Pareto law (a few hubs, many leaves); 80% of a node's edges stay inside its
community. Features are the community's centroid plus noise larger than the centroid, so a
node's own features say little and its neighbourhood says more: GraphSAGE beats an MLP on it,
and accuracy means something. Labels are the community, 10% of them flipped at random.
The feature matrix is written to ``root/features.npy`` in chunks (never held in RAM whole);
the CSR structure (``indptr.npy``, ``indices.npy``) and ``labels.npy`` sit beside it.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

__all__ = ["make_graph", "PRESETS"]

PRESETS = {
    "small": dict(nodes=100_000, dim=64),
    "medium": dict(nodes=2_000_000, dim=128),
    "large": dict(nodes=20_000_000, dim=128),
}


def make_graph(
    root: str,
    nodes: int = 100_000,
    dim: int = 64,
    *,
    communities: int = 32,
    avg_degree: int = 10,
    p_in: float = 0.8,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Write (or reuse) the graph under ``root``; returns its paths and the CSR arrays."""
    os.makedirs(root, exist_ok=True)
    stamp = dict(nodes=nodes, dim=dim, communities=communities, avg_degree=avg_degree, p_in=p_in, seed=seed)
    meta_path = os.path.join(root, "meta.json")
    paths = {k: os.path.join(root, f"{k}.npy") for k in ("indptr", "indices", "labels", "features", "community")}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            if json.load(f) == stamp:
                return {"paths": paths, **{k: np.load(paths[k]) for k in ("indptr", "indices", "labels")}}
    rng = np.random.default_rng(seed)
    community = rng.integers(0, communities, nodes)
    weight = rng.pareto(1.5, nodes) + 1.0
    edges = nodes * avg_degree // 2
    src = np.searchsorted(np.cumsum(weight) / weight.sum(), rng.random(edges))
    src = np.minimum(src, nodes - 1)
    # targets: inside the source's community with probability p_in, by weight
    order = np.argsort(community, kind="stable")
    cum = np.cumsum(weight[order])
    bounds = np.searchsorted(community[order], np.arange(communities + 1))
    base = np.concatenate(([0.0], cum))[bounds]
    c = community[src]
    inside = rng.random(edges) < p_in
    r = rng.random(edges)
    local = np.searchsorted(cum, base[c] + r * (base[c + 1] - base[c]))
    anywhere = np.searchsorted(cum, r * cum[-1])
    dst = order[np.minimum(np.where(inside, local, anywhere), nodes - 1)]
    keep = src != dst
    a = np.concatenate([src[keep], dst[keep]])
    b = np.concatenate([dst[keep], src[keep]])
    by_target = np.argsort(b, kind="stable")
    indices = a[by_target].astype(np.int32 if nodes < 2**31 else np.int64)
    indptr = np.zeros(nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(b, minlength=nodes), out=indptr[1:])
    labels = np.where(rng.random(nodes) < 0.1, rng.integers(0, communities, nodes), community).astype(np.int64)
    centroids = rng.standard_normal((communities, dim)).astype(np.float32)
    features = np.lib.format.open_memmap(paths["features"], mode="w+", dtype=np.float32, shape=(nodes, dim))
    chunk = max(1, (64 << 20) // (4 * dim))
    bar = _bar(nodes, f"writing {paths['features']}", progress)
    for start in range(0, nodes, chunk):
        end = min(nodes, start + chunk)
        noise = rng.standard_normal((end - start, dim), dtype=np.float32) * 2.0
        features[start:end] = centroids[community[start:end]] + noise
        if bar is not None:
            bar.update(end - start)
    if bar is not None:
        bar.close()
    features.flush()
    del features
    for key, value in (("indptr", indptr), ("indices", indices), ("labels", labels), ("community", community)):
        np.save(paths[key], value)
    with open(meta_path, "w") as f:
        json.dump(stamp, f)
    return {"paths": paths, "indptr": indptr, "indices": indices, "labels": labels}


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="node", unit_scale=True, file=sys.stderr, mininterval=0.5)
