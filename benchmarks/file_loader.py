#!/usr/bin/env python3
"""torch_fastload file loader: an epoch over a multi-GB .npy dataset and a packed-record dataset,
file -> GPU, against torch's DataLoader, kvikio, the link and the disk, all in the same run.

Data (generated once under --dir, reused while the sizes match; random bytes, never zeros):
  arrays   features.npy float32 (N, 3, 128, 128) = 192 KiB rows (--array-gib, default 4 GiB)
           + labels.npy int64: a sample is one row of each
  records  a pack of variable-length records (lognormal sizes, median ~100 KB like ImageNet
           JPEGs) + labels (--record-gib, default 2 GiB): a batch is one slab + offsets

Runs (batch --batch, shuffled as in training; the consumer touches every batch on the GPU):
  torch            torch.utils.data.DataLoader over the per-sample dataset (memmap rows / one
                   pread per record), pin_memory=True, num_workers in --torch-workers (best
                   kept), ``.cuda(non_blocking=True)`` per batch; --torch-batches batches
  fastload         torch_fastload.DataLoader, io_mode auto, hot (page cache) and cold (page
                   cache dropped per file with posix_fadvise DONTNEED): buffered and O_DIRECT.
                   Hot files are mapped, registered and DMA'd straight from the page cache;
                   cold ones stream through the engine's pinned ring
  fastload-ring    the same with map_budget=0: every byte through the ring, hot
  fastload-slot    io_mode='pinned' without kvikio's help: the engine into whole-batch pinned
                   slots, one H2D per batch (the path before the ring), hot
  fastload-kvikio  io_mode='pinned' (kvikio's threads into the pinned pool), hot
  fastload-gds     io_mode='gds' (kvikio into device memory; compat mode where GDS is absent), hot
Baselines measured in the same run:
  link    raw pinned H2D cudaMemcpy of 256 MiB (the PCIe ceiling)
  kvikio  CuFile.read of the whole .npy into GPU memory, best of threads x task size (hot)
  disk    parallel O_DIRECT read of the cold .npy: 16 Python threads x 4 MiB os.preadv blocks
Overlap (kvikio's device reads synchronize with the default stream): a bf16 GEMM step on the
default stream sized to ~2x a batch's transfer, fed device-resident vs fastload (engine ->
pinned -> copy stream) vs fastload-gds; step time over the device-resident step.

Targets (issue 3): hot file -> GPU >= 40 GB/s and >= 1.0x kvikio's best; cold >= 90% of the
disk's O_DIRECT rate; >= 5x torch DataLoader samples/s; <= 2 CPU cores per 10 GB/s.

    python benchmarks/file_loader.py                  # ~3-5 min on the H100 machine
    python benchmarks/file_loader.py --quick          # smaller data, fewer runs
    python benchmarks/file_loader.py --cpu-smoke      # no GPU: tiny data, code paths only

Prints a line per run, then tables and PASS/FAIL verdicts last; writes file_loader.json (every
number, machine, command) and file_loader.png to --out (default benchmarks/out).
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import statistics
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout, not some installed copy

import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload import DataLoader, RecordDataset, pack  # noqa: E402
from torch_fastload import io as fio
from torch_fastload._benchutil import (
    Progress,
    cpu_seconds,
    drop_page_cache,
    error_text,
    fmt,
    fsync_file,  # noqa: E402
    gemm_seconds,
    h2d_copy_seconds,
    log,
    machine_info,
    positive_int_list,
    pyplot,
    table,
    warm_page_cache,
    write_json,
)
from torch_fastload.sources import ArrayDataset  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
ROW_SHAPE = (3, 128, 128)  # float32: 192 KiB per sample


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
def _random_chunk(seed: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def make_arrays(root: Path, gib: float, progress: bool) -> tuple[Path, Path]:
    """features.npy (random float32 bits; NaN patterns included, which is fine for bytes)."""
    rows = max(8, int(gib * GiB) // (4 * int(np.prod(ROW_SHAPE))))
    features, labels = root / "features.npy", root / "labels.npy"
    want = 128 + rows * 4 * int(np.prod(ROW_SHAPE))
    if features.exists() and features.stat().st_size == want and labels.exists():
        return features, labels
    out = np.lib.format.open_memmap(features, mode="w+", dtype=np.float32, shape=(rows, *ROW_SHAPE))
    flat = out.reshape(-1).view(np.uint8)
    step = 64 * MiB
    bar = Progress((flat.size + step - 1) // step, "writing features.npy", progress)
    for k, start in enumerate(range(0, flat.size, step)):
        end = min(start + step, flat.size)
        flat[start:end] = _random_chunk(k, end - start)
        bar.update()
    bar.close()
    out.flush()
    del out, flat
    np.save(labels, np.random.default_rng(1).integers(0, 1000, rows))
    fsync_file(features)
    return features, labels


def make_records(root: Path, gib: float, progress: bool) -> Path:
    out = root / "records"
    target = int(gib * GiB)
    if (out / "meta.json").exists():
        try:
            if abs(RecordDataset(out).meta["bytes"] - target) < 0.05 * target:
                return out
        except Exception:
            pass
    rng = np.random.default_rng(2)
    sizes = []
    while sum(sizes) < target:
        sizes.append(int(np.clip(rng.lognormal(np.log(100_000), 0.5), 8_000, 1_000_000)))
    block = _random_chunk(3, 2 * MiB)

    def records():
        for i, n in enumerate(sizes):
            start = (i * 7919) % (block.size - n)
            yield block[start : start + n].tobytes(), i % 1000

    class _Sized:
        def __len__(self):
            return len(sizes)

        def __iter__(self):
            return records()

    pack(_Sized(), out, shard_size=512 * MiB, overwrite=True, progress=progress)
    return out


def resident_fraction(paths) -> float | None:
    """Share of the files' pages in the page cache (kvikio's mincore helper), None if unknown."""
    try:
        import kvikio

        cached = total = 0
        for path in paths:
            c, t = kvikio.get_page_cache_info(str(path))
            cached, total = cached + c, total + t
        return cached / total if total else 0.0
    except Exception:
        return None


# --------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------
def link_h2d(device: torch.device) -> float:
    """Raw pinned H2D GB/s of 256 MiB (median of 5): the link's ceiling."""
    src = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    return src.numel() / statistics.median(h2d_copy_seconds(src, dst, 5)) / 1e9


