#!/usr/bin/env python3
"""DDP scaling of the torch_fastload file loader: aggregate samples/s and GB/s at 1, 2, ... GPUs
(one process a GPU, DistributedSampler sharding), against torch's DataLoader in the same run.

Data (written once under --dir): features.npy float32 rows of --row-kib (192 KiB, the rows of
file_loader.py), --gib in all; labels.npy; ids.npy (row i holds i). Every rank counts the ids it
received on its device and the counts are all-reduced: an exact check that the ranks together
covered every sample once per epoch. Each rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK; a
plain run is rank 0 of 1) uses cuda:LOCAL_RANK with nccl, or the CPU with gloo, and measures
  fastload  torch_fastload.DataLoader(sampler=DistributedSampler): one untimed epoch (rows
            checked against the file), then --epochs timed
  torch     DataLoader(sampler=..., num_workers=--torch-workers, pin_memory=True) + .to(device),
            --torch-epochs epochs timed after the first 2 batches
The consumer uses every batch on the device (one index_add_ of its ids; optionally --compute-ms
of GEMMs). Per rank: samples/s, GB/s, input wait, CPU cores, the epoch edges (iter() to the
first batch, the last batch to the iterator gone). Aggregate: the sum of samples over the
slowest rank's wall time; "steady" leaves the epoch edges out.
--imagenet: examples/imagenet.py (ResNet-50, batch 256 a GPU, bf16, a generated folder, page
cache hot) for whole epochs totalling >= --imagenet-steps, fed by fastload and by synthetic
device-resident batches (the model's own DDP scaling).
Target: fastload at 2 GPUs >= 1.9x its 1-GPU samples/s where the page cache holds the data.

    python benchmarks/ddp_scaling.py --driver --gpus 1,2       # 1 and 2 GPUs and the ratio (~1 min + data)
    torchrun --nproc-per-node 2 benchmarks/ddp_scaling.py      # one measurement, 2 GPUs
    python benchmarks/ddp_scaling.py --imagenet --gpus 1,2     # examples/imagenet.py at 1 and 2 GPUs
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data as tud

import torch_fastload
from torch_fastload._benchutil import (
    GiB,
    Study,
    cpu_seconds,
    fmt,
    gemm_seconds,
    log,
    machine_info,
    parse_study,
    positive_int_list,
    random_npy,
    residency_of,
    run_quiet,
    study_parser,
    sync,
    table,
    warm_page_cache,
    write_json,
)
from torch_fastload.sources import ArrayDataset

REPO = Path(__file__).resolve().parents[1]
ROW_MULTIPLE = 8  # rows are a multiple of this, so 1, 2, 4 and 8 ranks shard them without padding
SCALING_TARGET = 1.9


def make_data(args) -> list[Path]:
    """features.npy, labels.npy, ids.npy under ``args.dir`` (kept while their shapes match)."""
    row_bytes = int(args.row_kib * 1024) // 4 * 4
    rows = max(4 * ROW_MULTIPLE, int(args.gib * GiB) // row_bytes // ROW_MULTIPLE * ROW_MULTIPLE)
    args.dir.mkdir(parents=True, exist_ok=True)
    paths = [args.dir / f"{name}.npy" for name in ("features", "labels", "ids")]
    random_npy(paths[0], (rows, row_bytes // 4), seed=args.seed, progress=args.progress)
    for path, make in zip(
        paths[1:], (lambda: np.random.default_rng(1).integers(0, 1000, rows), lambda: np.arange(rows))
    ):
        if not path.exists() or np.load(path, mmap_mode="r").shape != (rows,):
            np.save(path, make())
    return paths


class Dist:
    """Rank, world, device and the few collectives the benchmark needs (no-ops in one process)."""

    def __init__(self, device: torch.device):
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.device, self.backend = device, None
        if self.world > 1:
            self.backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(self.backend, **({"device_id": device} if device.type == "cuda" else {}))
        self.reduce_device = device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self.backend:
            dist.barrier(**({"device_ids": [self.device.index]} if self.backend == "nccl" else {}))

    def reduce(self, values: list, op=dist.ReduceOp.SUM) -> list:
        if not self.backend:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.reduce_device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend:
            t = t.to(self.reduce_device)
            dist.all_reduce(t)
        return t

    def gather(self, obj) -> list:
        if not self.backend:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


class Consumer:
    """Uses each batch on the device: counts every id it received (one index_add_, no host sync),
    optionally runs --compute-ms of GEMMs, and checks rows against the file when asked."""

    def __init__(self, rows: int, device: torch.device, args, features: Path):
        self.device, self.record_ids = device, args.record_ids
        self.seen = torch.zeros(rows, dtype=torch.int32, device=device)
        self.ones = torch.ones(0, dtype=torch.int32, device=device)
        self.features = np.load(features, mmap_mode="r")
        self.finished, self.epoch, self.gemm, self.sink = [], None, None, None
        if args.compute_ms > 0 and device.type == "cuda":
            a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
            self.gemm = (a, max(1, round(args.compute_ms / (1e3 * gemm_seconds(a, a, warmup=3)))))

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = {"epoch": epoch, "seen": self.seen.clone(), "ids": []}

    def end_epoch(self) -> None:
        """The epoch's id figures stay on the device: no host sync at the edge (a training loop
        need not have one there either); ``epoch_figures()`` reads them after the run."""
        delta = (self.seen - self.epoch["seen"]).to(torch.int64)
        index = torch.arange(delta.numel(), device=self.device)
        figures = torch.stack([delta.sum(), (delta * index).sum(), (delta * index * index).sum(), (delta > 1).sum()])
        self.finished.append((self.epoch["epoch"], figures, self.epoch["ids"]))

    def epoch_figures(self) -> list:
        out = []
        for epoch, figures, ids in self.finished:
            entry = dict(zip(("count", "id_sum", "id_sq_sum", "repeated"), figures.tolist()), epoch=epoch)
            if self.record_ids:
                entry["ids"] = [i for chunk in ids for i in chunk]
            out.append(entry)
        self.finished = []
        return out

    def __call__(self, batch, verify: bool) -> tuple[int, int]:
        x, _labels, ids = batch
        n = ids.numel()
        if self.ones.numel() < n:
            self.ones = torch.ones(n, dtype=torch.int32, device=self.device)
        self.seen.index_add_(0, ids, self.ones[:n])  # after the batch's event: every field arrived
        if self.record_ids:
            self.epoch["ids"].append(ids.tolist())
        if self.gemm is not None:
            a, reps = self.gemm
            c = a
            for _ in range(reps):
                c = c @ a
            self.sink = c[0, :1]
        if verify:
            index = ids.cpu().numpy()
            want = np.asarray(self.features[index]).reshape(n, -1).view(np.uint8)
            if not np.array_equal(x.reshape(n, -1).cpu().numpy().view(np.uint8), want):
                raise AssertionError(f"delivered rows differ from the file (ids {index[:4].tolist()}...)")
        return n, sum(t.numel() * t.element_size() for t in batch)


def run_loader(
    name, loader, sampler, ctx: Dist, args, consumer: Consumer, epochs: int, timed_from: int, move: bool
) -> dict:
    """``epochs`` epochs (set_epoch before each iter, the iterator dropped at the end as a for loop
    drops it); the clock starts after a barrier at global batch ``timed_from`` and stops after
    the last batch, synchronized. Epoch edges are timed apart too."""
    samples = nbytes = batches = done = edges = 0
    wait = first_batch = teardown = 0.0
    started = None

    def start_clock() -> tuple[float, float]:
        sync(ctx.device)
        ctx.barrier()
        return time.perf_counter(), cpu_seconds(reaped=True)

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        consumer.begin_epoch(epoch)
        if started is None and done == timed_from:  # before iter(): an epoch's start-up is timed work
            started, cpu0 = start_clock()
        timed_epoch, t_iter, in_epoch = started is not None, time.perf_counter(), 0
        it = iter(loader)
        while True:
            if started is None and done == timed_from:
                started, cpu0 = start_clock()
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            batch = [t.to(ctx.device, non_blocking=True) for t in batch] if move else batch
            t1 = time.perf_counter()
            first_batch += t1 - t_iter if in_epoch == 0 and timed_epoch else 0.0
            n, b = consumer(batch, args.verify_all or (started is None and in_epoch < args.verify_batches))
            if started is not None:
                samples, nbytes, batches, wait = samples + n, nbytes + b, batches + 1, wait + t1 - t0
            done, in_epoch, t_last = done + 1, in_epoch + 1, time.perf_counter()
        del it  # as a for loop drops it: the pipeline (or torch's workers) shuts down here
        if timed_epoch and in_epoch:
            teardown, edges = teardown + time.perf_counter() - t_last, edges + 1
        consumer.end_epoch()
    sync(ctx.device)
    if started is None:
        raise RuntimeError(f"{name}: {done} batches, the clock never started (timed from batch {timed_from})")
    wall, cpu = time.perf_counter() - started, cpu_seconds(reaped=True) - cpu0
    gc.collect()
    return {
        "name": name,
        "epochs": epochs,
        "batches": batches,
        "samples": samples,
        "bytes": nbytes,
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "gbps": nbytes / wall / 1e9,
        "input_wait_fraction": wait / wall,
        "cores": cpu / wall,
        "first_batch_s": first_batch,
        "teardown_s": teardown,
        "epoch_edge_ms": 1e3 * (first_batch + teardown) / edges if edges else None,
    }


def coverage(ctx: Dist, consumer: Consumer, rows: int, epochs: int) -> dict:
    """All ranks' id counts summed: every sample ``epochs`` times (exact), or padded where
    DistributedSampler repeats a few samples to even out the shards."""
    seen = ctx.reduce_tensor(consumer.seen).to(torch.int64)
    padded_rows = math.ceil(rows / ctx.world) * ctx.world
    low, high, total = int(seen.min()), int(seen.max()), int(seen.sum())
    exact = low == high == epochs
    padded = not exact and low == epochs and total == epochs * padded_rows
    consumer.seen.zero_()
    status = "exact" if exact else f"padded ({padded_rows - rows} repeats an epoch)" if padded else "WRONG"
    return {
        "epochs": epochs,
        "rows": rows,
        "min_count": low,
        "max_count": high,
        "total": total,
        "status": status,
        "ok": exact or padded,
    }


def measure_rank(args, ctx: Dist, paths: list[Path]) -> tuple[dict, dict, int]:
    """This rank's fastload and torch runs: figures, coverage, and the number of rows."""
    ds = ArrayDataset(*[str(p) for p in paths])
    sampler = torch_fastload.DistributedSampler(ds, num_replicas=ctx.world, rank=ctx.rank, shuffle=True, seed=args.seed)
    consumer = Consumer(len(ds), ctx.device, args, paths[0])
    io = {k: getattr(args, k) for k in ("io_mode", "map_budget", "io_threads") if getattr(args, k) is not None}
    runs, coverages = {}, {}
    # no try/except: a rank that fails exits and torchrun stops the others (one carrying on
    # alone would wait in the next collective)
    loader = torch_fastload.DataLoader(ds, batch_size=args.batch, sampler=sampler, device=ctx.device, **io)
    try:
        runs["fastload"] = run_loader(
            "fastload", loader, sampler, ctx, args, consumer, 1 + args.epochs, len(loader), False
        )
        stats = loader.stats()
        runs["fastload"].update(io=str(loader.io), io_bytes=dict(stats.io_bytes), pool_bytes=stats.pool_bytes)
    finally:
        loader.close()
    coverages["fastload"] = coverage(ctx, consumer, len(ds), 1 + args.epochs)
    runs["fastload"]["id_stats"] = consumer.epoch_figures()
    if args.torch_epochs > 0:
        w, cuda = args.torch_workers, ctx.device.type == "cuda"
        loader = tud.DataLoader(
            ds, args.batch, sampler=sampler, num_workers=w, pin_memory=cuda, prefetch_factor=4 if w else None
        )
        runs["torch"] = run_loader(
            f"torch w{w}", loader, sampler, ctx, args, consumer, args.torch_epochs, min(2, len(loader) - 1), True
        )
        coverages["torch"] = coverage(ctx, consumer, len(ds), args.torch_epochs)
        runs["torch"]["id_stats"] = consumer.epoch_figures()
    return runs, coverages, len(ds)


