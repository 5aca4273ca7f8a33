"""PyG's NeighborLoader over torch_fastload's FeatureStore (gnn.pyg adapter), on the GPU machine.

    python benchmarks/probes/probe_pyg_neighborloader.py --root /tmp/graph --nodes 2000000 --dim 128

Checks that the x PyG assembles through FastloadFeatureStore equals the file's rows, and times
mini-batches/s three ways over the same graph and seed nodes: PyG NeighborLoader + fastload
features (storage tier / uva tier), the built-in NeighborBatches (fastload sampler + gather),
and the baseline (built-in sampler, np.memmap rows copied to the GPU). Needs pyg-lib or
torch-sparse for PyG's sampler; reports what is installed either way. Writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torch_fastload.gnn import CSRGraph, NeighborBatches, make_graph  # noqa: E402
from torch_fastload.sources import FeatureStore  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_batches(iterable, batches: int, check=None) -> dict:
    it = iter(iterable)
    next(it)  # warm-up (sampler threads, first gather)
    sync()
    started = time.perf_counter()
    nodes = 0
    for _ in range(batches):
        batch = next(it)
        nodes += int(batch[0])
        if check is not None:
            check(batch)
    sync()
    seconds = time.perf_counter() - started
    return {
        "batches_per_s": batches / seconds,
        "ms_per_batch": 1000 * seconds / batches,
        "sampled_nodes_per_batch": nodes / batches,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/fastload-pyg-graph")
    p.add_argument("--nodes", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args()
    fanouts = [int(f) for f in args.fanouts.split(",")]
    import torch_geometric
    import torch_geometric.typing as pyg_typing

    result = {
        "torch_geometric": torch_geometric.__version__,
        "pyg_lib": bool(pyg_typing.WITH_PYG_LIB),
        "torch_sparse": bool(pyg_typing.WITH_TORCH_SPARSE),
        "nodes": args.nodes,
        "dim": args.dim,
        "batch_size": args.batch_size,
        "fanouts": fanouts,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    started = time.perf_counter()
    graph_info = make_graph(args.root, nodes=args.nodes, dim=args.dim, progress=False)
    result["generate_s"] = time.perf_counter() - started
    features_path = graph_info["paths"]["features"]
    memmap = np.load(features_path, mmap_mode="r")
    labels = torch.from_numpy(np.load(graph_info["paths"]["labels"]))
    graph = CSRGraph(graph_info["indptr"], graph_info["indices"])
    seeds = np.random.default_rng(0).permutation(args.nodes)[: args.batch_size * (args.batches + 2)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def check_rows(x, n_id):
        want = torch.from_numpy(memmap[n_id.cpu().numpy()]).to(device)
        assert torch.equal(x, want), "x differs from the file's rows"

    runs = {}
    tiers = (("storage", {}), ("uva", {"pin": True})) if device.type == "cuda" else (("storage", {}),)
    for tier, kw in tiers:
        store = FeatureStore(features_path, device=device, **kw)
        batches = NeighborBatches(graph, seeds, fanouts, store, labels, batch_size=args.batch_size, prefetch=2)
        checked = []

        def check(b, checked=checked):
            if not checked:
                check_rows(b.x, b.n_id)
                checked.append(1)

        runs[f"builtin_{tier}"] = timed_batches(
            ((len(b.n_id), b) for b in batches), args.batches, lambda pair: check(pair[1])
        )
    baseline_gather = type(
        "Mmap", (), {"device": device, "gather": lambda self, ids: torch.from_numpy(memmap[np.asarray(ids)]).to(device)}
    )()
    batches = NeighborBatches(graph, seeds, fanouts, baseline_gather, labels, batch_size=args.batch_size, prefetch=0)
    runs["baseline_mmap"] = timed_batches(((len(b.n_id), b) for b in batches), args.batches)
    sampler_only = NeighborBatches(graph, seeds, fanouts, None, None, batch_size=args.batch_size, prefetch=0)
    runs["builtin_sampler_only"] = timed_batches(((len(b.n_id), b) for b in sampler_only), args.batches)

    if pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE:
        from torch_geometric.loader import NeighborLoader

        from torch_fastload.gnn.pyg import CSRGraphStore, FastloadFeatureStore

        for tier, kw in tiers:
            feature_store = FastloadFeatureStore()
            feature_store["node", "x", None] = FeatureStore(features_path, device=device, **kw)
            feature_store["node", "y", None] = labels
            graph_store = CSRGraphStore()
            graph_store.put_csr(graph_info["indptr"], graph_info["indices"], ("node", "to", "node"), args.nodes)
            loader = NeighborLoader(
                (feature_store, graph_store),
                num_neighbors=fanouts,
                input_nodes=("node", torch.from_numpy(seeds)),
                batch_size=args.batch_size,
                num_workers=0,
            )
            first = []

            def check_pyg(pair, first=first):
                batch = pair[1]
                if not first:
                    check_rows(batch["node"].x, batch["node"].n_id)
                    first.append(1)

            runs[f"pyg_{tier}"] = timed_batches(((b["node"].num_nodes, b) for b in loader), args.batches, check_pyg)
    else:
        runs["pyg"] = "skipped: neither pyg-lib nor torch-sparse is installed"
    result["runs"] = runs
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