def disk_odirect(path: Path, nbytes: int, threads: int = 16, block: int = 4 * MiB) -> float:
    """Parallel O_DIRECT read GB/s of the (cold) file, independent of the engine: Python threads
    issuing os.preadv of aligned blocks into page-aligned buffers (the GIL is released)."""
    size = min(nbytes, os.path.getsize(path)) // block * block
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    next_block = [0]
    lock = threading.Lock()
    errors = []

    def worker():
        buf = mmap.mmap(-1, block)
        try:
            while True:
                with lock:
                    at = next_block[0]
                    next_block[0] += block
                if at >= size:
                    return
                if os.preadv(fd, [buf], at) != block:
                    raise EOFError(f"short O_DIRECT read at {at}")
        except Exception as exc:
            errors.append(exc)
        finally:
            buf.close()

    started = time.perf_counter()
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - started
    os.close(fd)
    if errors:
        raise errors[0]
    return size / seconds / 1e9


def kvikio_best(path: Path, device: torch.device, threads_list, task_sizes) -> dict:
    """kvikio CuFile.read of the whole file into GPU memory (hot), each setting; best kept."""
    import kvikio
    import kvikio.defaults

    size = os.path.getsize(path)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    cells = []
    for threads in threads_list:
        kvikio.defaults.set("num_threads", threads)
        for task in task_sizes:
            best = 0.0
            for _ in range(2):
                torch.cuda.synchronize()
                started = time.perf_counter()
                with kvikio.CuFile(str(path), "r") as f:
                    got = f.read(buf, size, 0, task_size=task)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                if got != size:
                    raise EOFError(f"kvikio read {got} of {size} bytes")
                best = max(best, size / seconds / 1e9)
            cells.append({"threads": threads, "task_size": task, "gbps": best})
            log(f"  kvikio CuFile.read  threads={threads:>2} task={task // MiB:>2} MiB  {best:6.2f} GB/s")
    head = np.fromfile(path, dtype=np.uint8, count=1 << 20)
    if not torch.equal(buf[: 1 << 20].cpu(), torch.from_numpy(head)):
        raise AssertionError("kvikio read wrong bytes")
    del buf
    kvikio.defaults.set("num_threads", fio.select("auto", device).threads)
    return {"cells": cells, "best": max(cells, key=lambda c: c["gbps"])}