def worker(args) -> int:
    ctx = Dist(args.device)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        args.progress = args.progress and ctx.rank == 0
        make_data(args)
    ctx.barrier()
    paths = [args.dir / f"{name}.npy" for name in ("features", "labels", "ids")]
    resident = residency_of(paths)
    runs, coverages, rows = measure_rank(args, ctx, paths)
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
    mine = {
        "rank": ctx.rank,
        "host": socket.gethostname(),
        "device": str(ctx.device),
        "gpu": gpu,
        "resident_before": resident,
        "runs": runs,
    }
    everyone = ctx.gather(mine)
    aggregate = {}
    for name, run in runs.items():  # every rank ran the same loaders
        samples, nbytes, wait, cores = ctx.reduce(
            [run["samples"], run["bytes"], run["input_wait_fraction"], run["cores"]]
        )
        inner = run["wall_s"] - run["first_batch_s"] - run["teardown_s"]
        wall, inner, edge = ctx.reduce([run["wall_s"], inner, run["epoch_edge_ms"] or 0.0], dist.ReduceOp.MAX)
        aggregate[name] = {
            "world": ctx.world,
            "samples_per_s": samples / wall,
            "gbps": nbytes / wall / 1e9,
            "steady_samples_per_s": samples / inner if inner > 0 else None,  # without the epoch edges
            "max_epoch_edge_ms": edge if run["epoch_edge_ms"] is not None else None,
            "mean_input_wait_fraction": wait / ctx.world,
            "cores": cores,
            "per_rank_samples_per_s": [r["runs"][name]["samples_per_s"] for r in everyone],
            "coverage": coverages[name],
        }
    if ctx.rank == 0:
        report = {"world_size": ctx.world, "backend": ctx.backend, "machine": machine_info(ctx.device.type == "cuda")}
        report.update(args=vars(args), rows=rows, resident_before=[r["resident_before"] for r in everyone])
        report.update(ranks=everyone, aggregate=aggregate)
        report["failures"] = [
            {"what": f"{n} coverage", "error": a["coverage"]["status"]}
            for n, a in aggregate.items()
            if not a["coverage"]["ok"]
        ]
        print_worker(report)
        write_json(args.json, report)
    if ctx.backend:
        dist.destroy_process_group()
    return 1 if any(not a["coverage"]["ok"] for a in aggregate.values()) else 0


