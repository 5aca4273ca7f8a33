"""GraphSAGE node classification with node features on storage, fed by torch_fastload.

    python examples/gnn_sage.py                            # small preset: 100k nodes x 64 features
    python examples/gnn_sage.py --preset large             # 20M nodes x 128 features (10 GB on disk)
    python examples/gnn_sage.py --loader baseline          # features by np.load(mmap_mode='r')[ids].cuda()
    torchrun --nproc-per-node 2 examples/gnn_sage.py       # DDP: seeds sharded by rank (nccl, or gloo on CPU)
    python examples/gnn_sage.py --checkpoint ck.pt --checkpoint-every 100   # then --resume ck.pt

The graph is generated once under --root (torch_fastload.gnn.make_graph): a power-law graph
whose communities decide the labels, with features that are the community's centroid plus
more noise than signal. The features are written to disk and never loaded whole. Each
mini-batch samples a 2-hop neighbourhood (--fanouts, uniform, built-in sampler over CSR).

--loader fastload: the FeatureStore gathers x (GPU cache of the highest-degree nodes,
--cache-fraction; zero-copy gathers from host memory (the uva tier) where the file fits
--pin's budget (auto), or --pin on/off; storage reads by the C++ engine otherwise, --o-direct
for data larger than RAM), the next --prefetch mini-batches
sampled and gathered on a background thread. --loader baseline: the same sampler, x gathered
by numpy from a memmap and copied to the GPU in the loop. tqdm progress, accuracy per epoch,
--json for the figures (epoch time, input-wait fraction, accuracy).

Under torchrun every rank trains on its share of each epoch's seeds (NeighborBatches with
num_replicas/rank: DistributedSampler semantics), the model is wrapped in
DistributedDataParallel, the metrics are summed over ranks, local rank 0 generates the graph
(once a node) while the others wait, and rank 0 alone prints and writes --json.
--checkpoint PATH saves the model, the optimizer, the epoch, every rank's random state and
the NeighborBatches state every --checkpoint-every steps and after each epoch; --resume PATH
continues from it mid-epoch with the batches the interrupted run had left: at the same world
size the run goes on as if never stopped (on the CPU, bit for bit), at another the rest of
the epoch's seeds are dealt out to the new ranks, each once.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch_fastload  # noqa: E402
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
            0, dst, torch.ones_like(dst, dtype=x.dtype)
        )
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


def setup_distributed(choice: str):
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: nccl on the LOCAL_RANK GPU, gloo on the CPU.
    A plain launch is rank 0 of 1. Returns ``(rank, world_size, device)``."""
    cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if cuda:
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl")
            device = torch.device("cuda", local_rank)
        else:
            dist.init_process_group("gloo")
            device = torch.device("cpu")
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, torch.device("cuda") if cuda else torch.device("cpu")


def barrier(device) -> None:
    if dist.is_initialized():
        dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values)
    return values