# --------------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------------
def batch_bytes(batch) -> int:
    if isinstance(batch, torch_fastload.RecordBatch):
        return (
            batch.data.numel()
            + batch.offsets.numel() * 8
            + (batch.labels.numel() * 8 if batch.labels is not None else 0)
        )
    return sum(t.numel() * t.element_size() for t in batch)


def touch(batch, device):
    """Consume the batch on the GPU (one small kernel per field), as a training step would."""
    first = batch.data if isinstance(batch, torch_fastload.RecordBatch) else batch[0]
    if first.device != device:
        first = first.to(device, non_blocking=True)
    return first.view(-1)[-1:].float()


def measure(name: str, make_iter, device, max_batches: int | None, warmup: int, samples_of, extra=None) -> dict:
    """Iterate, start the clock after ``warmup`` batches, stop after the last (synchronized)."""
    it = make_iter()
    n = samples = nbytes = 0
    started = cpu0 = None
    sink = []
    try:
        for batch in it:
            if n == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started, cpu0 = time.perf_counter(), cpu_seconds()
            if n >= warmup:
                samples += samples_of(batch)
                nbytes += batch_bytes(batch)
            sink.append(touch(batch, device))
            if len(sink) > 8:
                sink.pop(0)
            n += 1
            if max_batches is not None and n >= warmup + max_batches:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        cpu = cpu_seconds() - cpu0  # before worker processes exit
    finally:
        close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
        if close is not None:
            close()
        del it
        gc.collect()
    gbps = nbytes / seconds / 1e9
    result = {
        "name": name,
        "batches": n - warmup,
        "samples": samples,
        "bytes": nbytes,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "gbps": gbps,
        "cpu_s": cpu,
        "cores": cpu / seconds,
        "cores_per_10gbps": (cpu / seconds) / (gbps / 10) if gbps > 0 else None,
    }
    result.update(extra or {})
    log(
        f"  {name:<34} {result['samples_per_s']:>10,.0f} samples/s  {gbps:6.2f} GB/s  "
        f"{result['cores']:5.1f} cores  ({result['batches']} batches, {seconds:.2f} s)"
    )
    return result


def torch_run(name, dataset, args, device, workers, collate=None):
    def make():
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch,
            shuffle=True,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            collate_fn=collate,
            persistent_workers=False,
            prefetch_factor=4 if workers else None,
            generator=torch.Generator().manual_seed(0),
        )

        def moved():
            for batch in loader:
                if isinstance(batch, torch_fastload.RecordBatch):
                    yield torch_fastload.RecordBatch(
                        *(t.to(device, non_blocking=True) if t is not None else None for t in batch)
                    )
                else:
                    yield [t.to(device, non_blocking=True) for t in batch]

        return moved()

    return measure(
        f"{name} torch w{workers}",
        make,
        device,
        args.torch_batches,
        2,
        samples_of(dataset),
        {"loader": "torch", "workers": workers},
    )


def samples_of(dataset):
    if isinstance(dataset, RecordDataset):
        return lambda b: len(b.offsets) - 1
    return lambda b: len(b[0])