def print_worker(report: dict) -> None:
    rows = []
    for r in report["ranks"]:
        for name, run in r["runs"].items():
            io = (
                max(run["io_bytes"], key=run["io_bytes"].get) if run.get("io_bytes") else "-"
            )  # the path that moved most
            rows.append([f"rank {r['rank']} {name}", r["device"], f"{run['samples_per_s']:,.0f}", fmt(run["gbps"])])
            rows[-1] += [
                fmt(100 * run["input_wait_fraction"], ".1f") + "%",
                fmt(run["cores"], ".1f"),
                fmt(run["wall_s"]),
                fmt(run["epoch_edge_ms"], ".1f"),
                io,
            ]
    for name, a in report["aggregate"].items():
        rows.append(
            [
                f"all {name}",
                f"x{a['world']}",
                f"{a['samples_per_s']:,.0f}",
                fmt(a["gbps"]),
                fmt(100 * a["mean_input_wait_fraction"], ".1f") + "%",
            ]
        )
        rows[-1] += [fmt(a["cores"], ".1f"), "", fmt(a["max_epoch_edge_ms"], ".1f"), a["coverage"]["status"]]
    heads = ["run", "device", "samples/s", "GB/s", "input wait", "cores", "wall s", "edge ms/epoch", "io / coverage"]
    log(
        table(
            heads, rows, f"world {report['world_size']}: per rank, then aggregate (sum of samples / the slowest wall)"
        )
    )


