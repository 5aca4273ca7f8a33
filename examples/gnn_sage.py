"""GraphSAGE node classification with node features on storage, fed by torch_fastload.

    python examples/gnn_sage.py                            # small preset: 100k nodes x 64 features
    python examples/gnn_sage.py --preset large             # 20M nodes x 128 features (10 GB on disk)
    python examples/gnn_sage.py --loader baseline          # features by np.load(mmap_mode='r')[ids].cuda()

The graph is generated once under --root (torch_fastload.gnn.make_graph): a power-law graph
whose communities decide the labels, with features that are the community's centroid plus
more noise than signal. The features are written to disk and never loaded whole. Each
mini-batch samples a 2-hop neighbourhood (--fanouts, uniform, built-in sampler over CSR).

--loader fastload: the FeatureStore gathers x (GPU cache of the highest-degree nodes,
--cache-fraction; --pin for zero-copy gathers from host memory; storage reads by the C++
engine otherwise, --o-direct for data larger than RAM), the next --prefetch mini-batches
sampled and gathered on a background thread. --loader baseline: the same sampler, x gathered
by numpy from a memmap and copied to the GPU in the loop. tqdm progress, accuracy per epoch,
--json for the figures (epoch time, input-wait fraction, accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torch_fastload.gnn import CSRGraph, NeighborBatches, make_graph  # noqa: E402
from torch_fastload.gnn.synthetic import PRESETS  # noqa: E402
from torch_fastload.sources import FeatureStore  # noqa: E402


class MmapFeatures:
    """The baseline: rows by numpy fancy indexing of a memmap, copied to the device."""

    def __init__(self, path: str, device: torch.device):
        self.array = np.load(path, mmap_mode="r")
        self.device = device

    def gather(self, ids) -> torch.Tensor:
        return torch.from_numpy(self.array[np.asarray(ids)]).to(self.device)


class SAGELayer(nn.Module):
    """h_v' = W_self h_v + W_neigh mean_{u -> v} h_u (GraphSAGE, mean aggregator)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.self_lin = nn.Linear(d_in, d_out)
        self.neigh_lin = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        total = torch.zeros_like(x).index_add_(0, dst, x[src])
        count = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype).index_add_(
            0, dst, torch.ones_like(dst, dtype=x.dtype))
        mean = total / count.clamp(min=1).unsqueeze(1)
        return self.self_lin(x) + self.neigh_lin(mean)


class GraphSAGE(nn.Module):
    def __init__(self, d_in: int, hidden: int, classes: int, layers: int = 2, dropout: float = 0.3):
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1) + [classes]
        self.layers = nn.ModuleList(SAGELayer(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for k, layer in enumerate(self.layers):
            x = layer(x, edge_index)
            if k < len(self.layers) - 1:
                x = F.dropout(F.relu(x), self.dropout, self.training)
        return x


def progress(iterable, total, desc, enabled):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)


def run_epoch(model, batches, optimizer, device, max_steps, show, desc, train=True):
    model.train(train)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    loss_sum = torch.zeros((), device=device)
    total, steps, wait = 0, 0, 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    it = iter(batches)
    limit = min(len(batches), max_steps) if max_steps else len(batches)
    for _ in progress(range(limit), limit, desc, show):
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t0
        with torch.set_grad_enabled(train):
            out = model(batch.x.float(), batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y)
        if train:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        correct += (out.argmax(1) == batch.y).sum()  # summed on the device: no sync per step
        total += batch.batch_size
        loss_sum += loss.detach()
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return {"loss": float(loss_sum) / max(steps, 1), "accuracy": int(correct) / max(total, 1), "seconds": seconds,
            "steps": steps, "input_wait_fraction": wait / seconds if seconds else 0.0}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--nodes", type=int, help="override the preset's node count")
    p.add_argument("--dim", type=int, help="override the preset's feature size")
    p.add_argument("--root", help="where the graph lives (default ~/.cache/torch_fastload/gnn-<preset>)")
    p.add_argument("--loader", choices=("fastload", "baseline"), default="fastload")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after N mini-batches (0: all)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cache-fraction", type=float, default=0.05, help="share of nodes (highest degree) cached on the GPU")
    p.add_argument("--pin", action="store_true", help="register the feature file for zero-copy GPU gathers")
    p.add_argument("--o-direct", action="store_true")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    size = dict(PRESETS[args.preset])
    size.update({k: v for k, v in (("nodes", args.nodes), ("dim", args.dim)) if v})
    root = args.root or os.path.join(os.path.expanduser("~"), ".cache", "torch_fastload", f"gnn-{args.preset}")
    show = not args.no_progress
    t0 = time.perf_counter()
    g = make_graph(root, size["nodes"], size["dim"], seed=args.seed, progress=show)
    print(f"graph: {size['nodes']:,} nodes, {len(g['indices']):,} edges, {size['dim']} features on disk "
          f"({os.path.getsize(g['paths']['features']) / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)
    graph = CSRGraph(g["indptr"], g["indices"])
    labels = g["labels"]
    classes = int(labels.max()) + 1
    split = np.random.default_rng(args.seed).permutation(graph.num_nodes)
    train_ids, val_ids, test_ids = np.split(split, [int(0.6 * len(split)), int(0.8 * len(split))])
    if args.loader == "fastload":
        hot = np.argsort(-graph.degree())[:int(args.cache_fraction * graph.num_nodes)] if args.cache_fraction else None
        store = FeatureStore(g["paths"]["features"], device=device, cache_ids=hot, pin=args.pin and device.type == "cuda",
                             o_direct=args.o_direct)
        store.reserve(args.batch_size * 200)
        prefetch = args.prefetch
    else:
        store, prefetch = MmapFeatures(g["paths"]["features"], device), 0
    fanouts = [int(f) for f in args.fanouts.split(",")]

    def batches(ids, shuffle):
        return NeighborBatches(graph, ids, fanouts, store, labels, batch_size=args.batch_size, shuffle=shuffle,
                               seed=args.seed, prefetch=prefetch, device=device)

    model = GraphSAGE(size["dim"], args.hidden, classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_batches, val_batches = batches(train_ids, True), batches(val_ids, False)
    history = []
    for epoch in range(args.epochs):
        train = run_epoch(model, train_batches, optimizer, device, args.max_steps, show, f"epoch {epoch} train")
        val = run_epoch(model, val_batches, optimizer, device, args.max_steps, show, f"epoch {epoch} val", train=False)
        history.append({"epoch": epoch, "train": train, "val": val})
        print(f"epoch {epoch}: loss {train['loss']:.4f}  train acc {100 * train['accuracy']:.1f}%  "
              f"val acc {100 * val['accuracy']:.1f}%  epoch {train['seconds']:.2f} s "
              f"({train['steps']} steps), input wait {100 * train['input_wait_fraction']:.1f}%", flush=True)
    test = run_epoch(model, batches(test_ids, False), optimizer, device, args.max_steps, show, "test", train=False)
    print(f"test accuracy {100 * test['accuracy']:.1f}% (chance {100 / classes:.1f}%)")
    result = {"loader": args.loader, "preset": args.preset, **size, "edges": int(len(g["indices"])),
              "device": str(device), "history": history, "test": test,
              "store_stats": vars(store.stats()) if hasattr(store, "stats") else None}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