def fastload_run(label, dataset, args, device, *, epochs=1, cold_paths=None, **loader_kwargs):
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        device=device,
        generator=torch.Generator().manual_seed(0),
        **loader_kwargs,
    )
    io_path = str(loader.io)

    def make():
        def epochs_iter():
            for _ in range(epochs):
                yield from loader

        return epochs_iter()

    resident = None
    if cold_paths:
        for path in cold_paths:
            drop_page_cache(path)
        resident = resident_fraction(cold_paths)
    result = measure(
        label,
        make,
        device,
        None,
        1,
        samples_of(dataset),
        {
            "loader": "fastload",
            "io": io_path,
            "io_mode": loader.io.mode,
            "epochs": epochs,
            "cold": bool(cold_paths),
            "resident_before": resident,
        },
    )
    result["stats"] = loader.stats().as_dict()
    result["io_bytes"] = result["stats"]["io_bytes"]
    loader.close()
    return result


# --------------------------------------------------------------------------------------------
# overlap: kvikio device reads vs the engine -> pinned -> copy stream, with a GEMM step
# --------------------------------------------------------------------------------------------
def overlap_study(dataset, args, device, batch_transfer_s: float) -> dict:
    """Step time fed device-resident vs fastload (auto) vs fastload (gds) with compute on the
    default stream sized to ~2x the batch's transfer time."""
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    gemm_s = gemm_seconds(a, b, warmup=10)
    reps = max(1, round(2 * batch_transfer_s / gemm_s))

    def step(batch):
        x = batch[0].view(-1)[:1].to(torch.bfloat16)
        c = a
        for _ in range(reps):
            c = c @ b
        return c[0, 0] + x[0]

    steps = args.overlap_steps
    results = {"gemm_ms": gemm_s * 1e3, "gemms_per_step": reps, "transfer_ms": batch_transfer_s * 1e3}
    resident = [t.to(device) for t in next(iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch)))]

    def timed(feed):
        out = None
        for i, batch in enumerate(feed):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            out = step(batch)
            if i == 3 + steps - 1:
                break
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (steps - 0) * 1e3, out

    results["resident_ms"], _ = timed(iter(lambda: resident, None))
    for mode in ("auto", "gds"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, device=device, io_mode=mode)

        def feed():
            while True:
                yield from loader

        results[f"{mode}_ms"], _ = timed(feed())
        results[f"{mode}_io"] = loader.io.mode
        loader.close()
    for mode in ("auto", "gds"):
        results[f"{mode}_over_resident"] = results[f"{mode}_ms"] / results["resident_ms"]
    log(
        f"  overlap: step resident {results['resident_ms']:.2f} ms, fastload auto ({results['auto_io']}) "
        f"{results['auto_ms']:.2f} ms = {results['auto_over_resident']:.3f}x, fastload gds ({results['gds_io']}) "
        f"{results['gds_ms']:.2f} ms = {results['gds_over_resident']:.3f}x"
    )
    return results


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = [r for r in report["runs"] if "gbps" in r]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(runs) + 1.8))
    names = [r["name"] for r in runs]
    colors = ["#999999" if r["loader"] == "torch" else "#1f77b4" if not r.get("cold") else "#2ca02c" for r in runs]
    ax.barh(names, [r["gbps"] for r in runs], color=colors)
    for y, r in enumerate(runs):
        ax.text(r["gbps"], y, f" {r['gbps']:.1f} GB/s, {r['samples_per_s']:,.0f}/s", va="center", fontsize=8)
    base = report["baselines"]
    for key, style, label in (
        ("link_gbps", "--", "link (pinned H2D)"),
        ("kvikio_best_gbps", ":", "kvikio best (hot)"),
        ("disk_odirect_gbps", "-.", "disk O_DIRECT (cold)"),
    ):
        if base.get(key):
            ax.axvline(base[key], linestyle=style, color="k", linewidth=1)
            ax.text(base[key], len(runs) - 0.4, f" {label}", fontsize=8, rotation=90, va="top")
    ax.invert_yaxis()
    ax.set_xlabel("file -> GPU GB/s (decimal)")
    ax.set_title("torch_fastload file loader vs torch DataLoader (grey); hot blue, cold green")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdicts(report: dict) -> list[tuple[str, bool | None, str]]:
    base, runs = report["baselines"], {r["name"]: r for r in report["runs"] if "gbps" in r}
    out = []
    hot = [
        r for r in runs.values() if r["loader"] == "fastload" and not r.get("cold") and r["name"].startswith("arrays")
    ]
    best_hot = max(hot, key=lambda r: r["gbps"]) if hot else None
    if best_hot:
        out.append(
            (
                "hot file -> GPU >= 40 GB/s (arrays)",
                best_hot["gbps"] >= 40,
                f"{best_hot['gbps']:.1f} GB/s ({best_hot['name']})",
            )
        )
        if base.get("kvikio_best_gbps"):
            ratio = best_hot["gbps"] / base["kvikio_best_gbps"]
            out.append(
                (
                    "hot >= 1.0x kvikio CuFile.read best",
                    ratio >= 1.0,
                    f"{ratio:.2f}x of {base['kvikio_best_gbps']:.1f} GB/s",
                )
            )
        cores = best_hot["cores_per_10gbps"]
        out.append(("<= 2 CPU cores per 10 GB/s", cores is not None and cores <= 2, f"{fmt(cores)} cores per 10 GB/s"))
    cold = [r for r in runs.values() if r.get("cold") and r["name"].startswith("arrays")]
    if cold and base.get("disk_odirect_gbps"):
        best_cold = max(cold, key=lambda r: r["gbps"])
        ratio = best_cold["gbps"] / base["disk_odirect_gbps"]
        out.append(
            (
                "cold >= 90% of the disk's O_DIRECT rate",
                ratio >= 0.9,
                f"{100 * ratio:.0f}% ({best_cold['gbps']:.2f} of {base['disk_odirect_gbps']:.2f} GB/s, {best_cold['name']})",
            )
        )
    for kind in ("arrays", "records"):
        theirs = [r for r in runs.values() if r["loader"] == "torch" and r["name"].startswith(kind)]
        ours = [
            r for r in runs.values() if r["loader"] == "fastload" and not r.get("cold") and r["name"].startswith(kind)
        ]
        if theirs and ours:
            t, o = max(theirs, key=lambda r: r["samples_per_s"]), max(ours, key=lambda r: r["samples_per_s"])
            ratio = o["samples_per_s"] / t["samples_per_s"]
            out.append(
                (
                    f">= 5x torch DataLoader samples/s ({kind})",
                    ratio >= 5,
                    f"{ratio:.1f}x ({o['samples_per_s']:,.0f} vs {t['samples_per_s']:,.0f} {t['name']})",
                )
            )
    return out