def launch(cmd: list, log_path: Path, timeout: float, prefix: str) -> int:
    """Run ``cmd`` in its own session, echo its output (prefixed) and keep it in ``log_path``; on
    timeout stop that process group (only what this launched)."""
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
                print(f"{prefix}{line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{prefix}timed out after {timeout:.0f} s: stopping it")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
        reader.join(timeout=10)
    return rc


def torchrun(n: int, script: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *script]


def counts(args) -> list[int]:
    """The --gpus this machine has (the others are skipped, and said so), or CPU processes."""
    if args.device.type != "cuda":
        return list(args.gpus)
    have = torch.cuda.device_count()
    for n in (n for n in args.gpus if n > have):
        log(f"skipping {n} GPUs: this machine has {have}")
    return [n for n in args.gpus if n <= have]


def driver(study: Study, args) -> str:
    paths = make_data(args)
    rows = np.load(paths[2], mmap_mode="r").shape[0]
    study["data"] = {"rows": rows, "bytes": os.path.getsize(paths[0]), "dir": str(args.dir)}
    warm_page_cache(paths)  # the target is about the loader, not the disk: start hot
    study["gpu_topology"] = run_quiet(["nvidia-smi", "topo", "-m"]) if args.device.type == "cuda" else None
    study["runs"] = {}
    forward = [
        "--dir",
        args.dir,
        "--gib",
        args.gib,
        "--row-kib",
        args.row_kib,
        "--batch",
        args.batch,
        "--epochs",
        args.epochs,
    ]
    forward += [
        "--torch-workers",
        args.torch_workers,
        "--torch-epochs",
        args.torch_epochs,
        "--compute-ms",
        args.compute_ms,
    ]
    forward += [
        "--seed",
        args.seed,
        "--verify-batches",
        args.verify_batches,
        "--device",
        args.device.type,
        "--no-progress",
    ]
    forward += [
        x
        for k in ("io_mode", "map_budget", "io_threads")
        if getattr(args, k) is not None
        for x in (f"--{k.replace('_', '-')}", getattr(args, k))
    ]
    forward += [f"--{k.replace('_', '-')}" for k in ("record_ids", "verify_all") if getattr(args, k)]
    for n in counts(args):
        json_path = args.out / f"ddp_scaling-{n}gpu.json"
        json_path.unlink(missing_ok=True)
        log(f"-- {n} process(es) (page cache {fmt(residency_of(paths), '.0%')} resident)")
        script = [str(Path(__file__).resolve()), *map(str, forward), "--json", str(json_path)]
        rc = launch(torchrun(n, script), args.out / f"ddp_scaling-{n}gpu.log", args.run_timeout, f"[{n}] ")
        if not json_path.exists():
            study["failures"].append({"what": f"{n} GPUs", "error": f"exit {rc}, no JSON written (see the log)"})
            continue
        study["runs"][str(n)] = {**json.loads(json_path.read_text()), "rc": rc}
        if rc != 0:
            study["failures"].append({"what": f"{n} GPUs", "error": f"exit {rc}"})
    return summarize(study, args)


