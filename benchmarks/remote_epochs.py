"""benchmarks/remote.py's loader runs: the capped cells' loader row (torch_fastload.DataLoader
reading the object in order, what the cap verdict judges), and the epochs of an ArrayDataset
read remotely, from the shard cache (cache hit) and from the local file, taken in turns."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch

from torch_fastload import ArrayDataset, ArrayFile, DataLoader, config, remote
from torch_fastload._benchutil import log

BUCKET, ROWS_KEY = "bench", "rows.npy"
ROW_FLOATS = 16384  # 64 KiB rows for the loader epochs
LOADER_ROW = 1 << 20  # the loader row's records: 1 MiB rows of the object, so a batch is one range


def loader_cell(url: str, size: int, concurrency: int, request_size: int, min_seconds: float, device, batch: int):
    """``(GB/s, client CPU s/GB)`` of torch_fastload.DataLoader over the object as 1 MiB rows
    (``ArrayFile.raw``) in order, ``batch`` bytes a batch (one range: a shard read in order),
    with ``remote_concurrency`` x ``remote_request_size`` = ``concurrency`` x ``request_size``
    and every other setting the defaults (the read-ahead among them): what a training loop gets.
    The epoch cycles over the object; the steady state is timed, ``min_seconds`` after a
    warm-up of ``remote_read_ahead`` + one batch of bytes (at most ``2 x min_seconds``): the
    read-ahead's buffers made, and as many bytes landed ahead of the consumer at the window's
    start as at its end (from the first batch on, the bytes the read-ahead received before it,
    shared with that batch's requests, were counted as if they had come in the window);
    then the iterator is dropped."""
    rows = size // LOADER_ROW
    per_batch = max(1, min(rows, batch // LOADER_ROW))
    order = list(range(rows)) * 10_000  # more passes than any cell lasts
    dataset = ArrayDataset(ArrayFile.raw(url, np.uint8, (LOADER_ROW,)))
    with config.override(remote_concurrency=concurrency, remote_request_size=request_size):
        warm_bytes = config.get("remote_read_ahead") + per_batch * LOADER_ROW
        loader = DataLoader(dataset, batch_size=per_batch, sampler=order, device=device)
        iterator = iter(loader)
        try:
            warmed, started = 0, time.perf_counter()
            for got in iterator:
                warmed += got.numel()
                if warmed >= warm_bytes or time.perf_counter() - started >= 2 * min_seconds:
                    break
            moved, started, cpu = 0, time.perf_counter(), time.process_time()
            for got in iterator:
                moved += got.numel()
                if time.perf_counter() - started >= min_seconds:
                    break
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - started
            return moved / elapsed / 1e9, (time.process_time() - cpu) / (moved / 1e9)
        finally:
            del iterator
            loader.close()


def interleaved_epochs(datasets: dict, device, batch: int, epochs: int) -> dict:
    """``name -> {gbps, steady_gbps, first_s, start_s, io (bytes per path), path, io_path}`` over
    ``epochs`` epochs of each dataset, taken in turns after a warm-up epoch each (short epochs on
    a shared machine: turns and sums, not one epoch). ``gbps`` over the stats' wall time (first
    next() to the last batch); ``steady_gbps`` from the first batch on (what the read path
    sustains, without the epoch's start); ``first_s``: the mean wait for an epoch's first batch
    (a cached epoch's check of its objects shows here); ``start_s``: the mean time of iter()."""
    loaders = {name: DataLoader(ds, batch_size=batch, shuffle=True, device=device) for name, ds in datasets.items()}
    keys = ("bytes", "wall", "steady_bytes", "steady_wall", "first", "start")
    totals = {name: dict.fromkeys(keys, 0.0) | {"io": {}} for name in loaders}
    described = {}
    try:
        for epoch in range(epochs + 1):
            for name, loader in loaders.items():
                started = time.perf_counter()
                iterator = iter(loader)
                begun = time.perf_counter()
                first = next(iterator)
                first_s = time.perf_counter() - begun
                for _ in iterator:
                    pass
                stats = loader.stats(reset=True)
                described[name] = {"path": stats.path, "io_path": stats.io}
                if not epoch:
                    continue
                t = totals[name]
                t["bytes"] += stats.bytes
                t["wall"] += stats.wall_s
                t["steady_bytes"] += stats.bytes - first.numel() * first.element_size()
                t["steady_wall"] += max(0.0, stats.wall_s - first_s)
                t["first"] += first_s
                t["start"] += begun - started
                for path, n in stats.io_bytes.items():
                    t["io"][path] = t["io"].get(path, 0) + n
    finally:
        for loader in loaders.values():
            loader.close()
    return {
        name: {
            "gbps": t["bytes"] / t["wall"] / 1e9 if t["wall"] else 0.0,
            "steady_gbps": t["steady_bytes"] / t["steady_wall"] / 1e9 if t["steady_wall"] else 0.0,
            "first_s": t["first"] / max(1, epochs),
            "start_s": t["start"] / max(1, epochs),
            "io": t["io"],
            **described[name],
        }
        for name, t in totals.items()
    }


def loader_epochs(server, root: Path, args, device) -> dict:
    server.control(latency=min(args.latencies), bandwidth=0)
    url = f"s3://{BUCKET}/{ROWS_KEY}"
    cache_dir = args.dir / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    out = {"device": str(device), "rows": ROW_FLOATS * 4, "batch": args.batch, "epochs": args.epochs}
    measured = interleaved_epochs({"remote": ArrayDataset(url)}, device, args.batch, 1)
    remote.cache_objects([url], str(cache_dir))
    datasets = {
        "cache": ArrayDataset(url, cache_dir=str(cache_dir)),
        "local": ArrayDataset(str(root / BUCKET / ROWS_KEY)),
    }
    measured.update(interleaved_epochs(datasets, device, args.batch, args.epochs))
    for name, result in measured.items():
        for key, value in result.items():
            out[f"{name}_{key}"] = value
    out["cache_over_local"] = out["cache_steady_gbps"] / out["local_steady_gbps"]
    out["cache_over_local_whole_epoch"] = out["cache_gbps"] / out["local_gbps"]
    log(
        f"  loader epochs on {device}: remote {out['remote_gbps']:.3f} GB/s (latency "
        f"{min(args.latencies) * 1e3:.0f} ms, uncapped), cache hit {out['cache_steady_gbps']:.3f} GB/s, local file "
        f"{out['local_steady_gbps']:.3f} GB/s from the first batch on ({args.epochs} epochs each, in turns) -> "
        f"cache/local {out['cache_over_local']:.2f}x; whole epochs {out['cache_gbps']:.3f} / {out['local_gbps']:.3f} "
        f"GB/s -> {out['cache_over_local_whole_epoch']:.2f}x; first batch {out['cache_first_s'] * 1e3:.1f} ms "
        f"(cache hit: waits for the HEAD of its objects) vs {out['local_first_s'] * 1e3:.1f} ms (local)"
    )
    for name in ("cache", "local"):
        log(f"    {name}: {out[f'{name}_path']}; {out[f'{name}_io_path']}")
    return out