class _without_kvikio:
    """io_mode='pinned' falls back to the engine where kvikio is absent: pretend it is."""

    def __enter__(self):
        self.saved = fio._kvikio
        fio._kvikio = lambda: None
        fio.gds_status.cache_clear()

    def __exit__(self, *exc):
        fio._kvikio = self.saved
        fio.gds_status.cache_clear()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "data")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--array-gib", type=float, default=4.0)
    parser.add_argument("--record-gib", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hot-epochs", type=int, default=3)
    parser.add_argument("--torch-workers", type=positive_int_list, default=[8, 16])
    parser.add_argument("--torch-batches", type=int, default=40)
    parser.add_argument("--overlap-steps", type=int, default=40)
    parser.add_argument(
        "--cold-threads",
        type=int,
        default=64,
        help="io_threads for cold runs: random reads want more I/O in flight than hot ones",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny data on the CPU, code paths only")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.array_gib, args.record_gib, args.hot_epochs = min(args.array_gib, 2.0), min(args.record_gib, 1.0), 2
        args.torch_workers, args.torch_batches = args.torch_workers[-1:], 20
    if args.cpu_smoke:
        args.array_gib, args.record_gib, args.batch, args.hot_epochs = 0.03, 0.02, 16, 1
        args.torch_workers, args.torch_batches = [2], 4
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        parser.error("no CUDA device: run with --cpu-smoke")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args.dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    progress = not args.no_progress
    report = {
        "machine": machine_info(cuda),
        "args": {k: str(v) for k, v in vars(args).items()},
        "gds": str(fio.gds_status()),
        "io_auto": str(fio.select("auto", device)),
        "baselines": {},
        "runs": [],
    }
    log(f"torch_fastload file loader  device={device}  {report['gds']}")
    log(f"  io_mode=auto on {device}: {report['io_auto']}")

    log("data")
    features, labels = make_arrays(args.dir, args.array_gib, progress)
    records_dir = make_records(args.dir, args.record_gib, progress)
    arrays = ArrayDataset(features, labels)
    records = RecordDataset(records_dir)
    array_files = [features, labels]
    log(
        f"  arrays: {len(arrays)} x {ROW_SHAPE} float32 = {os.path.getsize(features) / GiB:.2f} GiB; "
        f"records: {len(records)} records = {records.meta['bytes'] / GiB:.2f} GiB in {len(records.shard_paths)} shards"
    )
    base = report["baselines"]

    def attempt(what, fn):
        try:
            return fn()
        except Exception as exc:
            log(f"  {what}: failed: {error_text(exc)}")
            traceback.print_exc()
            report.setdefault("failures", []).append({"what": what, "error": error_text(exc)})
            return None

    log("baselines")
    if cuda:
        base["link_gbps"] = attempt("link", lambda: link_h2d(device))
        log(f"  link: raw pinned H2D {fmt(base['link_gbps'])} GB/s")
    for path in array_files:
        drop_page_cache(path)
    base["disk_resident_before"] = resident_fraction(array_files)
    base["disk_odirect_gbps"] = attempt("disk", lambda: disk_odirect(features, os.path.getsize(features)))
    log(
        f"  disk: parallel O_DIRECT (16 threads x 4 MiB, cold) {fmt(base['disk_odirect_gbps'])} GB/s "
        f"(resident before: {fmt(base['disk_resident_before'], '.0%')})"
    )
    warm_page_cache(array_files + records.shard_paths)
    if cuda:
        threads = [8, 16, 32] if not args.quick else [16]
        tasks = [1 * MiB, 4 * MiB, 16 * MiB] if not args.quick else [4 * MiB]
        kv = attempt("kvikio", lambda: kvikio_best(features, device, threads, tasks))
        if kv:
            base["kvikio"] = kv
            base["kvikio_best_gbps"] = kv["best"]["gbps"]

    runs = report["runs"]
    log("arrays (.npy): hot")
    for workers in args.torch_workers:
        runs.append(
            attempt("torch", lambda: torch_run("arrays", arrays, args, device, workers))
            or {"name": f"arrays torch w{workers}", "failed": True}
        )
    runs.append(
        attempt("fastload", lambda: fastload_run("arrays fastload hot", arrays, args, device, epochs=args.hot_epochs))
    )
    if cuda:
        with torch_fastload.config.override(map_budget=0):
            runs.append(
                attempt(
                    "ring",
                    lambda: fastload_run("arrays fastload-ring hot", arrays, args, device, epochs=args.hot_epochs),
                )
            )
        slot = lambda: fastload_run(
            "arrays fastload-slot hot",
            arrays,
            args,
            device,  # noqa: E731
            epochs=args.hot_epochs,
            io_mode="pinned",
        )
        with _without_kvikio():
            runs.append(attempt("slot", slot))
        for mode, label in (("pinned", "arrays fastload-kvikio hot"), ("gds", "arrays fastload-gds hot")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                runs.append(
                    attempt(
                        label, lambda: fastload_run(label, arrays, args, device, epochs=args.hot_epochs, io_mode=mode)
                    )
                )
    log("arrays (.npy): cold (page cache dropped)")
    cold = dict(cold_paths=array_files, io_threads=args.cold_threads)
    runs.append(
        attempt("cold buffered", lambda: fastload_run("arrays fastload cold buffered", arrays, args, device, **cold))
    )
    runs.append(
        attempt(
            "cold odirect",
            lambda: fastload_run("arrays fastload cold O_DIRECT", arrays, args, device, o_direct=True, **cold),
        )
    )
    warm_page_cache(array_files)

    log("records (packed shards): hot")
    for workers in args.torch_workers:
        runs.append(
            attempt(
                "torch records", lambda: torch_run("records", records, args, device, workers, collate=records.collate)
            )
        )
    runs.append(
        attempt(
            "records hot", lambda: fastload_run("records fastload hot", records, args, device, epochs=args.hot_epochs)
        )
    )
    log("records: cold")
    runs.append(
        attempt(
            "records cold",
            lambda: fastload_run(
                "records fastload cold O_DIRECT",
                records,
                args,
                device,
                cold_paths=records.shard_paths,
                o_direct=True,
                io_threads=args.cold_threads,
            ),
        )
    )
    warm_page_cache(array_files)
    report["runs"] = [r for r in runs if r]

    if cuda:
        log("overlap with a training step on the default stream")
        transfer_s = args.batch * 4 * int(np.prod(ROW_SHAPE)) / (base.get("link_gbps") or 50) / 1e9
        report["overlap"] = attempt("overlap", lambda: overlap_study(arrays, args, device, transfer_s))

    report["elapsed_s"] = time.perf_counter() - began
    rows = [
        [
            r["name"],
            r.get("io_mode", "-") if r["loader"] == "fastload" else f"w{r['workers']}",
            f"{r['samples_per_s']:,.0f}",
            fmt(r["gbps"]),
            fmt(r["cores"], ".1f"),
            fmt(r["cores_per_10gbps"]),
            fmt(r.get("resident_before"), ".0%"),
        ]
        for r in report["runs"]
        if "gbps" in r
    ]
    log("")
    log(
        table(
            ["run", "io / workers", "samples/s", "GB/s", "cores", "cores/10GB/s", "cached before"],
            rows,
            title=f"file -> {device}, batch {args.batch}, shuffled",
        )
    )
    log("")
    log(table(["baseline", "GB/s"], [[k, fmt(v)] for k, v in base.items() if k.endswith("gbps")]))
    ov = report.get("overlap")
    if ov:
        log("")
        log(
            table(
                ["feed", "step ms", "x resident"],
                [
                    ["device-resident", fmt(ov["resident_ms"]), "1.000"],
                    [f"fastload auto ({ov['auto_io']})", fmt(ov["auto_ms"]), fmt(ov["auto_over_resident"], ".3f")],
                    [f"fastload gds ({ov['gds_io']})", fmt(ov["gds_ms"]), fmt(ov["gds_over_resident"], ".3f")],
                ],
                title=f"overlap: {ov['gemms_per_step']} bf16 4096^3 GEMMs per step on the default stream "
                f"(~{ov['gemms_per_step'] * ov['gemm_ms']:.2f} ms; batch transfer {ov['transfer_ms']:.2f} ms)",
            )
        )
    checks = verdicts(report)
    report["verdicts"] = [{"target": t, "pass": p, "value": v} for t, p, v in checks]
    write_json(args.out / "file_loader.json", report)
    plot(report, args.out / "file_loader.png")
    log("")
    for target, passed, value in checks:
        log(f"{'PASS' if passed else 'FAIL'}  {target}: {value}")
    log(f"elapsed {report['elapsed_s']:.0f} s; wrote {args.out / 'file_loader.json'} and file_loader.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