def summarize(study: Study, args) -> str:
    runs = study["runs"]
    base = runs.get("1", {}).get("aggregate", {})
    rows = []
    for n, r in sorted(runs.items(), key=lambda kv: int(kv[0])):
        for name, a in r["aggregate"].items():
            one = base.get(name)
            a["vs_1"] = a["samples_per_s"] / one["samples_per_s"] if one else None
            a["steady_vs_1"] = (
                a["steady_samples_per_s"] / one["steady_samples_per_s"] if one and a["steady_samples_per_s"] else None
            )
            for key in ("samples_per_s", "gbps", "vs_1", "max_epoch_edge_ms", "steady_vs_1"):
                study.figure(f"{key}_{name}_{n}gpu", a[key])
            per_rank = a["per_rank_samples_per_s"]
            rows.append(
                [n, name, f"{a['samples_per_s']:,.0f}", fmt(a["gbps"]), f"{min(per_rank):,.0f}-{max(per_rank):,.0f}"]
            )
            rows[-1] += [
                fmt(100 * a["mean_input_wait_fraction"], ".1f") + "%",
                fmt(a["cores"], ".1f"),
                fmt(a["vs_1"]) + "x",
            ]
            rows[-1] += [fmt(a["max_epoch_edge_ms"], ".1f"), fmt(a["steady_vs_1"]) + "x", a["coverage"]["status"]]
            rows[-1] += [fmt(min((x for x in r["resident_before"] if x is not None), default=None), ".0%")]
            if not a["coverage"]["ok"]:
                study.verdict(f"{n} x {name}: every sample once per epoch", False, a["coverage"]["status"])
    for n, r in runs.items():
        fl, th = r["aggregate"].get("fastload"), r["aggregate"].get("torch")
        if fl and th:
            study.figure(f"fastload_vs_torch_{n}gpu", fl["samples_per_s"] / th["samples_per_s"])
            study.verdict(
                f"fastload vs torch DataLoader at {n} process(es)",
                None,
                f"{fl['samples_per_s'] / th['samples_per_s']:.1f}x",
            )
    two = runs.get("2", {}).get("aggregate", {}).get("fastload")
    if two and base.get("fastload"):
        hot = all((x or 0) >= 0.99 for n in ("1", "2") for x in runs[n]["resident_before"])
        study["fastload_scaling"], study["page_cache_hot"] = two["vs_1"], hot
        judged = hot if args.device.type == "cuda" else None  # CPU processes: not meaningful
        study.verdict(
            f"fastload 2 / 1 GPU aggregate samples/s >= {SCALING_TARGET}x",
            judged and two["vs_1"] >= SCALING_TARGET,
            f"{two['vs_1']:.2f}x ({'page cache hot' if hot else 'page cache NOT hot'})",
        )
        study.verdict("fastload 2 / 1 without epoch edges", None, f"{fmt(two['steady_vs_1'])}x")
    heads = ["ranks", "loader", "agg samples/s", "agg GB/s", "per rank samples/s", "input wait", "cores", "vs 1"]
    heads += ["edge ms/epoch", "steady vs 1", "coverage", "cached"]
    return table(
        heads, rows, "aggregate = all ranks' samples / the slowest rank's wall time; steady: without epoch edges"
    )