def run_epoch(model, batches, optimizer, device, max_steps, show, desc, train=True, skip=0, on_step=None):
    """One pass over ``batches`` (the rest of a resumed epoch whose first ``skip`` steps ran
    before the checkpoint); metrics summed over ranks. ``on_step(steps done in the epoch)``
    runs after each training step (checkpoints); when it returns True the epoch stops there."""
    model.train(train)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    loss_sum = torch.zeros((), device=device)
    total, steps, wait, stopped = 0, 0, 0.0, False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    it = iter(batches)
    limit = max(0, (min(len(batches), max_steps) if max_steps else len(batches)) - skip)
    for _ in progress(range(limit), limit, desc, show):
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t0
        with torch.set_grad_enabled(train):
            out = model(batch.x.float(), batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y)
        if train:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        correct += (out.argmax(1) == batch.y).sum()  # summed on the device: no sync per step
        total += batch.batch_size
        loss_sum += loss.detach()
        steps += 1
        if on_step is not None and on_step(skip + steps):
            stopped = True
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    sums = all_reduce_sum(
        torch.stack(
            [
                correct.double(),
                loss_sum.double(),
                torch.tensor(float(total), dtype=torch.float64, device=device),
                torch.tensor(float(steps), dtype=torch.float64, device=device),
            ]
        )
    )
    correct_all, loss_all, total_all, steps_all = sums.tolist()
    del it  # ends the background thread of an epoch stopped at --max-steps
    return {
        "loss": loss_all / max(steps_all, 1),
        "accuracy": correct_all / max(total_all, 1),
        "seconds": seconds,
        "steps": steps,
        "resumed_at": skip,
        "stopped": stopped,
        "input_wait_fraction": wait / seconds if seconds else 0.0,
    }


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
    p.add_argument(
        "--cache-fraction", type=float, default=0.05, help="share of nodes (highest degree) cached on the GPU"
    )
    p.add_argument(
        "--pin",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="register the feature file for zero-copy GPU gathers (the uva tier); auto (default): where "
        "the file fits TORCH_FASTLOAD_MAP_BUDGET (25%% of RAM)",
    )
    p.add_argument("--o-direct", action="store_true")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--checkpoint", help="save model, optimizer, epoch and batch position here (rank 0)")
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="training steps between checkpoints (0: only after each epoch)"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="end the run after N training steps in all, checkpointed first (a preemption drill)",
    )
    p.add_argument("--resume", help="continue from this checkpoint (mid-epoch; --max-steps counts this world's steps)")
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint:
        p.error("--checkpoint-every needs --checkpoint PATH")
    rank, world_size, device = setup_distributed(args.device)
    lead = rank == 0
    log = print if lead else (lambda *a, **k: None)
    size = dict(PRESETS[args.preset])
    size.update({k: v for k, v in (("nodes", args.nodes), ("dim", args.dim)) if v})
    root = args.root or os.path.join(torch_fastload.config.cache_dir(), f"gnn-{args.preset}")
    show = lead and not args.no_progress
    t0 = time.perf_counter()
    # one writer a node (LOCAL_RANK 0; on one node: rank 0), the other ranks read what it wrote.
    # Several nodes need a node-local --root (or one generated before the run).
    writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    g = make_graph(root, size["nodes"], size["dim"], seed=args.seed, progress=show) if writer else None
    barrier(device)
    if g is None:
        g = make_graph(root, size["nodes"], size["dim"], seed=args.seed, progress=False)
    log(
        f"graph: {size['nodes']:,} nodes, {len(g['indices']):,} edges, {size['dim']} features on disk "
        f"({os.path.getsize(g['paths']['features']) / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s"
        + (f"; {world_size} ranks" if world_size > 1 else ""),
        flush=True,
    )
    torch.manual_seed(args.seed + rank)  # dropout differs by rank; DDP broadcasts rank 0's initial weights
    graph = CSRGraph(g["indptr"], g["indices"])
    labels = g["labels"]
    classes = int(labels.max()) + 1
    split = np.random.default_rng(args.seed).permutation(graph.num_nodes)
    train_ids, val_ids, test_ids = np.split(split, [int(0.6 * len(split)), int(0.8 * len(split))])
    if args.loader == "fastload":
        hot = np.argsort(-graph.degree())[: int(args.cache_fraction * graph.num_nodes)] if args.cache_fraction else None
        pin = {"auto": "auto", "on": device.type == "cuda", "off": False}[args.pin]
        store = FeatureStore(g["paths"]["features"], device=device, cache_ids=hot, pin=pin, o_direct=args.o_direct)
        log(f"features: {store!r} ({store.pin_reason})", flush=True)
        store.reserve(args.batch_size * 200)
        prefetch = args.prefetch
    else:
        store, prefetch = MmapFeatures(g["paths"]["features"], device), 0
    fanouts = [int(f) for f in args.fanouts.split(",")]

    def batches(ids, shuffle):  # this rank's share of every epoch
        return NeighborBatches(
            graph,
            ids,
            fanouts,
            store,
            labels,
            batch_size=args.batch_size,
            shuffle=shuffle,
            seed=args.seed,
            prefetch=prefetch,
            device=device,
            num_replicas=world_size,
            rank=rank,
        )

    model = GraphSAGE(size["dim"], args.hidden, classes).to(device)
    train_batches, val_batches = batches(train_ids, True), batches(val_ids, False)
    history, start_epoch, skip, step = [], 0, 0, 0
    checkpoint = None
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
    train_model = (
        DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if world_size > 1
        else model
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        history, start_epoch, skip, step = (
            checkpoint["history"],
            checkpoint["epoch"],
            checkpoint["step_in_epoch"],
            checkpoint["step"],
        )
        if checkpoint["batches"] is not None:  # mid-epoch: the rest of that epoch's batches
            train_batches.load_state_dict(checkpoint["batches"])
        if len(checkpoint["rng"]) == world_size:  # same world: each rank's dropout continues as it would have
            cpu_rng, cuda_rng = checkpoint["rng"][rank]
            torch.set_rng_state(cpu_rng.cpu())
            if cuda_rng is not None and device.type == "cuda":
                torch.cuda.set_rng_state(cuda_rng.cpu(), device)
        log(
            f"resumed from {args.resume}: epoch {start_epoch}, step {skip} of it (saved by "
            f"{checkpoint['world_size']} rank(s), now {world_size})",
            flush=True,
        )
        del checkpoint

    def save(epoch: int, step_in_epoch: int, batch_state) -> None:
        """Every rank calls this at the same step (its random state is gathered); rank 0 writes."""
        rng = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]
        rngs = [rng]
        if dist.is_initialized():  # dropout draws differ by rank: keep each rank's generators
            rngs = [None] * world_size
            dist.all_gather_object(rngs, rng)
        if not lead:  # every rank is at the same step: rank 0's batch state serves all of them
            return
        tmp = args.checkpoint + ".tmp"
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "step_in_epoch": step_in_epoch,
                "step": step,
                "batches": batch_state,
                "history": history,
                "world_size": world_size,
                "rng": rngs,
            },
            tmp,
        )
        os.replace(tmp, args.checkpoint)  # a run killed while saving leaves the previous checkpoint whole

    for epoch in range(start_epoch, args.epochs):
        train_batches.set_epoch(epoch)  # as DistributedSampler: every rank draws the same epoch order

        def on_step(done: int, epoch=epoch) -> bool:
            """After each training step: checkpoint when due; True stops the run (--stop-after)."""
            nonlocal step
            step += 1
            stop = bool(args.stop_after) and step >= args.stop_after
            if args.checkpoint and (stop or (args.checkpoint_every and step % args.checkpoint_every == 0)):
                save(epoch, done, train_batches.state_dict())
            return stop

        train = run_epoch(
            train_model,
            train_batches,
            optimizer,
            device,
            args.max_steps,
            show,
            f"epoch {epoch} train",
            skip=skip if epoch == start_epoch else 0,
            on_step=on_step,
        )
        if train["stopped"]:
            done = train["resumed_at"] + train["steps"]
            log(
                f"stopped after {step} steps (epoch {epoch}, step {done} of it)"
                + (f": checkpoint {args.checkpoint}" if args.checkpoint else ""),
                flush=True,
            )
            train_model = None  # noqa: F841 (see release_ddp)
            release_ddp()
            return finish(
                {
                    "stopped_at": {"epoch": epoch, "step_in_epoch": done, "step": step},
                    "world_size": world_size,
                    "history": history,
                },
                args,
                lead,
                device,
            )
        val = run_epoch(model, val_batches, optimizer, device, args.max_steps, show, f"epoch {epoch} val", train=False)
        history.append({"epoch": epoch, "train": train, "val": val})
        log(
            f"epoch {epoch}: loss {train['loss']:.4f}  train acc {100 * train['accuracy']:.1f}%  "
            f"val acc {100 * val['accuracy']:.1f}%  epoch {train['seconds']:.2f} s "
            f"({train['steps']} steps), input wait {100 * train['input_wait_fraction']:.1f}%",
            flush=True,
        )
        if args.checkpoint:
            save(epoch + 1, 0, None)
    test = run_epoch(model, batches(test_ids, False), optimizer, device, args.max_steps, show, "test", train=False)
    log(f"test accuracy {100 * test['accuracy']:.1f}% (chance {100 / classes:.1f}%)")
    result = {
        "loader": args.loader,
        "preset": args.preset,
        **size,
        "edges": int(len(g["indices"])),
        "device": str(device),
        "world_size": world_size,
        "history": history,
        "test": test,
        "store_stats": vars(store.stats()) if hasattr(store, "stats") else None,
    }
    train_model = None  # noqa: F841 (see release_ddp)
    release_ddp()
    return finish(result, args, lead, device)


def release_ddp() -> None:
    """Collect the dropped DistributedDataParallel wrapper before the process group goes: its
    reducer holds the group, which then outlives ``destroy_process_group`` into interpreter
    exit, where a gloo worker thread releasing a finished collective's tensor takes the GIL
    and aborts the process ("terminate called without an active exception", c10d's
    ``ProcessGroupGloo::runLoop`` -> ``TensorImpl::decref_pyobject``; seen in CI under load)."""
    gc.collect()


def finish(result: dict, args, lead: bool, device) -> dict:
    """Rank 0 writes --json; every rank leaves the process group."""
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        barrier(device)
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
