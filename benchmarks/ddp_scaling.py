#!/usr/bin/env python3
"""DDP scaling of the torch_fastload file loader: aggregate samples/s and GB/s at 1, 2, ... GPUs
(one process a GPU, DistributedSampler sharding), against torch's DataLoader in the same run.

Data (generated once under --dir, reused while the sizes match; random bytes, never zeros):
  features.npy float32 rows of --row-kib (default 192 KiB, the rows of file_loader.py),
  --gib in all (default 8 GiB on a GPU); labels.npy int64; ids.npy int64 (row i holds i).
  A sample is row i of each file (torch_fastload.ArrayDataset), so every delivered batch says
  which samples it holds: each rank counts the ids it received on its device and the counts
  are all-reduced, an exact check that the ranks together covered every sample once per epoch.

Each rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK; a plain run is rank 0 of 1) uses its own
GPU (cuda:LOCAL_RANK; backend nccl) or the CPU (backend gloo), shards the data with
torch_fastload.DistributedSampler (torch's where the package has none yet), shuffle on,
set_epoch each epoch, and measures:
  fastload  torch_fastload.DataLoader(sampler=..., device=cuda:LOCAL_RANK): one untimed warmup
            epoch (rows checked against the file), then --epochs timed epochs
  torch     torch.utils.data.DataLoader(sampler=..., num_workers=--torch-workers,
            pin_memory=True) + .to(device, non_blocking=True): --torch-epochs epochs, timed
            after the first 2 batches
The consumer uses every batch on the device (one index_add_ of its ids; optionally
--compute-ms of GEMMs a batch). Per rank: samples/s, GB/s, input wait (time blocked in
next()), CPU cores, and the epoch edges (iter() to the first batch, the last batch to the
iterator gone). Aggregate: the all-reduced sum of samples (bytes) over the max of the ranks'
wall times; "steady" leaves the epoch edges out.

    python benchmarks/ddp_scaling.py --driver --gpus 1,2          # 1 and 2 GPUs, the ratio (~1 min + data)
    torchrun --nproc-per-node 2 benchmarks/ddp_scaling.py         # one measurement, 2 GPUs
    python benchmarks/ddp_scaling.py                              # the same on 1 GPU (or the CPU)
    python benchmarks/ddp_scaling.py --imagenet --gpus 1,2        # examples/imagenet.py at 1 and 2 GPUs
    python benchmarks/ddp_scaling.py --driver --cpu-smoke --gpus 1,2   # no GPU: gloo, tiny data

--imagenet: examples/imagenet.py (ResNet-50, batch 256 a GPU, bf16, channels_last, a generated
folder of 100 x 128 real-photo JPEGs, page cache hot) for whole epochs totalling >= 240 steps,
fed by fastload and by synthetic device-resident batches (the model's own DDP scaling):
aggregate train images/s, the step against synthetic, and the 2 / 1 ratio.

Targets (issue 6): fastload aggregate samples/s at 2 GPUs >= 1.9x the 1-GPU figure where
storage is not the limit (the page cache holds the files: the residency before each run is
reported), every sample exactly once per epoch across ranks.

Everything goes to --out (default benchmarks/out): the driver writes ddp_scaling.json (every
rank's figures, machine, commands), ddp_scaling.png and each launch's ddp_scaling-<n>gpu.json
and .log; --imagenet writes ddp_imagenet.json and ddp_imagenet-<loader>-<n>gpu.json/.log.
Data is generated once and kept under --dir (arrays) and --imagenet-dir (JPEGs; checkpoints go
to <imagenet-dir>-checkpoints), not under --out when --out is given elsewhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout, not some installed copy

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.utils.data as tud  # noqa: E402
import torch.utils.data.distributed  # noqa: E402,F401

import torch_fastload  # noqa: E402
from torch_fastload._benchutil import (
    cpu_seconds,
    fmt,
    fsync_file,
    gemm_seconds,
    log,
    machine_info,  # noqa: E402
    positive_int_list,
    pyplot,
    run_quiet,
    table,
    warm_page_cache,
    write_json,
)
from torch_fastload.sources import ArrayDataset  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
ROW_MULTIPLE = 8  # rows are a multiple of this, so 1, 2, 4 and 8 ranks shard them without padding
SCALING_TARGET = 1.9


def distributed_sampler_class():
    """torch_fastload.DistributedSampler (resumable) where the package has it, else torch's."""
    return getattr(torch_fastload, "DistributedSampler", torch.utils.data.distributed.DistributedSampler)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