def plot(data: dict, plt):
    runs = data["runs"]
    counts_ = sorted(int(n) for n in runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("fastload", "#1f77b4"), ("torch", "#999999")):
        pts = [(n, runs[str(n)]["aggregate"][name]["gbps"]) for n in counts_ if name in runs[str(n)]["aggregate"]]
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=name)
            ax.plot([p[0] for p in pts], [pts[0][1] * p[0] / pts[0][0] for p in pts], ":", color=color, linewidth=1)
    ax.set_xticks(counts_)
    ax.set(xlabel="GPUs (one process each)", ylabel="aggregate GB/s", title="aggregate throughput (dotted: linear)")
    ax.legend()
    fig.tight_layout()
    return fig


def imagenet_driver(study: Study, args) -> str:
    """examples/imagenet.py under torchrun at each of --gpus, fed by fastload and by synthetic
    batches (the model's own DDP scaling)."""
    from torch_fastload.vision.sample_data import make_image_folder

    classes, per_class = args.imagenet_classes, args.imagenet_per_class
    make_image_folder(str(args.imagenet_dir), classes, per_class, 2, progress=args.progress)
    study["runs"], images = [], classes * per_class
    for loader in args.imagenet_loaders.split(","):
        for n in counts(args):
            tag, steps = f"{loader}-{n}gpu", images // (args.imagenet_batch * n)
            json_path = args.out / f"ddp_imagenet-{tag}.json"
            json_path.unlink(missing_ok=True)
            epochs = math.ceil(args.imagenet_steps / max(1, steps))  # whole epochs: none cut short
            script = [str(REPO / "examples" / "imagenet.py"), "--arch", args.imagenet_arch, "--loader", loader]
            script += [
                "--batch-size",
                args.imagenet_batch,
                "--sample-dir",
                args.imagenet_dir,
                "--sample-classes",
                classes,
            ]
            script += ["--sample-train-per-class", per_class, "--sample-val-per-class", 2, "--epochs", epochs]
            script += [
                "--warmup-steps",
                args.imagenet_warmup_steps,
                "--no-val",
                "--no-progress",
                "--workers",
                args.torch_workers,
            ]
            script += [
                "--checkpoint-dir",
                f"{args.imagenet_dir}-checkpoints",
                "--json",
                json_path,
            ]  # not under --out: 100 MB
            script += [] if args.device.type == "cuda" else ["--no-amp"]
            log(f"-- {loader}, {n} process(es): {epochs} epochs of {steps} steps")
            rc = launch(
                torchrun(n, list(map(str, script))), args.out / f"ddp_imagenet-{tag}.log", args.run_timeout, f"[{n}] "
            )
            if rc != 0 or not json_path.exists():
                study["failures"].append({"what": tag, "error": f"exit {rc} (see the log)"})
                continue
            study["runs"].append(
                {**json.loads(json_path.read_text()), "gpus": n, "steps_per_epoch": steps, "epochs": epochs}
            )
    by = {(r["loader"], r["gpus"]): r for r in study["runs"]}
    rows = []
    for (loader, n), r in sorted(by.items()):
        one, synthetic = by.get((loader, 1)), by.get(("synthetic", n))
        r["vs_1"] = r["train_images_per_s"] / one["train_images_per_s"] if one else None
        r["step_vs_synthetic"] = r["step_ms"] / synthetic["step_ms"] if synthetic else None
        for key in ("train_images_per_s", "step_ms", "step_vs_synthetic", "vs_1"):
            study.figure(f"imagenet_{key}_{loader}_{n}gpu", r[key])
        rows.append(
            [
                n,
                loader,
                f"{r['train_images_per_s']:,.0f}",
                f"{r['train_images_per_s'] / n:,.0f}",
                fmt(r["step_ms"], ".1f"),
            ]
        )
        rows[-1] += [
            fmt(r["step_vs_synthetic"], ".3f") + "x",
            fmt(100 * r["input_wait_fraction"], ".1f") + "%",
            fmt(r["vs_1"]) + "x",
        ]
        if n == 2 and r["vs_1"]:
            study.verdict(f"{loader}: 2 / 1 GPU aggregate train images/s (ideal 2.00x)", None, f"{r['vs_1']:.2f}x")
    heads = ["GPUs", "loader", "train img/s", "per GPU", "step ms", "step vs synthetic", "input wait", "vs 1"]
    return table(
        heads,
        rows,
        f"examples/imagenet.py ({args.imagenet_arch}) under torchrun, batch {args.imagenet_batch} a GPU, {images} img",
    )


