"""GNN mini-batches: the neighbour sampler, prefetched batches, the generated graph, the example."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_fastload.gnn import CSRGraph, NeighborBatches, make_graph, sample_neighbors
from torch_fastload.sources import FeatureStore

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph")
    return make_graph(str(root), nodes=3000, dim=16, communities=4, progress=False)


def test_generated_graph_is_a_valid_symmetric_power_law_csr(graph_dir):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    deg = g.degree()
    assert deg.max() > 10 * deg.mean()  # hubs: a heavy tail
    edges = {(int(v), int(u)) for v in range(g.num_nodes) for u in g.indices[g.indptr[v]:g.indptr[v + 1]]}
    assert all((u, v) in edges for v, u in list(edges)[:2000])  # undirected
    community = np.load(graph_dir["paths"]["community"])
    src = np.repeat(np.arange(g.num_nodes), deg)
    assert (community[src] == community[g.indices]).mean() > 0.7  # communities hold most edges
    features = np.load(graph_dir["paths"]["features"], mmap_mode="r")
    assert features.shape == (3000, 16) and features.dtype == np.float32


def test_sampler_returns_real_edges_with_seeds_first(graph_dir):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    seeds = np.array([5, 17, 2999, 0])
    n_id, edge_index = sample_neighbors(g, seeds, [4, 3], np.random.default_rng(0))
    assert np.array_equal(n_id[:4], seeds) and len(np.unique(n_id)) == len(n_id)
    src, dst = n_id[edge_index[0]], n_id[edge_index[1]]
    for u, v in zip(src.tolist(), dst.tolist()):  # every sampled edge exists: u is a neighbour of v
        assert u in g.indices[g.indptr[v]:g.indptr[v + 1]]
    first_hop = edge_index[1] < 4
    assert np.bincount(edge_index[1][first_hop], minlength=4).max() <= 4  # at most fanout per seed


def test_csr_graph_refuses_bad_structure():
    with pytest.raises(ValueError, match="indptr"):
        CSRGraph(np.array([0, 2, 1]), np.array([0]))
    with pytest.raises(ValueError, match="neighbour ids"):
        CSRGraph(np.array([0, 1, 2]), np.array([0, 5]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_batches_cover_every_seed_once_with_features_and_labels(graph_dir, device):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    features = np.load(graph_dir["paths"]["features"])
    store = FeatureStore(graph_dir["paths"]["features"], device=device, cache_ids=np.argsort(-g.degree())[:100])
    labels = graph_dir["labels"]
    seeds = np.arange(0, 3000, 3)
    batches = NeighborBatches(g, seeds, [5, 5], store, labels, batch_size=128, prefetch=2)
    seen = []
    for batch in batches:
        seen.append(batch.n_id[:batch.batch_size].numpy())
        assert torch.equal(batch.x.cpu(), torch.from_numpy(features[batch.n_id.numpy()]))
        assert torch.equal(batch.y.cpu(), torch.from_numpy(labels[batch.n_id[:batch.batch_size].numpy()]))
        assert batch.edge_index.max() < len(batch.n_id)
    assert np.array_equal(np.sort(np.concatenate(seen)), seeds)
    assert store.stats().cache_hits > 0


def test_prefetch_does_not_change_the_batches(graph_dir):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    store = FeatureStore(graph_dir["paths"]["features"], device="cpu")

    def run(prefetch):
        return [(b.n_id, b.edge_index) for b in NeighborBatches(g, np.arange(1000), [3, 3], store, batch_size=100,
                                                                prefetch=prefetch, seed=4)]

    for (a_ids, a_edges), (b_ids, b_edges) in zip(run(0), run(3), strict=True):
        assert torch.equal(a_ids, b_ids) and torch.equal(a_edges, b_edges)


def test_gnn_example_learns_on_the_cpu(tmp_path):
    out = tmp_path / "gnn.json"
    cmd = [sys.executable, str(REPO / "examples" / "gnn_sage.py"), "--root", str(tmp_path / "g"), "--nodes", "20000",
           "--dim", "32", "--epochs", "2", "--batch-size", "256", "--max-steps", "20", "--no-progress",
           "--json", str(out)]
    res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["test"]["accuracy"] > 0.5  # 32 communities: chance is ~3%
    assert result["store_stats"]["cache_hits"] > 0


def test_pyg_feature_store_serves_gathers(graph_dir):
    pyg = pytest.importorskip("torch_geometric")
    from torch_fastload.gnn.pyg import CSRGraphStore, FastloadFeatureStore

    features = np.load(graph_dir["paths"]["features"])
    store = FastloadFeatureStore()
    store["node", "x", None] = FeatureStore(graph_dir["paths"]["features"], device="cpu")
    store["node", "y", None] = torch.from_numpy(graph_dir["labels"])
    index = torch.tensor([7, 3, 2999, 7])
    assert torch.equal(store["node", "x", index], torch.from_numpy(features[index.numpy()]))
    assert torch.equal(store["node", "y", index], torch.from_numpy(graph_dir["labels"][index.numpy()]))
    out = store.multi_get_tensor([pyg.data.TensorAttr("node", "x", index), pyg.data.TensorAttr("node", "y", index)])
    assert torch.equal(out[0], torch.from_numpy(features[index.numpy()]))
    assert store.get_tensor_size("node", "x") == (3000, 16)
    assert {(a.group_name, a.attr_name) for a in store.get_all_tensor_attrs()} == {("node", "x"), ("node", "y")}
    graph = CSRGraphStore()
    graph.put_csr(graph_dir["indptr"], graph_dir["indices"], ("node", "to", "node"), 3000)
    row, colptr = graph.get_edge_index(("node", "to", "node"), "csc")
    assert torch.equal(colptr, torch.from_numpy(graph_dir["indptr"])) and len(row) == len(graph_dir["indices"])
    if not (pyg.typing.WITH_PYG_LIB or pyg.typing.WITH_TORCH_SPARSE):
        return  # PyG's NeighborLoader needs pyg-lib or torch-sparse for its sampler
    from torch_geometric.loader import NeighborLoader

    loader = NeighborLoader((store, graph), num_neighbors=[5, 5], input_nodes=("node", torch.arange(100)),
                            batch_size=50)
    batch = next(iter(loader))
    assert torch.equal(batch["node"].x, torch.from_numpy(features[batch["node"].n_id.numpy()]))