def data_layout(args) -> dict:
    row_bytes = int(args.row_kib * 1024) // 4 * 4
    if row_bytes <= 0:
        raise SystemExit(f"--row-kib {args.row_kib}: rows need at least 4 bytes")
    rows = max(ROW_MULTIPLE * 4, int(args.gib * GiB) // row_bytes // ROW_MULTIPLE * ROW_MULTIPLE)
    return {"rows": rows, "row_bytes": row_bytes, "seed": args.seed, "version": 1}


def data_paths(root: Path) -> dict:
    return {"features": root / "features.npy", "labels": root / "labels.npy", "ids": root / "ids.npy"}


def make_data(root: Path, layout: dict, quiet: bool = False) -> dict:
    """The three .npy files under ``root`` (reused when ``root/meta.json`` matches ``layout``)."""
    paths = data_paths(root)
    meta = root / "meta.json"
    want = 128 + layout["rows"] * layout["row_bytes"]
    try:
        if (
            json.loads(meta.read_text()) == layout
            and paths["features"].stat().st_size == want
            and paths["labels"].exists()
            and paths["ids"].exists()
        ):
            return paths
    except (OSError, ValueError):
        pass
    root.mkdir(parents=True, exist_ok=True)
    meta.unlink(missing_ok=True)
    rows, elems = layout["rows"], layout["row_bytes"] // 4
    started = time.perf_counter()
    if not quiet:
        log(
            f"  writing {rows} rows x {layout['row_bytes'] / 1024:.0f} KiB = {rows * layout['row_bytes'] / GiB:.2f} GiB "
            f"under {root}"
        )
    out = np.lib.format.open_memmap(paths["features"], mode="w+", dtype=np.float32, shape=(rows, elems))
    flat = out.reshape(-1).view(np.uint8)
    block = 64 * MiB
    # one random block, shifted by a different odd constant per chunk (numpy releases the GIL:
    # the threads fill in parallel); every row differs, no byte pattern repeats between chunks
    base = np.frombuffer(np.random.default_rng(layout["seed"]).bytes(block), dtype=np.uint64)

    def fill(k: int, flat=flat) -> None:
        start = k * block
        end = min(start + block, flat.size)
        words = (end - start) // 8
        chunk = base[:words] + np.uint64((0x9E3779B97F4A7C15 * (k + 1)) % (1 << 64) | 1)
        flat[start : start + words * 8] = chunk.view(np.uint8)
        flat[start + words * 8 : end] = 0x5A

    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range((flat.size + block - 1) // block)))
    out.flush()
    del out, flat
    np.save(paths["labels"], np.random.default_rng(layout["seed"] + 1).integers(0, 1000, rows))
    np.save(paths["ids"], np.arange(rows, dtype=np.int64))
    for path in paths.values():
        fsync_file(path)
    meta.write_text(json.dumps(layout))
    if not quiet:
        log(f"  wrote the data in {time.perf_counter() - started:.1f} s")
    return paths


def residency(paths) -> float | None:
    """Share of the files' pages in the page cache (None where the engine cannot tell)."""
    try:
        from torch_fastload.engine import page_cache_residency

        sizes = [os.path.getsize(p) for p in paths]
        return sum(page_cache_residency(p) * s for p, s in zip(paths, sizes)) / max(1, sum(sizes))
    except Exception:
        return None


# --------------------------------------------------------------------------------------------
# distributed
# --------------------------------------------------------------------------------------------
class Dist:
    """Rank, world, device and the few collectives the benchmark needs (no-ops in one process)."""

    def __init__(self, want_device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and want_device != "cpu"
        if want_device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (run with --device cpu or --cpu-smoke)")
        if cuda:
            if self.local_rank >= torch.cuda.device_count():
                raise SystemExit(f"LOCAL_RANK {self.local_rank} but only {torch.cuda.device_count()} GPUs")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.backend = None
        if self.world > 1:
            self.backend = "nccl" if cuda else "gloo"
            kwargs = {"device_id": self.device} if cuda else {}
            try:
                dist.init_process_group(self.backend, **kwargs)
            except TypeError:  # older torch: no device_id
                dist.init_process_group(self.backend)
        self.on = dist.is_available() and dist.is_initialized()
        # nccl reduces device tensors, gloo host tensors
        self.reduce_device = self.device if self.backend == "nccl" else torch.device("cpu")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.on:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()

    def reduce(self, values, op: str = "sum") -> list:
        if not self.on:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self.reduce_device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return t
        moved = t.to(self.reduce_device)
        dist.all_reduce(moved)
        return moved

    def gather(self, obj) -> list:
        if not self.on:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.on:
            dist.destroy_process_group()
            self.on = False


# --------------------------------------------------------------------------------------------
# one loader, measured on every rank
# --------------------------------------------------------------------------------------------
class Consumer:
    """Uses each batch on the device as a training step would: counts every id it received (one
    ``index_add_`` on the device: exact coverage without a host sync), optionally runs
    ``compute_ms`` of GEMMs, and checks rows against the file when asked."""

    def __init__(self, rows: int, device: torch.device, compute_ms: float, features_path: Path, record_ids: bool):
        self.device = device
        self.seen = torch.zeros(rows, dtype=torch.int32, device=device)
        self.ones = torch.ones(0, dtype=torch.int32, device=device)
        self.sink: list = []
        self.record_ids = record_ids
        self.features = np.load(features_path, mmap_mode="r")
        self._finished: list = []  # (epoch, figures on the device, ids)
        self._epoch = None
        self.gemm = None
        if compute_ms > 0 and device.type == "cuda":
            a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
            per = 1e3 * gemm_seconds(a, a, warmup=3)
            self.gemm = (a, max(1, round(compute_ms / per)), per)
        elif compute_ms > 0:
            log("  (--compute-ms ignored on the CPU)")

    def begin_epoch(self, epoch: int) -> None:
        # per-epoch figures come from the counts' difference at the epoch's end: the hot loop
        # does one index_add_ a batch and nothing else
        self._epoch = {"epoch": epoch, "seen": self.seen.clone(), "ids": []}

    def end_epoch(self) -> None:
        """The epoch's id figures, left on the device: no host sync at the epoch edge (a training
        loop need not have one there either); ``epoch_figures()`` reads them after the run."""
        e = self._epoch
        delta = (self.seen - e["seen"]).to(torch.int64)
        index = torch.arange(delta.numel(), device=self.device, dtype=torch.int64)
        figures = torch.stack([delta.sum(), (delta * index).sum(), (delta * index * index).sum(), (delta > 1).sum()])
        self._finished.append((e["epoch"], figures, e["ids"]))
        self._epoch = None

    def epoch_figures(self) -> list:
        out = []
        for epoch, figures, ids in self._finished:
            count, id_sum, id_sq_sum, repeated = figures.tolist()
            entry = {"epoch": epoch, "count": count, "id_sum": id_sum, "id_sq_sum": id_sq_sum, "repeated": repeated}
            if self.record_ids:
                entry["ids"] = [int(i) for chunk in ids for i in chunk]
            out.append(entry)
        self._finished = []
        return out

    def __call__(self, batch, verify: bool) -> tuple[int, int]:
        x, _labels, ids = batch
        n = ids.numel()
        if self.ones.numel() < n:
            self.ones = torch.ones(n, dtype=torch.int32, device=self.device)
        self.seen.index_add_(0, ids, self.ones[:n])
        if self.record_ids:
            self._epoch["ids"].append(ids.tolist())
        # the index_add_ runs on the consumer stream after the batch's event: every field has
        # arrived by then; no reference is kept (held batches would hold the loader's memory)
        if self.gemm is not None:
            a, reps, _ = self.gemm
            c = a
            for _ in range(reps):
                c = c @ a
            self.sink = [c[0, :1]]
        if verify:
            got = x.reshape(n, -1).cpu().numpy()
            index = ids.cpu().numpy()
            if not np.array_equal(got.view(np.uint8), np.asarray(self.features[index]).reshape(n, -1).view(np.uint8)):
                raise AssertionError(f"delivered rows differ from the file (ids {index[:4].tolist()}...)")
        return n, sum(t.numel() * t.element_size() for t in batch)


def cpu_total() -> float:
    """CPU seconds of this process, its live descendants and its reaped children: torch's
    worker processes exit (and are reaped) when an epoch ends, taking their time with them
    from a /proc walk but adding it to RUSAGE_CHILDREN."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return cpu_seconds() + children.ru_utime + children.ru_stime


def run_loader(
    name: str,
    loader,
    sampler,
    ctx: Dist,
    args,
    consumer: Consumer,
    epochs: list,
    timed_from_batch: int,
    move: bool,
    verify_untimed: int,
) -> dict:
    """Iterate ``epochs`` (set_epoch before each iter, the iterator dropped at the end as a
    ``for`` loop drops it); the clock starts (after a barrier) at global batch
    ``timed_from_batch`` and stops after the last batch, the device synchronized.
    Epoch edges are timed apart too: iter() to the first batch, and the last batch to the
    iterator gone (exhaustion and shutdown)."""
    samples = nbytes = batches = 0
    wait = first_batch = teardown = 0.0
    edges = 0
    started = cpu0 = None
    done = 0

    def start_clock():
        nonlocal started, cpu0
        ctx.sync()
        ctx.barrier()
        started, cpu0 = time.perf_counter(), cpu_total()

    for epoch in epochs:
        sampler.set_epoch(epoch)
        consumer.begin_epoch(epoch)
        if started is None and done == timed_from_batch:
            start_clock()  # before iter(): the epoch's start-up is part of the timed work
        timed_epoch = started is not None
        t_iter = time.perf_counter()
        it = iter(loader)
        in_epoch = 0
        while True:
            if started is None and done == timed_from_batch:
                start_clock()
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            if move:
                batch = [t.to(ctx.device, non_blocking=True) for t in batch]
            t1 = time.perf_counter()
            if in_epoch == 0 and timed_epoch:
                first_batch += t1 - t_iter
            verify = args.verify_all or (started is None and in_epoch < verify_untimed)
            n, b = consumer(batch, verify)
            if started is not None:
                samples += n
                nbytes += b
                batches += 1
                wait += t1 - t0
            done += 1
            in_epoch += 1
            t_last = time.perf_counter()
        del it  # as a for loop drops it: the pipeline (or torch's workers) shuts down here
        if timed_epoch and in_epoch:
            teardown += time.perf_counter() - t_last
            edges += 1
        consumer.end_epoch()
    ctx.sync()
    if started is None:
        raise RuntimeError(
            f"{name}: only {done} batches, the clock never started (timed from batch {timed_from_batch})"
        )
    wall = time.perf_counter() - started
    cpu = cpu_total() - cpu0
    gc.collect()
    return {
        "name": name,
        "epochs": len(epochs),
        "batches": batches,
        "samples": samples,
        "bytes": nbytes,
        "wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "gbps": nbytes / wall / 1e9 if wall > 0 else 0.0,
        "input_wait_s": wait,
        "input_wait_fraction": wait / wall if wall > 0 else 0.0,
        "cpu_s": cpu,
        "cores": cpu / wall if wall else 0.0,
        "timed_epochs": edges,
        "first_batch_s": first_batch,
        "teardown_s": teardown,
        "epoch_edge_ms": 1e3 * (first_batch + teardown) / edges if edges else None,
    }


def coverage(ctx: Dist, consumer: Consumer, rows: int, epochs: int) -> dict:
    """All ranks' id counts summed: every sample ``epochs`` times (exact), or padded where
    DistributedSampler repeats a few samples to even out the shards."""
    seen = ctx.reduce_tensor(consumer.seen).to(torch.int64)
    total_size = math.ceil(rows / ctx.world) * ctx.world
    low, high, total = int(seen.min().item()), int(seen.max().item()), int(seen.sum().item())
    exact = low == high == epochs
    padded = not exact and low == epochs and total == epochs * total_size
    consumer.seen.zero_()
    return {
        "epochs": epochs,
        "rows": rows,
        "min_count": low,
        "max_count": high,
        "total": total,
        "expected_total": epochs * total_size,
        "status": "exact" if exact else f"padded ({total_size - rows} repeats a epoch)" if padded else "WRONG",
        "ok": exact or padded,
    }


def worker(args) -> int:
    ctx = Dist(args.device)
    layout = data_layout(args)
    paths = data_paths(args.dir)
    if ctx.local_rank == 0:
        make_data(args.dir, layout, quiet=ctx.rank != 0)
    ctx.barrier()
    files = [paths["features"], paths["labels"], paths["ids"]]
    resident_before = residency(files)
    ds = ArrayDataset(*[str(p) for p in files])
    rows = len(ds)
    if ctx.rank == 0:
        log(
            f"ddp_scaling: world {ctx.world} ({ctx.backend or 'one process'}), "
            f"{'cuda:LOCAL_RANK' if ctx.device.type == 'cuda' else 'cpu'} per rank, "
            f"{rows} rows x {layout['row_bytes'] / 1024:.0f} KiB = {rows * layout['row_bytes'] / GiB:.2f} GiB, "
            f"batch {args.batch}, page cache {fmt(resident_before, '.0%')} resident"
        )
    Sampler = distributed_sampler_class()
    sampler = Sampler(ds, num_replicas=ctx.world, rank=ctx.rank, shuffle=True, seed=args.seed)
    consumer = Consumer(rows, ctx.device, args.compute_ms, paths["features"], args.record_ids)
    runs, coverages = {}, {}
    io_kwargs = {k: getattr(args, k) for k in ("io_mode", "map_budget", "io_threads") if getattr(args, k) is not None}

    def measure(name, fn):
        # no try/except: a rank that fails exits, and torchrun stops the others (a rank that
        # carried on alone would wait in the next collective)
        runs[name] = fn()
        coverages[name] = coverage(ctx, consumer, rows, runs[name].pop("_epochs_run"))
        runs[name]["id_stats"] = consumer.epoch_figures()

    def fastload():
        loader = torch_fastload.DataLoader(
            ds, batch_size=args.batch, sampler=sampler, device=ctx.device, drop_last=False, **io_kwargs
        )
        try:
            per_epoch = len(loader)
            epochs = list(range(1 + args.epochs))  # epoch 0: warmup, untimed
            result = run_loader(
                "fastload", loader, sampler, ctx, args, consumer, epochs, per_epoch, False, args.verify_batches
            )
            stats = loader.stats()
            result.update(
                io=str(loader.io),
                io_mode=loader.io.mode,
                io_bytes=dict(stats.io_bytes),
                stats_wait_fraction=stats.wait_fraction,
                pool_bytes=stats.pool_bytes,
                state_dict=hasattr(loader, "state_dict"),
                _epochs_run=len(epochs),
            )
        finally:
            loader.close()
        return result

    def torch_baseline():
        workers = args.torch_workers
        loader = tud.DataLoader(
            ds,
            batch_size=args.batch,
            sampler=sampler,
            num_workers=workers,
            pin_memory=ctx.device.type == "cuda",
            drop_last=False,
            prefetch_factor=4 if workers else None,
            persistent_workers=False,
        )
        epochs = list(range(args.torch_epochs))
        warmup = min(2, max(0, len(loader) - 1))
        result = run_loader(
            f"torch w{workers}", loader, sampler, ctx, args, consumer, epochs, warmup, True, args.verify_batches
        )
        result.update(workers=workers, pin_memory=ctx.device.type == "cuda", _epochs_run=len(epochs))
        return result

    measure("fastload", fastload)
    if args.torch_epochs > 0:
        measure("torch", torch_baseline)
    mine = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "host": socket.gethostname(),
        "device": str(ctx.device),
        "gpu": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None,
        "resident_before": resident_before,
        "runs": runs,
    }
    everyone = ctx.gather(mine)
    aggregate = {}
    for name in runs:  # every rank ran the same loaders
        mine_run = runs[name]
        samples, nbytes, wait_frac, cores = ctx.reduce(
            [mine_run["samples"], mine_run["bytes"], mine_run["input_wait_fraction"], mine_run["cores"]], "sum"
        )
        inner = mine_run["wall_s"] - mine_run["first_batch_s"] - mine_run["teardown_s"]
        wall, inner, edge_ms = ctx.reduce([mine_run["wall_s"], inner, mine_run["epoch_edge_ms"] or 0.0], "max")
        aggregate[name] = {
            "world": ctx.world,
            "samples": int(samples),
            "bytes": int(nbytes),
            "wall_s": wall,
            "samples_per_s": samples / wall,
            "gbps": nbytes / wall / 1e9,
            # without the epoch edges (iter() to first batch, last batch to shutdown)
            "steady_samples_per_s": samples / inner if inner > 0 else None,
            "max_epoch_edge_ms": edge_ms if mine_run["epoch_edge_ms"] is not None else None,
            "mean_input_wait_fraction": wait_frac / ctx.world,
            "cores": cores,
            "per_rank_samples_per_s": [r["runs"][name]["samples_per_s"] for r in everyone],
            "coverage": coverages[name],
        }
    ctx.barrier()
    if ctx.rank == 0:
        report = {
            "kind": "worker",
            "world_size": ctx.world,
            "backend": ctx.backend,
            "device_type": ctx.device.type,
            "machine": machine_info(ctx.device.type == "cuda"),
            "args": {k: str(v) for k, v in vars(args).items()},
            "data": {
                **layout,
                "bytes": rows * layout["row_bytes"],
                "dir": str(args.dir),
                "resident_before": [r["resident_before"] for r in everyone],
            },
            "sampler": f"{Sampler.__module__}.{Sampler.__qualname__}",
            "ranks": everyone,
            "aggregate": aggregate,
            "failures": [
                {"what": f"{name} coverage", "error": a["coverage"]["status"]}
                for name, a in aggregate.items()
                if not a["coverage"]["ok"]
            ],
        }
        if "fastload" in aggregate and "torch" in aggregate:
            report["fastload_vs_torch"] = aggregate["fastload"]["samples_per_s"] / aggregate["torch"]["samples_per_s"]
        print_worker(report)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_json(args.json, report)
            log(f"wrote {args.json}")
    failed = any(not a["coverage"]["ok"] for a in aggregate.values())
    ctx.close()
    return 1 if failed else 0


def _io_of(run: dict) -> str:
    """The read path that moved most bytes (mapped, engine-posix, ...), else the io mode."""
    moved = run.get("io_bytes") or {}
    return max(moved, key=moved.get) if moved else run.get("io_mode", "-")


def print_worker(report: dict) -> None:
    rows = []
    for r in report["ranks"]:
        for name, run in r["runs"].items():
            rows.append(
                [
                    f"rank {r['rank']} {name}",
                    r["device"],
                    f"{run['samples_per_s']:,.0f}",
                    fmt(run["gbps"]),
                    fmt(100 * run["input_wait_fraction"], ".1f") + "%",
                    fmt(run["cores"], ".1f"),
                    f"{run['wall_s']:.2f}",
                    fmt(run["epoch_edge_ms"], ".1f"),
                    _io_of(run),
                ]
            )
    for name, a in report["aggregate"].items():
        rows.append(
            [
                f"all {name}",
                f"x{a['world']}",
                f"{a['samples_per_s']:,.0f}",
                fmt(a["gbps"]),
                fmt(100 * a["mean_input_wait_fraction"], ".1f") + "%",
                fmt(a["cores"], ".1f"),
                f"{a['wall_s']:.2f}",
                fmt(a["max_epoch_edge_ms"], ".1f"),
                a["coverage"]["status"],
            ]
        )
    log("")
    log(
        table(
            ["run", "device", "samples/s", "GB/s", "input wait", "cores", "wall s", "edge ms/epoch", "io / coverage"],
            rows,
            title=f"world {report['world_size']}: per rank, then aggregate (sum of samples / max wall)",
        )
    )
    if "fastload_vs_torch" in report:
        log(f"fastload vs torch DataLoader (aggregate samples/s): {report['fastload_vs_torch']:.2f}x")
    for f in report["failures"]:
        log(f"FAILED {f['what']}: {f['error']}")


# --------------------------------------------------------------------------------------------
# driver: launch torchrun per GPU count, collect, compare
# --------------------------------------------------------------------------------------------
def launch(cmd: list, log_path: Path, timeout: float, prefix: str) -> int:
    """Run ``cmd`` in its own session, echo its output (prefixed) and keep it in ``log_path``;
    on timeout kill that process group (only what this launched)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    log(f"$ {' '.join(cmd)}")
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )

        def pump():
            for line in proc.stdout:
                f.write(line)
                f.flush()
                print(f"{prefix}{line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{prefix}timed out after {timeout:.0f} s: stopping it")
            try:
                os.killpg(proc.pid, 15)
                rc = proc.wait(timeout=20)
            except Exception:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
            rc = rc if rc else 124
        reader.join(timeout=10)
    return rc


def torchrun_cmd(nproc: int, script: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *script]


def worker_argv(args, json_path: Path) -> list:
    out = [
        "--dir",
        str(args.dir),
        "--gib",
        repr(args.gib),
        "--row-kib",
        repr(args.row_kib),
        "--batch",
        str(args.batch),
        "--epochs",
        str(args.epochs),
        "--torch-workers",
        str(args.torch_workers),
        "--torch-epochs",
        str(args.torch_epochs),
        "--compute-ms",
        repr(args.compute_ms),
        "--seed",
        str(args.seed),
        "--verify-batches",
        str(args.verify_batches),
        "--device",
        args.device,
        "--json",
        str(json_path),
    ]
    for name in ("io_mode", "map_budget", "io_threads"):
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("record_ids", "verify_all"):
        if getattr(args, name):
            out.append(f"--{name.replace('_', '-')}")
    return out


def gpu_topology(cuda: bool) -> str | None:
    """``nvidia-smi topo -m``: how the GPUs talk (NVLink, PCIe switch, host bridge)."""
    return run_quiet(["nvidia-smi", "topo", "-m"]) if cuda else None


def _units(n: int, cuda: bool) -> str:
    return ("GPU" if cuda else "process") + ("" if n == 1 else "s" if cuda else "es")


def usable_counts(args) -> tuple[bool, list, list]:
    """``(cuda, process counts, skipped counts)``: the --gpus this machine has (the others
    are logged as skipped), or all of them as CPU processes."""
    cuda = args.device != "cpu" and torch.cuda.is_available()
    if not cuda:
        return cuda, list(args.gpus), []
    have = torch.cuda.device_count()
    for n in args.gpus:
        if n > have:
            log(f"skipping {n} GPUs: this machine has {have}")
    return cuda, [n for n in args.gpus if n <= have], [n for n in args.gpus if n > have]


def driver(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cuda, counts, skipped = usable_counts(args)
    log(f"ddp_scaling driver: {'GPUs' if cuda else 'CPU processes (gloo)'} {counts}")
    layout = data_layout(args)
    paths = make_data(args.dir, layout)
    files = list(paths.values())
    warm_page_cache(files)  # the scaling target is about the loader, not the disk: start hot
    report = {
        "kind": "driver",
        "machine": machine_info(cuda),
        "args": {k: str(v) for k, v in vars(args).items()},
        "data": {**layout, "bytes": layout["rows"] * layout["row_bytes"], "dir": str(args.dir)},
        "runs": {},
        "failures": [],
        "skipped_gpu_counts": skipped,
        "gpu_topology": gpu_topology(cuda),
    }
    for n in counts:
        json_path = args.out / f"ddp_scaling-{n}gpu.json"
        json_path.unlink(missing_ok=True)
        before = residency(files)
        log(f"-- {n} {_units(n, cuda)} (page cache {fmt(before, '.0%')} resident)")
        t0 = time.perf_counter()
        rc = launch(
            torchrun_cmd(n, [str(Path(__file__).resolve()), *worker_argv(args, json_path)]),
            args.out / f"ddp_scaling-{n}gpu.log",
            args.run_timeout,
            f"[{n}] ",
        )
        if not json_path.exists():
            report["failures"].append({"gpus": n, "rc": rc, "error": "no JSON written (see the log)"})
            continue
        result = json.loads(json_path.read_text())
        result["rc"] = rc
        result["process_seconds"] = time.perf_counter() - t0
        result["resident_before_launch"] = before
        report["runs"][str(n)] = result
        if rc != 0:
            report["failures"].append(
                {
                    "gpus": n,
                    "rc": rc,
                    "error": "; ".join(f"{f['what']}: {f['error']}" for f in result.get("failures", []))
                    or "non-zero exit",
                }
            )
    summarize(report, cuda)
    report["elapsed_s"] = time.perf_counter() - began
    write_json(args.out / "ddp_scaling.json", report)
    plot(report, args.out / "ddp_scaling.png")
    log(f"elapsed {report['elapsed_s']:.0f} s; wrote {args.out / 'ddp_scaling.json'} and ddp_scaling.png")
    return 1 if report["failures"] else 0


def summarize(report: dict, cuda: bool) -> None:
    runs = report["runs"]
    base = runs.get("1", {}).get("aggregate", {})
    rows, verdicts = [], []
    for n, r in sorted(runs.items(), key=lambda kv: int(kv[0])):
        for name, a in r.get("aggregate", {}).items():
            one = base.get(name)
            a["vs_1"] = a["samples_per_s"] / one["samples_per_s"] if one else None
            a["steady_vs_1"] = (
                a["steady_samples_per_s"] / one["steady_samples_per_s"]
                if one and a.get("steady_samples_per_s") and one.get("steady_samples_per_s")
                else None
            )
            per_rank = a["per_rank_samples_per_s"]
            rows.append(
                [
                    n,
                    name,
                    f"{a['samples_per_s']:,.0f}",
                    fmt(a["gbps"]),
                    f"{min(per_rank):,.0f}-{max(per_rank):,.0f}",
                    fmt(100 * a["mean_input_wait_fraction"], ".1f") + "%",
                    fmt(a["cores"], ".1f"),
                    fmt(a["vs_1"], ".2f") + "x",
                    fmt(a.get("max_epoch_edge_ms"), ".1f"),
                    fmt(a["steady_vs_1"], ".2f") + "x",
                    a["coverage"]["status"],
                    fmt(min((x for x in r["data"]["resident_before"] if x is not None), default=None), ".0%"),
                ]
            )
            if not a["coverage"]["ok"]:
                verdicts.append(
                    {
                        "target": f"{n} x {name}: every sample once per epoch",
                        "pass": False,
                        "value": a["coverage"]["status"],
                    }
                )
    log("")
    log(
        table(
            [
                "ranks",
                "loader",
                "agg samples/s",
                "agg GB/s",
                "per rank samples/s",
                "input wait",
                "cores",
                "vs 1",
                "edge ms/epoch",
                "steady vs 1",
                "coverage",
                "cached",
            ],
            rows,
            title="aggregate = all ranks' samples / the slowest rank's wall time; steady: without epoch "
            "edges (iter() to first batch, last batch to shutdown)",
        )
    )
    two = runs.get("2", {}).get("aggregate", {}).get("fastload")
    if two and base.get("fastload"):
        hot = all((x or 0) >= 0.99 for n in ("1", "2") for x in runs[n]["data"]["resident_before"])
        ratio = two["vs_1"]
        note = "page cache hot (storage not the limit)" if hot else "page cache NOT fully hot: storage may limit"
        if cuda:
            verdicts.append(
                {
                    "target": f"fastload 2-GPU / 1-GPU aggregate samples/s >= {SCALING_TARGET}x",
                    "value": ratio,
                    "pass": bool(hot and ratio >= SCALING_TARGET) if hot else None,
                    "note": note,
                }
            )
        else:
            verdicts.append(
                {
                    "target": "CPU smoke: scaling not meaningful on CPU processes",
                    "value": ratio,
                    "pass": None,
                    "note": note,
                }
            )
        t1, t2 = base.get("torch"), runs["2"]["aggregate"].get("torch")
        if t1 and t2:
            report["torch_scaling"] = t2["samples_per_s"] / t1["samples_per_s"]
        report["fastload_scaling"] = ratio
        report["fastload_steady_scaling"] = two.get("steady_vs_1")
        report["page_cache_hot"] = hot
    report["verdicts"] = verdicts
    log("")
    for v in verdicts:
        word = "PASS" if v["pass"] else "FAIL" if v["pass"] is False else "INFO"
        value = fmt(v["value"], ".2f") + "x" if isinstance(v["value"], float) else v["value"]
        log(f"{word}  {v['target']}: {value}" + (f" ({v['note']})" if v.get("note") else ""))
    if report.get("fastload_steady_scaling"):
        log(
            f"INFO  fastload 2 / 1 without epoch edges: {report['fastload_steady_scaling']:.2f}x (epoch edges: "
            f"{fmt(base['fastload'].get('max_epoch_edge_ms'), '.1f')} ms at 1, "
            f"{fmt(two.get('max_epoch_edge_ms'), '.1f')} ms at 2 per epoch)"
        )
    if "torch_scaling" in report:
        log(f"INFO  torch DataLoader 2 / 1: {report['torch_scaling']:.2f}x")
    for f in report["failures"]:
        log(f"FAILED {f}")


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = report.get("runs") or {}
    if not runs:
        return
    counts = sorted(int(n) for n in runs)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in (("fastload", "#1f77b4"), ("torch", "#999999")):
        pts = [
            (n, runs[str(n)]["aggregate"][name]["gbps"]) for n in counts if name in runs[str(n)].get("aggregate", {})
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=name)
            ax.plot([p[0] for p in pts], [pts[0][1] * p[0] / pts[0][0] for p in pts], ":", color=color, linewidth=1)
    ax.set_xticks(counts)
    ax.set_xlabel("GPUs (one process each)" if report["machine"].get("cuda_available") else "processes")
    ax.set_ylabel("aggregate GB/s (decimal)")
    ax.set_title("aggregate throughput (dotted: linear from the first point)")
    ax.legend()
    labels, values, colors = [], [], []
    for n in counts:
        for name, color in (("fastload", "#1f77b4"), ("torch", "#999999")):
            a = runs[str(n)].get("aggregate", {}).get(name)
            if a:
                for k, v in enumerate(a["per_rank_samples_per_s"]):
                    labels.append(f"{n}: {name} r{k}")
                    values.append(v)
                    colors.append(color)
    bx.bar(range(len(values)), values, color=colors)
    bx.set_xticks(range(len(values)), labels, rotation=60, fontsize=7)
    bx.set_ylabel("samples/s per rank")
    bx.set_title("per-rank samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# --imagenet: examples/imagenet.py at 1 and 2 GPUs
# --------------------------------------------------------------------------------------------
def imagenet_driver(args) -> int:
    """examples/imagenet.py under torchrun at each of --gpus, for each of --imagenet-loaders
    (default fastload and synthetic: the model's own DDP scaling, with no input pipeline)."""
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cuda, counts, skipped = usable_counts(args)
    from torch_fastload.vision.sample_data import make_image_folder

    sample = dict(
        classes=args.imagenet_classes,
        train_per_class=args.imagenet_per_class,
        val_per_class=args.imagenet_val_per_class,
    )
    log(f"imagenet: {sample['classes']} classes x {sample['train_per_class']} train images under {args.imagenet_dir}")
    t0 = time.perf_counter()
    make_image_folder(
        str(args.imagenet_dir),
        sample["classes"],
        sample["train_per_class"],
        sample["val_per_class"],
        progress=not args.no_progress,
    )
    log(f"  dataset ready in {time.perf_counter() - t0:.1f} s")
    train_images = sample["classes"] * sample["train_per_class"]
    report = {
        "kind": "imagenet",
        "machine": machine_info(cuda),
        "args": {k: str(v) for k, v in vars(args).items()},
        "train_images": train_images,
        "runs": [],
        "failures": [],
        "skipped_gpu_counts": skipped,
        "page_cache": "hot: the folder is generated (or read by an earlier run) first",
        "gpu_topology": gpu_topology(cuda),
    }
    checkpoints = Path(str(args.imagenet_dir) + "-checkpoints")  # not under --out: ResNet-50 is 100 MB
    for loader in args.imagenet_loaders:
        for n in counts:
            tag = f"{loader}-{n}gpu"
            json_path = args.out / f"ddp_imagenet-{tag}.json"
            json_path.unlink(missing_ok=True)
            steps_per_epoch = train_images // (args.imagenet_batch * n)
            if steps_per_epoch < 1:
                report["failures"].append(
                    {"gpus": n, "loader": loader, "error": f"{train_images} images < one global batch"}
                )
                continue
            epochs = math.ceil(args.imagenet_steps / steps_per_epoch)  # whole epochs: no epoch cut short
            script = [
                str(REPO / "examples" / "imagenet.py"),
                "--arch",
                args.imagenet_arch,
                "--loader",
                loader,
                "--batch-size",
                str(args.imagenet_batch),
                "--sample-dir",
                str(args.imagenet_dir),
                "--sample-classes",
                str(sample["classes"]),
                "--sample-train-per-class",
                str(sample["train_per_class"]),
                "--sample-val-per-class",
                str(sample["val_per_class"]),
                "--epochs",
                str(epochs),
                "--warmup-steps",
                str(args.imagenet_warmup_steps),
                "--no-val",
                "--no-progress",
                "--checkpoint-dir",
                str(checkpoints),
                "--workers",
                str(args.torch_workers),
                "--json",
                str(json_path),
            ]
            if not cuda:
                script.append("--no-amp")
            log(f"-- {loader}, {n} {_units(n, cuda)}: {epochs} epochs of {steps_per_epoch} steps")
            t1 = time.perf_counter()
            rc = launch(torchrun_cmd(n, script), args.out / f"ddp_imagenet-{tag}.log", args.run_timeout, f"[{n}] ")
            if rc != 0 or not json_path.exists():
                report["failures"].append({"gpus": n, "loader": loader, "rc": rc, "error": "failed (see the log)"})
                continue
            result = json.loads(json_path.read_text())
            result.update(
                gpus=n, process_seconds=time.perf_counter() - t1, steps_per_epoch=steps_per_epoch, epochs=epochs
            )
            report["runs"].append(result)
    by = {(r["loader"], r["gpus"]): r for r in report["runs"]}
    rows = []
    for (loader, n), r in sorted(by.items()):
        one, synthetic = by.get((loader, 1)), by.get(("synthetic", n))
        r["vs_1"] = r["train_images_per_s"] / one["train_images_per_s"] if one and one["train_images_per_s"] else None
        r["step_vs_synthetic"] = r["step_ms"] / synthetic["step_ms"] if synthetic and synthetic["step_ms"] else None
        rows.append(
            [
                n,
                r["arch"],
                loader,
                f"{r['train_images_per_s']:,.0f}",
                f"{r['train_images_per_s'] / n:,.0f}",
                fmt(r["step_ms"], ".1f"),
                fmt(r["step_vs_synthetic"], ".3f") + "x",
                fmt(100 * r["input_wait_fraction"], ".1f") + "%",
                r.get("timed_steps", "-"),
                fmt(r["vs_1"], ".2f") + "x",
            ]
        )
    log("")
    log(
        table(
            [
                "GPUs",
                "model",
                "loader",
                "train img/s",
                "per GPU",
                "step ms",
                "step vs synthetic",
                "input wait",
                "timed steps",
                "vs 1",
            ],
            rows,
            title=f"examples/imagenet.py under torchrun, batch {args.imagenet_batch} per GPU, "
            f"{train_images} train images",
        )
    )
    report["scaling"] = {}
    for loader in args.imagenet_loaders:
        two = by.get((loader, 2))
        if two and two.get("vs_1"):
            report["scaling"][loader] = two["vs_1"]
            log(f"INFO  {loader}: 2-GPU / 1-GPU aggregate train images/s {two['vs_1']:.2f}x (ideal 2.00x)")
    for f in report["failures"]:
        log(f"FAILED {f}")
    report["elapsed_s"] = time.perf_counter() - began
    write_json(args.out / "ddp_imagenet.json", report)
    log(f"elapsed {report['elapsed_s']:.0f} s; wrote {args.out / 'ddp_imagenet.json'}")
    return 1 if report["failures"] else 0


# --------------------------------------------------------------------------------------------
def loader_list(text: str) -> list:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or set(names) - {"fastload", "torch", "synthetic"}:
        raise argparse.ArgumentTypeError(f"expected names among fastload, torch, synthetic, got {text!r}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--driver", action="store_true", help="launch torchrun for each of --gpus and compare")
    p.add_argument(
        "--imagenet",
        action="store_true",
        help="driver for examples/imagenet.py under torchrun at each of --gpus (instead of the loader)",
    )
    p.add_argument("--gpus", type=positive_int_list, default=[1, 2], help="driver: process counts (default 1,2)")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny data, device cpu, gloo, ids recorded")
    p.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "data-ddp")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    p.add_argument("--json", type=Path, help="worker: where rank 0 writes its JSON (default OUT/ddp_scaling-wN.json)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--gib", type=float, default=None, help="data size (default 8 on a GPU, 0.05 on the CPU)")
    p.add_argument("--row-kib", type=float, default=192.0, help="bytes per sample (features row), KiB")
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--epochs", type=int, default=20, help="timed fastload epochs (after one warmup epoch)")
    p.add_argument("--torch-workers", type=int, default=8, help="num_workers of the torch baseline, per rank")
    p.add_argument("--torch-epochs", type=int, default=1, help="epochs of the torch baseline (0: skip it)")
    p.add_argument("--compute-ms", type=float, default=0.0, help="GEMM time a batch on the GPU (0: loader only)")
    p.add_argument("--io-mode", default=None)
    p.add_argument("--map-budget", default=None)
    p.add_argument("--io-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify-batches",
        type=int,
        default=1,
        help="rows of the first N batches of each untimed epoch are checked against the file",
    )
    p.add_argument("--verify-all", action="store_true", help="check every batch (timed ones too)")
    p.add_argument("--record-ids", action="store_true", help="write every rank's ids, per epoch, in the JSON")
    p.add_argument("--run-timeout", type=float, default=540, help="driver: seconds per launch")
    g = p.add_argument_group("--imagenet")
    g.add_argument("--imagenet-arch", default="resnet50")
    g.add_argument(
        "--imagenet-loaders",
        type=loader_list,
        default=["fastload", "synthetic"],
        help="comma-separated: fastload, torch, synthetic (the model alone, no input pipeline)",
    )
    g.add_argument("--imagenet-batch", type=int, default=256, help="per GPU")
    g.add_argument(
        "--imagenet-steps", type=int, default=240, help="optimizer steps per run, at least (rounded up to whole epochs)"
    )
    g.add_argument("--imagenet-warmup-steps", type=int, default=20, help="steps left out of the figures")
    g.add_argument("--imagenet-classes", type=int, default=100)
    g.add_argument("--imagenet-per-class", type=int, default=128, help="train images per class")
    g.add_argument("--imagenet-val-per-class", type=int, default=2)
    g.add_argument("--imagenet-dir", type=Path, default=REPO / "benchmarks" / "out" / "imagenet-sample-ddp")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.cpu_smoke
    if args.cpu_smoke:
        args.device = "cpu"
        args.gib = args.gib if args.gib is not None else 200 * 4096 / GiB
        args.row_kib = 4.0 if args.row_kib == 192.0 else args.row_kib
        args.batch = 8 if args.batch == 256 else args.batch
        args.epochs = min(args.epochs, 2)
        args.torch_workers = min(args.torch_workers, 1)
        args.record_ids = args.verify_all = True
        args.imagenet_arch, args.imagenet_batch, args.imagenet_steps = "resnet18", 4, 4
        args.imagenet_warmup_steps, args.imagenet_classes, args.imagenet_per_class = 1, 3, 4
        args.torch_workers = 0 if args.imagenet else args.torch_workers
    if args.gib is None:
        args.gib = 8.0 if cuda else 0.05
    if args.json is None and not (args.driver or args.imagenet):
        args.json = args.out / f"ddp_scaling-w{os.environ.get('WORLD_SIZE', '1')}.json"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.imagenet:
        return imagenet_driver(args)
    if args.driver:
        return driver(args)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
