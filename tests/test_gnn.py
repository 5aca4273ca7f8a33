"""GNN mini-batches: the neighbour sampler, prefetched batches, the generated graph, the example."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_fastload.gnn import CSRGraph, NeighborBatches, make_graph, sample_neighbors, sample_neighbors_numpy
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
    edges = {(int(v), int(u)) for v in range(g.num_nodes) for u in g.indices[g.indptr[v] : g.indptr[v + 1]]}
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
        assert u in g.indices[g.indptr[v] : g.indptr[v + 1]]
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
        seen.append(batch.n_id[: batch.batch_size].numpy())
        assert torch.equal(batch.x.cpu(), torch.from_numpy(features[batch.n_id.numpy()]))
        assert torch.equal(batch.y.cpu(), torch.from_numpy(labels[batch.n_id[: batch.batch_size].numpy()]))
        assert batch.edge_index.max() < len(batch.n_id)
    assert np.array_equal(np.sort(np.concatenate(seen)), seeds)
    assert store.stats().cache_hits > 0


def test_prefetch_does_not_change_the_batches(graph_dir):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    store = FeatureStore(graph_dir["paths"]["features"], device="cpu")

    def run(prefetch):
        return [
            (b.n_id, b.edge_index)
            for b in NeighborBatches(g, np.arange(1000), [3, 3], store, batch_size=100, prefetch=prefetch, seed=4)
        ]

    for (a_ids, a_edges), (b_ids, b_edges) in zip(run(0), run(3), strict=True):
        assert torch.equal(a_ids, b_ids) and torch.equal(a_edges, b_edges)


def test_gnn_example_learns_on_the_cpu(tmp_path):
    out = tmp_path / "gnn.json"
    cmd = [
        sys.executable,
        str(REPO / "examples" / "gnn_sage.py"),
        "--root",
        str(tmp_path / "g"),
        "--nodes",
        "20000",
        "--dim",
        "32",
        "--epochs",
        "2",
        "--batch-size",
        "256",
        "--max-steps",
        "20",
        "--no-progress",
        "--json",
        str(out),
    ]
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

    loader = NeighborLoader(
        (store, graph), num_neighbors=[5, 5], input_nodes=("node", torch.arange(100)), batch_size=50
    )
    batch = next(iter(loader))
    assert torch.equal(batch["node"].x, torch.from_numpy(features[batch["node"].n_id.numpy()]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_pyg_node_loader_runs_on_the_fastload_sampler(graph_dir, device):
    """PyG's NodeLoader over (FastloadFeatureStore, CSRGraphStore) with FastloadNeighborSampler:
    PyG's own loader end to end where pyg-lib and torch-sparse are missing (here, and on the GPU
    machines). Real edges, seeds first, x gathered through the FeatureStore, hop counts right."""
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.loader import NodeLoader

    from torch_fastload.gnn.pyg import CSRGraphStore, FastloadFeatureStore, FastloadNeighborSampler

    features = np.load(graph_dir["paths"]["features"])
    fs = FastloadFeatureStore()
    fs["node", "x", None] = FeatureStore(
        graph_dir["paths"]["features"], device=device, pin=device == "cuda", cache_ids=np.arange(0, 3000, 5)
    )
    fs["node", "y", None] = torch.from_numpy(graph_dir["labels"])
    gs = CSRGraphStore()
    edge_type = ("node", "to", "node")
    gs.put_csr(graph_dir["indptr"], graph_dir["indices"], edge_type, 3000)
    sampler = FastloadNeighborSampler.from_graph_store(gs, edge_type, [5, 3])
    seeds = torch.randperm(3000, generator=torch.Generator().manual_seed(0))[:200]
    loader = NodeLoader((fs, gs), node_sampler=sampler, input_nodes=("node", seeds), batch_size=64)
    indptr, indices = graph_dir["indptr"], graph_dir["indices"]
    seen = []
    for batch in loader:
        data = batch["node"] if isinstance(batch, pyg.data.HeteroData) else batch
        n_id = data.n_id.numpy()
        assert data.x.device.type == device and torch.equal(data.x.cpu(), torch.from_numpy(features[n_id]))
        assert torch.equal(data.y, torch.from_numpy(graph_dir["labels"][n_id]))
        size = data.batch_size
        seen.extend(n_id[:size].tolist())
        src, dst = n_id[data.edge_index[0].numpy()], n_id[data.edge_index[1].numpy()]
        for s_, d_ in zip(src[:300], dst[:300]):
            assert s_ in indices[indptr[d_] : indptr[d_ + 1]]
        assert sum(data.num_sampled_nodes) == len(n_id) and data.num_sampled_nodes[0] == size
        assert sum(data.num_sampled_edges) == data.edge_index.shape[1]
    assert seen == seeds.tolist()


# -- the C++ sampler (csrc/sampler.cpp) and its numpy reference -----------------------------------


def random_csr(n=600, max_degree=30, seed=0, dtype=np.int64) -> CSRGraph:
    """Random in-neighbour lists (repeats allowed), about 10% of the nodes without any."""
    rng = np.random.default_rng(seed)
    deg = rng.integers(1, max_degree, n)
    deg[rng.random(n) < 0.1] = 0
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    return CSRGraph(indptr, rng.integers(0, n, int(indptr[-1])).astype(dtype))


def check_sample(g: CSRGraph, seeds, fanouts, n_id, edge_index):
    """Every property sample_neighbors promises, hop by hop."""
    seeds = np.asarray(seeds, dtype=np.int64)
    assert n_id.dtype == np.int64 and edge_index.dtype == np.int64 and edge_index.shape == (2, edge_index.shape[1])
    assert np.array_equal(n_id[: len(seeds)], seeds) and len(np.unique(n_id)) == len(n_id)
    src, dst = edge_index
    assert ((0 <= edge_index) & (edge_index < len(n_id))).all()
    assert len({(a, b) for a, b in zip(src.tolist(), dst.tolist())}) == len(src)  # duplicates merged
    for u, v in zip(n_id[src].tolist(), n_id[dst].tolist()):  # u is an in-neighbour of v
        assert u in g.indices[g.indptr[v] : g.indptr[v + 1]]
    degree = g.degree()
    lo, hi, covered = 0, len(seeds), 0
    for fanout in fanouts:  # the frontier is [lo, hi): the seeds, then the previous hop's new nodes
        mine = (lo <= dst) & (dst < hi)
        covered += mine.sum()
        per_target = np.bincount(dst[mine] - lo, minlength=hi - lo)
        deg = degree[n_id[lo:hi]]
        assert (per_target <= np.minimum(fanout, deg)).all()
        assert ((per_target > 0) == ((deg > 0) & (fanout > 0))).all()  # a node with neighbours gets some
        reached = np.unique(src[mine])
        new = reached[reached >= hi]
        assert np.array_equal(new, np.arange(hi, hi + len(new)))  # new nodes follow, nothing skipped
        lo, hi = hi, hi + len(new)
    assert covered == len(src) and hi == len(n_id)  # every edge in a hop, the last hop's new nodes end n_id


@pytest.mark.parametrize("backend", ["native", "numpy"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sampler_properties_on_a_random_graph(backend, dtype):
    g = random_csr(dtype=dtype)
    rng = np.random.default_rng(1)
    for trial, fanouts in enumerate([[5, 4], [25, 3, 2], [1], [0, 3], [3, 0, 2], []]):
        seeds = rng.choice(g.num_nodes, 40, replace=False)
        if backend == "native":
            n_id, edge_index = sample_neighbors(g, seeds, fanouts, key=trial, num_threads=2)
        else:
            n_id, edge_index = sample_neighbors_numpy(g, seeds, fanouts, np.random.default_rng(trial))
        check_sample(g, seeds, fanouts, n_id, edge_index)
        if fanouts and fanouts[0] == 0:
            assert np.array_equal(n_id, seeds) and edge_index.shape == (2, 0)


def test_native_sampler_is_used_and_deterministic_whatever_the_threads(graph_dir):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    assert g.native_sampler() is not None, "torch_fastload._C lacks NeighborSampler: rebuild the extension"
    seeds = np.random.default_rng(0).choice(g.num_nodes, 500, replace=False)
    ref = sample_neighbors(g, seeds, [10, 5, 3], key=12345, num_threads=1)
    check_sample(g, seeds, [10, 5, 3], *ref)
    for threads in (2, 3, 8, None):
        got = sample_neighbors(g, seeds, [10, 5, 3], key=12345, num_threads=threads)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1]), threads
    other = sample_neighbors(g, seeds, [10, 5, 3], key=12346)
    assert not (len(other[0]) == len(ref[0]) and np.array_equal(other[0], ref[0]))
    # a Generator gives a key (one draw): equal Generators, equal samples
    a = sample_neighbors(g, seeds, [4], np.random.default_rng(7))
    b = sample_neighbors(g, seeds, [4], np.random.default_rng(7))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    wrapped, plain = sample_neighbors(g, seeds, [4], key=2**64 + 5), sample_neighbors(g, seeds, [4], key=5)
    assert np.array_equal(wrapped[1], plain[1])  # keys are taken modulo 2**64


def test_native_sampler_gives_the_same_samples_from_concurrent_python_threads():
    g = random_csr(n=5000, seed=3)
    cases = [(np.random.default_rng(k).choice(g.num_nodes, 200, replace=False), k) for k in range(8)]
    expected = [sample_neighbors(g, s, [6, 4], key=k, num_threads=1) for s, k in cases]
    failures = []

    def work(threads):
        for _ in range(5):
            for (s, k), (n_id, edge_index) in zip(cases, expected):
                got = sample_neighbors(g, s, [6, 4], key=k, num_threads=threads)
                if not (np.array_equal(got[0], n_id) and np.array_equal(got[1], edge_index)):
                    failures.append((threads, k))

    pool = [threading.Thread(target=work, args=(t,)) for t in (1, 2, 3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not failures


def test_int32_and_int64_indices_sample_alike():
    g64 = random_csr(dtype=np.int64, seed=5)
    g32 = CSRGraph(g64.indptr, g64.indices.astype(np.int32))
    seeds = np.arange(0, 600, 7)
    a, b = (sample_neighbors(g, seeds, [8, 4], key=99) for g in (g64, g32))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    g16 = CSRGraph(g64.indptr, g64.indices.astype(np.int16))  # widened once for the sampler
    c = sample_neighbors(g16, seeds, [8, 4], key=99)
    assert np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1])


def test_native_draws_are_uniform():
    # nodes 0..999 each have in-neighbours 1000..1009; 1010 is a node of degree 0
    indptr = np.concatenate([np.arange(0, 10001, 10), np.full(11, 10000)])
    g = CSRGraph(indptr, np.tile(np.arange(1000, 1010), 1000))
    expected = np.full(10, 2000.0)
    # one node, fanout 1, over 20,000 keys
    counts = np.zeros(10)
    for key in range(20000):
        n_id, edge_index = sample_neighbors(g, [3], [1], key=key, num_threads=1)
        counts[n_id[edge_index[0]] - 1000] += 1
    assert (np.abs(counts - expected) < 0.1 * expected).all() and ((counts - expected) ** 2 / expected).sum() < 40
    # 1,000 nodes of one call, over 20 keys: positions in the frontier draw independently
    counts = np.zeros(10)
    for key in range(20):
        n_id, edge_index = sample_neighbors(g, np.arange(1000), [1], key=key)
        counts += np.bincount(n_id[edge_index[0]] - 1000, minlength=10)
    assert (np.abs(counts - expected) < 0.1 * expected).all() and ((counts - expected) ** 2 / expected).sum() < 40
    # fanouts above the degree: each neighbour once after merging (100 draws: the path for > 32)
    for fanout in (30, 100):
        n_id, edge_index = sample_neighbors(g, [0, 1010], [fanout], key=3)
        assert set(n_id[2:].tolist()) <= set(range(1000, 1010)) and (edge_index[1] == 0).all()
        assert np.array_equal(np.sort(edge_index[0]), np.arange(2, len(n_id)))
    assert len(n_id) == 12  # all 10 drawn in 100 draws (key 3; a miss has probability 3e-4 per key)


def test_sampler_edge_cases_and_bad_input():
    g = random_csr()
    lonely = np.flatnonzero(g.degree() == 0)[:5]
    n_id, edge_index = sample_neighbors(g, lonely, [5, 5], key=1)
    assert np.array_equal(n_id, lonely) and edge_index.shape == (2, 0)
    for seeds in ([], np.zeros(0, dtype=np.int64)):
        n_id, edge_index = sample_neighbors(g, seeds, [5, 5], key=1)
        assert n_id.shape == (0,) and edge_index.shape == (2, 0) and n_id.dtype == edge_index.dtype == np.int64
    for sample in (
        lambda s, f: sample_neighbors(g, s, f, key=1),
        lambda s, f: sample_neighbors_numpy(g, s, f, np.random.default_rng(0)),
    ):
        with pytest.raises(ValueError, match=r"2 seed\(s\) outside \[0, 600\): -1, 600"):
            sample(np.array([3, -1, 600]), [2])
        with pytest.raises(ValueError, match="fanouts"):
            sample([3], [2, -1])
    with pytest.raises(ValueError, match="num_threads"):
        sample_neighbors(g, [3], [2], key=1, num_threads=0)


def test_a_corrupted_graph_is_an_error_not_a_bad_read():
    g = random_csr()
    v = int(np.flatnonzero(g.degree() > 0)[0])
    g.native_sampler()
    g.indices[g.indptr[v] : g.indptr[v + 1]] = 10**6  # after the CSRGraph checks: the sampler reads in place
    with pytest.raises(ValueError, match=f"outside \\[0, 600\\) for node {v}"):
        sample_neighbors(g, [v], [3], key=1)


def test_without_the_extension_numpy_samples_from_the_key(monkeypatch):
    from torch_fastload.gnn import sampler as module

    monkeypatch.setattr(module, "_C", None)
    g = random_csr()
    assert g.native_sampler() is None
    seeds = np.arange(0, 600, 11)
    a = sample_neighbors(g, seeds, [4, 3], key=8)
    check_sample(g, seeds, [4, 3], *a)
    b = sample_neighbors_numpy(g, seeds, [4, 3], np.random.default_rng(8))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_batches_do_not_depend_on_prefetch_or_sampler_threads(graph_dir):
    g = CSRGraph(graph_dir["indptr"], graph_dir["indices"])
    assert g.native_sampler() is not None

    def run(prefetch, threads):
        nb = NeighborBatches(
            g, np.arange(0, 3000, 2), [5, 3], batch_size=128, prefetch=prefetch, seed=3, sampler_threads=threads
        )
        nb.set_epoch(2)
        return [(b.n_id, b.edge_index, b.batch_size) for b in nb]

    reference = run(0, 1)
    assert len(reference) == 12
    for n_id, edge_index, size in reference:
        check_sample(g, n_id[:size].numpy(), [5, 3], n_id.numpy(), edge_index.numpy())
    for prefetch, threads in ((2, 2), (2, None), (0, 3)):
        for (a_ids, a_edges, _), (b_ids, b_edges, _) in zip(reference, run(prefetch, threads), strict=True):
            assert torch.equal(a_ids, b_ids) and torch.equal(a_edges, b_edges)
    with pytest.raises(ValueError, match="sampler_threads"):
        NeighborBatches(g, np.arange(10), [2], sampler_threads=0)


def test_sampler_memory_follows_degree_not_fanout():
    """A fanout far above every degree: each node keeps at most its degree in distinct picks, so
    the per-slot scratch is min(fanout, max degree) per frontier node, and the draws of a node
    are merged as they are made (memory of its degree), not stored (issue 18)."""
    g = random_csr(n=600, max_degree=12, seed=7)
    sampler = g.native_sampler()
    if sampler is None:
        pytest.skip("the C++ extension is not built")
    assert sampler.max_degree == int(g.degree().max()) <= 12
    seeds = np.arange(0, 600, 3)
    huge = 1_000_000_000  # draws stop once every neighbour position was drawn: ~d ln d, not 10**9
    n_id, edge_index = sample_neighbors(g, seeds, [huge, 2], key=5, num_threads=2)
    check_sample(g, seeds, [huge, 2], n_id, edge_index)
    frontier = len(n_id)  # every hop's frontier is at most all the sampled nodes
    bound = 3 * frontier * sampler.max_degree * 8  # node, winner and local: int64 per slot
    assert 0 < sampler.scratch_slot_bytes() <= bound  # fanout-sized slots: 200 x 10**9 x 24 bytes
    again = sample_neighbors(g, seeds, [huge, 2], key=5, num_threads=1)
    assert np.array_equal(again[0], n_id) and np.array_equal(again[1], edge_index)


def _mix64(z):
    mask = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _documented_picks(g, v, fanout, key):
    """csrc/sampler.cpp's draws for seed v (frontier position 0, hop 0), in Python: fanout
    draws with replacement, the distinct neighbours in the order of their first draw."""
    golden, step, mask = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, (1 << 64) - 1
    stream = _mix64((_mix64(key ^ _mix64(golden)) + golden) & mask)
    lo, degree = int(g.indptr[v]), int(g.indptr[v + 1] - g.indptr[v])
    picks = []
    for j in range(fanout):
        r = _mix64((stream + step * (j + 1)) & mask)
        neighbour = int(g.indices[lo + ((r * degree) >> 64)])
        if neighbour not in picks:
            picks.append(neighbour)
    return picks


@pytest.mark.parametrize("fanout", [5, 32, 33, 100, 3000])
def test_native_picks_are_the_documented_draws(fanout):
    """Small fanouts (merged from stored draws) and large ones (merged as drawn) alike."""
    g = random_csr(n=300, max_degree=40, seed=11)
    g.indices[g.indptr[7] : g.indptr[7] + 5] = 3  # repeated edges: one neighbour at several positions
    if g.native_sampler() is None:
        pytest.skip("the C++ extension is not built")
    for v in range(0, 300, 13):
        if g.indptr[v + 1] == g.indptr[v]:
            continue
        n_id, edge_index = sample_neighbors(g, [v], [fanout], key=1000 + v, num_threads=1)
        assert n_id[edge_index[0]].tolist() == _documented_picks(g, v, fanout, 1000 + v), v