def main(argv=None) -> int:
    p = study_parser(__doc__, REPO / "benchmarks" / "out")
    p.add_argument("--driver", action="store_true", help="launch torchrun for each of --gpus and compare")
    p.add_argument("--imagenet", action="store_true", help="the driver for examples/imagenet.py instead of the loader")
    p.add_argument("--gpus", type=positive_int_list, default=[1, 2], help="driver: process counts")
    p.add_argument("--dir", type=Path, help="data directory [OUT/data-ddp]")
    p.add_argument("--gib", type=float, help="data size [8; quick 4; cpu 0.0008]")
    p.add_argument("--row-kib", type=float, help="KiB a sample [192; cpu 4]")
    p.add_argument("--batch", type=int, help="a rank's batch [256; cpu 8]")
    p.add_argument("--epochs", type=int, help="timed fastload epochs after an untimed one [20; quick 10; cpu 2]")
    p.add_argument("--torch-workers", type=int, help="torch baseline num_workers a rank [8; cpu 1]")
    p.add_argument("--torch-epochs", type=int, default=1, help="epochs of the torch baseline (0: none)")
    p.add_argument("--compute-ms", type=float, default=0.0, help="GEMM time a batch on the GPU (0: loader only)")
    p.add_argument("--io-mode")
    p.add_argument("--map-budget")
    p.add_argument("--io-threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-batches", type=int, default=1, help="rows of an untimed epoch's first N batches checked")
    p.add_argument("--verify-all", action="store_true", help="check every batch (timed ones too)")
    p.add_argument("--record-ids", action="store_true", help="every rank's ids, per epoch, in the JSON")
    p.add_argument("--run-timeout", type=float, default=540, help="driver: seconds a launch")
    g = p.add_argument_group("--imagenet")
    g.add_argument("--imagenet-arch", help="[resnet50; cpu resnet18]")
    g.add_argument("--imagenet-loaders", default="fastload,synthetic", help="of fastload, torch, synthetic")
    g.add_argument("--imagenet-batch", type=int, help="a GPU's batch [256; cpu 4]")
    g.add_argument("--imagenet-steps", type=int, help="optimizer steps a run, at least (whole epochs) [240; cpu 4]")
    g.add_argument("--imagenet-warmup-steps", type=int, help="steps left out of the figures [20; cpu 1]")
    g.add_argument("--imagenet-classes", type=int, help="[100; cpu 3]")
    g.add_argument("--imagenet-per-class", type=int, help="train images a class [128; cpu 4]")
    g.add_argument("--imagenet-dir", type=Path, help="[OUT/imagenet-sample-ddp]")
    args = parse_study(
        p,
        argv,
        gib=(8.0, 4.0, 200 * 4096 / GiB),
        row_kib=(192.0, 192.0, 4.0),
        batch=(256, 256, 8),
        epochs=(20, 10, 2),
        torch_workers=(8, 8, 1),
        imagenet_arch=("resnet50", "resnet50", "resnet18"),
        imagenet_batch=(256, 256, 4),
        imagenet_steps=(240, 240, 4),
        imagenet_warmup_steps=(20, 20, 1),
        imagenet_classes=(100, 100, 3),
        imagenet_per_class=(128, 128, 4),
    )
    args.dir = args.dir or args.out / "data-ddp"
    args.imagenet_dir = args.imagenet_dir or args.out / "imagenet-sample-ddp"
    if args.device.type == "cpu":
        args.record_ids = args.verify_all = True
        args.torch_workers = 0 if args.imagenet else args.torch_workers
    if not (args.driver or args.imagenet):
        args.json = args.json or args.out / f"ddp_scaling-w{os.environ.get('WORLD_SIZE', '1')}.json"
        return worker(args)
    name = "ddp_imagenet" if args.imagenet else "ddp_scaling"
    study = Study(
        name, args, f"DDP scaling ({'examples/imagenet.py' if args.imagenet else 'file loader'}), {args.gpus} processes"
    )
    text = study.attempt(name, imagenet_driver if args.imagenet else driver, study, args)
    return study.finish(text or "", plot=plot if not args.imagenet and study.get("runs") else None)


if __name__ == "__main__":
    sys.exit(main())
