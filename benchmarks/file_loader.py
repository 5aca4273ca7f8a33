#!/usr/bin/env python3
"""An epoch over a multi-GB .npy dataset and a packed-record dataset, file -> GPU, against
torch's DataLoader, kvikio, the link and the disk, all in the same run.

Data (written once under --dir, reused while the sizes match; random bytes):
  arrays   features.npy float32 (N, 3, 128, 128) = 192 KiB rows (--array-gib) + labels.npy
  records  a pack of variable-length records (lognormal sizes, median ~100 KB like ImageNet
           JPEGs) + labels (--record-gib)
Runs (batch --batch, shuffled; the consumer touches every batch on the GPU):
  torch            DataLoader over the per-sample dataset (memmap rows / a pread per record),
                   pin_memory=True, num_workers in --torch-workers, .cuda(non_blocking=True)
  fastload         torch_fastload.DataLoader, io_mode auto: hot files mapped, registered and
                   gathered from the page cache by a GPU kernel; cold ones (dropped with
                   posix_fadvise) through the engine's pinned ring, buffered and O_DIRECT
  fastload-ring    map_budget=0: every byte through the ring, hot
  fastload-slot    io_mode='pinned' without kvikio: whole-batch pinned slots, one H2D a batch
  fastload-kvikio  io_mode='pinned' (kvikio's threads into the pinned pool), hot
  fastload-gds     io_mode='gds' (kvikio into device memory; compat mode without GDS), hot
Peers (optional; "not installed" where absent; _benchutil/peers.py):
  torchdata        torchdata's StatefulDataLoader, the torch run's settings (arrays)
  dali numpy       DALI's fn.readers.numpy over the same rows written one .npy a sample (its
                   layout), shuffled, --dali-threads threads: device="gpu" (cuFile) where GDS is
                   available, else the CPU reader + .gpu(); hot; rows only (no labels)
Baselines: the link (pinned H2D of 256 MiB); kvikio CuFile.read of the whole .npy into GPU
memory, best of threads x task size (hot); the disk (parallel O_DIRECT read of the cold .npy).
Overlap: a bf16 GEMM step on the default stream (~2x a batch's transfer) fed device-resident
vs fastload vs fastload-gds (kvikio's device reads synchronize with the default stream).
Targets: hot >= 40 GB/s and >= 1.0x kvikio's best; cold >= 90% of the disk; >= 5x torch's
samples/s; <= 2 CPU cores per 10 GB/s; hot >= 1.0x DALI's numpy reader.

    python benchmarks/file_loader.py            # ~3-5 min on the H100 machine
    python benchmarks/file_loader.py --quick    # smaller data, fewer runs
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import torch_fastload
from torch_fastload import DataLoader, RecordDataset, pack
from torch_fastload import io as fio
from torch_fastload._benchutil import (
    GiB,
    MiB,
    Study,
    cpu_seconds,
    disk_baseline,
    drop_page_cache,
    fmt,
    gemm_seconds,
    link_baseline,
    log,
    parse_study,
    peers,
    positive_int_list,
    random_npy,
    residency_of,
    study_parser,
    sync,
    table,
    warm_page_cache,
)
from torch_fastload.sources import ArrayDataset

ROW_SHAPE = (3, 128, 128)  # float32: 192 KiB a sample
ROW_BYTES = 4 * int(np.prod(ROW_SHAPE))


def make_arrays(root: Path, gib: float, progress: bool) -> tuple[Path, Path]:
    rows = max(8, int(gib * GiB) // ROW_BYTES)
    features, labels = root / "features.npy", root / "labels.npy"
    random_npy(features, (rows, *ROW_SHAPE), seed=0, progress=progress)
    if not labels.exists() or np.load(labels, mmap_mode="r").shape != (rows,):
        np.save(labels, np.random.default_rng(1).integers(0, 1000, rows))
    return features, labels


def make_records(root: Path, gib: float, progress: bool) -> Path:
    out, target = root / "records", int(gib * GiB)
    try:
        if abs(RecordDataset(out).meta["bytes"] - target) < 0.05 * target:
            return out
    except Exception:
        pass
    rng = np.random.default_rng(2)
    sizes = []
    while sum(sizes) < target:
        sizes.append(int(np.clip(rng.lognormal(np.log(100_000), 0.5), 8_000, 1_000_000)))
    block = np.frombuffer(np.random.default_rng(3).bytes(2 * MiB), dtype=np.uint8)

    class Records:
        def __len__(self):
            return len(sizes)

        def __iter__(self):
            for i, n in enumerate(sizes):
                start = (i * 7919) % (block.size - n)
                yield block[start : start + n].tobytes(), i % 1000

    pack(Records(), out, shard_size=512 * MiB, overwrite=True, progress=progress)
    return out


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
                    if f.read(buf, size, 0, task_size=task) != size:
                        raise EOFError(f"kvikio read short of {size} bytes")
                torch.cuda.synchronize()
                best = max(best, size / (time.perf_counter() - started) / 1e9)
            cells.append({"threads": threads, "task_size": task, "gbps": best})
            log(f"  kvikio CuFile.read  threads={threads:>2} task={task // MiB:>2} MiB  {best:6.2f} GB/s")
    if not torch.equal(buf[:MiB].cpu(), torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=MiB))):
        raise AssertionError("kvikio read wrong bytes")
    kvikio.defaults.set("num_threads", fio.select("auto", device).threads)
    return {"cells": cells, "best": max(cells, key=lambda c: c["gbps"])}


def batch_parts(batch) -> list:
    return [t for t in batch if t is not None] if isinstance(batch, (list, tuple)) else [batch]


def measure(name: str, batches, device, limit: int | None, warmup: int, samples_of, **extra) -> dict:
    """Iterate; the clock starts after ``warmup`` batches and stops after the last, synchronized.
    The consumer reads each batch's last element on the GPU, as a training step would."""
    n = samples = nbytes = 0
    sink = []
    try:
        for batch in batches:
            if n == warmup:
                sync(device)
                started, cpu0 = time.perf_counter(), cpu_seconds()
            if n >= warmup:
                samples += samples_of(batch)
                nbytes += sum(t.numel() * t.element_size() for t in batch_parts(batch))
            sink = sink[-7:] + [batch_parts(batch)[0].to(device, non_blocking=True).view(-1)[-1:].float()]
            n += 1
            if limit is not None and n >= warmup + limit:
                break
        sync(device)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu0  # before worker processes exit
    finally:
        getattr(batches, "close", lambda: None)()
        del batches
        gc.collect()
    gbps = nbytes / seconds / 1e9
    result = {"name": name, "batches": n - warmup, "samples": samples, "bytes": nbytes, "seconds": seconds}
    result.update(samples_per_s=samples / seconds, gbps=gbps, cores=cpu / seconds, **extra)
    result["cores_per_10gbps"] = (cpu / seconds) / (gbps / 10) if gbps > 0 else None
    log(f"  {name:<34} {samples / seconds:>10,.0f} samples/s  {gbps:6.2f} GB/s  {cpu / seconds:5.1f} cores")
    return result


def samples_of(dataset):
    if isinstance(dataset, RecordDataset):
        return lambda b: len(b.offsets) - 1
    return lambda b: len(b[0])


def torch_run(name: str, dataset, args, workers: int, collate=None, kind: str = "torch") -> dict:
    """torch's DataLoader, or with ``kind="torchdata"`` torchdata's StatefulDataLoader."""
    make = peers.stateful_loader if kind == "torchdata" else torch.utils.data.DataLoader
    loader = make(
        dataset,
        args.batch,
        shuffle=True,
        num_workers=workers,
        pin_memory=args.device.type == "cuda",
        collate_fn=collate,
        prefetch_factor=4 if workers else None,
        generator=torch.Generator().manual_seed(0),
    )

    def to_device(batch):
        moved = [t.to(args.device, non_blocking=True) if t is not None else None for t in batch]
        return torch_fastload.RecordBatch(*moved) if isinstance(batch, torch_fastload.RecordBatch) else moved

    moved = (to_device(b) for b in loader)
    return measure(
        f"{name} {kind} w{workers}",
        moved,
        args.device,
        args.torch_batches,
        2,
        samples_of(dataset),
        loader=kind,
        workers=workers,
    )


def dali_numpy_run(features: Path, args) -> dict:
    """DALI's numpy reader over the rows of ``features`` as one .npy each (hot: just written or
    read), ``args.hot_epochs`` epochs."""
    gpu_reader = fio.gds_status().available
    root = args.dir / "dali-rows"
    files = peers.write_rows_as_files(features, root)
    loader = peers.dali_numpy_loader(root, files, args.batch, args.dali_threads, args.device, gpu_reader=gpu_reader)
    reader = "gpu (cuFile)" if gpu_reader else "cpu + .gpu()"
    epochs = (batch for _ in range(args.hot_epochs) for batch in loader)
    result = measure(
        f"arrays dali numpy {reader}", epochs, args.device, None, 1, lambda b: len(b[0]), loader="dali", io_mode=reader
    )
    loader.close()
    return result


def fastload_run(label: str, dataset, args, *, epochs: int = 1, cold_paths=None, **kwargs) -> dict:
    with warnings.catch_warnings():  # io_mode='gds' without GDS warns: that is the point of the run
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = DataLoader(
            dataset, args.batch, shuffle=True, device=args.device, generator=torch.Generator().manual_seed(0), **kwargs
        )
    for path in cold_paths or []:
        drop_page_cache(path)
    resident = residency_of(cold_paths) if cold_paths else None
    epochs_iter = (batch for _ in range(epochs) for batch in loader)
    extra = {"loader": "fastload", "io": str(loader.io), "io_mode": loader.io.mode, "cold": bool(cold_paths)}
    result = measure(label, epochs_iter, args.device, None, 1, samples_of(dataset), resident_before=resident, **extra)
    result["stats"] = loader.stats().as_dict()
    loader.close()
    return result


def overlap_study(dataset, args, transfer_s: float) -> dict:
    """Step time fed device-resident vs fastload (auto) vs fastload (gds), with GEMMs on the
    default stream sized to ~2x the batch's transfer time."""
    a = torch.randn(4096, 4096, device=args.device, dtype=torch.bfloat16)
    gemm_s = gemm_seconds(a, a, warmup=10)
    reps = max(1, round(2 * transfer_s / gemm_s))
    out = {"gemm_ms": gemm_s * 1e3, "gemms_per_step": reps, "transfer_ms": transfer_s * 1e3}

    def timed(feed) -> float:
        sink = None
        for i, batch in enumerate(feed):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            c = a
            for _ in range(reps):
                c = c @ a
            sink = c[0, 0] + batch[0].view(-1)[:1].to(torch.bfloat16)[0]
            if i == 2 + args.overlap_steps:
                break
        torch.cuda.synchronize()
        del sink
        return (time.perf_counter() - t0) / args.overlap_steps * 1e3

    resident = [t.to(args.device) for t in next(iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch)))]
    out["resident_ms"] = timed(iter(lambda: resident, None))
    for mode in ("auto", "gds"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            loader = DataLoader(dataset, args.batch, shuffle=True, device=args.device, io_mode=mode)
        out[f"{mode}_ms"] = timed(b for _ in iter(int, 1) for b in loader)
        out[f"{mode}_io"], out[f"{mode}_over_resident"] = loader.io.mode, out[f"{mode}_ms"] / out["resident_ms"]
        loader.close()
    log(
        f"  overlap: resident {out['resident_ms']:.2f} ms, auto {out['auto_ms']:.2f} ms, "
        f"gds {out['gds_ms']:.2f} ms a step"
    )
    return out


def run_all(study: Study, args, arrays, records, array_files: list) -> list:
    cuda, hot = args.device.type == "cuda", {"epochs": args.hot_epochs}
    cold = {"cold_paths": array_files, "io_threads": args.cold_threads}
    runs = [study.attempt(f"arrays torch w{w}", torch_run, "arrays", arrays, args, w) for w in args.torch_workers]
    for peer, run in (("torchdata", "torchdata"), ("dali", "dali numpy")):
        try:
            peers.require(peer, args.device)
        except peers.PeerUnavailable as why:
            log(f"  arrays {run}: {why}")
            study["peer_rows_not_run"][run] = str(why)
            continue
        if peer == "torchdata":
            runs += [
                study.attempt(f"arrays torchdata w{w}", torch_run, "arrays", arrays, args, w, kind=peer)
                for w in args.torch_workers
            ]
        else:
            runs.append(study.attempt("arrays dali numpy", dali_numpy_run, array_files[0], args))
    runs.append(study.attempt("arrays hot", fastload_run, "arrays fastload hot", arrays, args, **hot))
    if cuda:
        with torch_fastload.config.override(map_budget=0):
            runs.append(study.attempt("ring", fastload_run, "arrays fastload-ring hot", arrays, args, **hot))
        saved = fio._kvikio
        fio._kvikio = lambda: None  # io_mode='pinned' falls back to the engine where kvikio is absent
        fio.gds_status.cache_clear()
        try:
            runs.append(
                study.attempt("slot", fastload_run, "arrays fastload-slot hot", arrays, args, io_mode="pinned", **hot)
            )
        finally:
            fio._kvikio = saved
            fio.gds_status.cache_clear()
        for mode, label in (("pinned", "arrays fastload-kvikio hot"), ("gds", "arrays fastload-gds hot")):
            runs.append(study.attempt(label, fastload_run, label, arrays, args, io_mode=mode, **hot))
    log("arrays: cold (page cache dropped)")
    runs.append(study.attempt("cold buffered", fastload_run, "arrays fastload cold buffered", arrays, args, **cold))
    runs.append(
        study.attempt(
            "cold O_DIRECT", fastload_run, "arrays fastload cold O_DIRECT", arrays, args, o_direct=True, **cold
        )
    )
    warm_page_cache(array_files)
    log("records (packed shards)")
    for w in args.torch_workers:
        runs.append(
            study.attempt(f"records torch w{w}", torch_run, "records", records, args, w, collate=records.collate)
        )
    runs.append(study.attempt("records hot", fastload_run, "records fastload hot", records, args, **hot))
    cold = {"cold_paths": records.shard_paths, "io_threads": args.cold_threads, "o_direct": True}
    runs.append(study.attempt("records cold", fastload_run, "records fastload cold O_DIRECT", records, args, **cold))
    warm_page_cache(array_files)
    return [r for r in runs if r]


def verdicts(study: Study) -> None:
    base, runs = study["baselines"], study["runs"]
    hot = [r for r in runs if r["loader"] == "fastload" and not r.get("cold") and r["name"].startswith("arrays")]
    if hot:
        best = max(hot, key=lambda r: r["gbps"])
        study.figure("hot_gbps", best["gbps"])
        study.figure("hot_cores_per_10gbps", best["cores_per_10gbps"])
        study.verdict(
            "hot file -> GPU >= 40 GB/s (arrays)", best["gbps"] >= 40, f"{best['gbps']:.1f} GB/s ({best['name']})"
        )
        if base.get("kvikio_best_gbps"):
            ratio = best["gbps"] / base["kvikio_best_gbps"]
            study.figure("hot_over_kvikio", ratio)
            study.verdict(
                "hot >= 1.0x kvikio CuFile.read's best",
                ratio >= 1,
                f"{ratio:.3f}x of {base['kvikio_best_gbps']:.2f} GB/s",
            )
        cores = best["cores_per_10gbps"]
        study.verdict("<= 2 CPU cores per 10 GB/s", cores is not None and cores <= 2, f"{fmt(cores)}")
    cold = [r for r in runs if r.get("cold") and r["name"].startswith("arrays")]
    if cold and base.get("disk_gbps"):
        best = max(cold, key=lambda r: r["gbps"])
        study.figure("cold_over_disk", best["gbps"] / base["disk_gbps"])
        value = f"{best['gbps'] / base['disk_gbps']:.0%} ({best['gbps']:.2f} of {base['disk_gbps']:.2f} GB/s, "
        value += f"{best['name']})"
        study.verdict("cold >= 90% of the disk's O_DIRECT rate", best["gbps"] >= 0.9 * base["disk_gbps"], value)
    dali = [r for r in runs if r["loader"] == "dali"]
    if hot and dali:
        ratio = max(r["gbps"] for r in hot) / dali[0]["gbps"]
        study.figure("hot_over_dali_numpy", ratio)
        study.verdict("hot >= 1.0x DALI's numpy reader", ratio >= 1, f"{ratio:.2f}x of {dali[0]['gbps']:.2f} GB/s")
    for kind in ("arrays", "records"):
        theirs = [r for r in runs if r["loader"] == "torch" and r["name"].startswith(kind)]
        ours = [r for r in runs if r["loader"] == "fastload" and not r.get("cold") and r["name"].startswith(kind)]
        if theirs and ours:
            t, o = (max(x, key=lambda r: r["samples_per_s"]) for x in (theirs, ours))
            ratio = o["samples_per_s"] / t["samples_per_s"]
            study.figure(f"{kind}_vs_torch", ratio)
            value = f"{ratio:.1f}x ({o['samples_per_s']:,.0f} vs {t['samples_per_s']:,.0f}, {t['name']})"
            study.verdict(f">= 5x torch DataLoader samples/s ({kind})", ratio >= 5, value)
    for r in runs:
        study.figure(f"{r['name'].replace(' ', '_')}_gbps", r["gbps"])
        study.figure(f"{r['name'].replace(' ', '_')}_samples_per_s", r["samples_per_s"])


def plot(data: dict, plt):
    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(runs) + 1.8))
    colors = [
        "#999999"
        if r["loader"] == "torch"
        else "#ff7f0e"
        if r["loader"] in ("torchdata", "dali")
        else "#2ca02c"
        if r.get("cold")
        else "#1f77b4"
        for r in runs
    ]
    ax.barh([r["name"] for r in runs], [r["gbps"] for r in runs], color=colors)
    for y, r in enumerate(runs):
        ax.text(r["gbps"], y, f" {r['gbps']:.1f} GB/s, {r['samples_per_s']:,.0f}/s", va="center", fontsize=8)
    for key, style, label in (
        ("link_gbps", "--", "link"),
        ("kvikio_best_gbps", ":", "kvikio best"),
        ("disk_gbps", "-.", "disk"),
    ):
        if data["baselines"].get(key):
            ax.axvline(data["baselines"][key], linestyle=style, color="k", linewidth=1, label=label)
    ax.invert_yaxis()
    ax.set(
        xlabel="file -> GPU GB/s",
        title="torch_fastload file loader vs torch DataLoader (grey), peers (orange); hot blue, cold green",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--dir", type=Path, help="data directory [OUT/data]")
    p.add_argument("--array-gib", type=float, help="the .npy's size [4; quick 2]")
    p.add_argument("--record-gib", type=float, help="the records' size [2; quick 1]")
    p.add_argument("--batch", type=int, help="[256; cpu 16]")
    p.add_argument("--hot-epochs", type=int, help="epochs of each hot fastload run [3; quick 2]")
    p.add_argument("--torch-workers", type=positive_int_list, help="torch num_workers, each run [8,16; quick 16]")
    p.add_argument("--torch-batches", type=int, help="batches a torch run [40; quick 20]")
    p.add_argument("--overlap-steps", type=int, default=40, help="timed steps of each overlap feed")
    p.add_argument("--cold-threads", type=int, default=64, help="io_threads of cold runs (random reads want depth)")
    p.add_argument("--dali-threads", type=int, default=16, help="num_threads of DALI's numpy reader (the CPU budget)")
    args = parse_study(
        p,
        argv,
        array_gib=(4.0, 2.0, 0.03),
        record_gib=(2.0, 1.0, 0.02),
        batch=(256, 256, 16),
        hot_epochs=(3, 2, 1),
        torch_workers=([8, 16], [16], [2]),
        torch_batches=(40, 20, 4),
    )
    args.dir = args.dir or args.out / "data"
    args.dir.mkdir(parents=True, exist_ok=True)
    study = Study("file_loader", args, "file -> GPU epochs vs torch, kvikio, the link and the disk")
    study["peers"], study["peer_rows_not_run"] = peers.all_status(), {}
    cuda = args.device.type == "cuda"
    study["io_auto"] = str(fio.select("auto", args.device))
    log(f"  io_mode=auto: {study['io_auto']}; {fio.gds_status()}")
    features, labels = make_arrays(args.dir, args.array_gib, args.progress)
    arrays, records = (
        ArrayDataset(features, labels),
        RecordDataset(make_records(args.dir, args.record_gib, args.progress)),
    )
    files = [features, labels]
    log(
        f"  arrays: {len(arrays)} rows, {os.path.getsize(features) / GiB:.2f} GiB; "
        f"records: {len(records)}, {records.meta['bytes'] / GiB:.2f} GiB"
    )
    base = study["baselines"] = {}
    if cuda:
        base["link_gbps"] = (study.attempt("link", link_baseline, args.device) or {}).get("gbps")
    disk = study.attempt("disk", disk_baseline, features) or {}
    base.update(disk_gbps=disk.get("gbps"), disk_resident_before=disk.get("resident_before"))
    warm_page_cache(files + records.shard_paths)
    if cuda:
        grid = ([16], [4 * MiB]) if args.quick else ([8, 16, 32], [MiB, 4 * MiB, 16 * MiB])
        kv = study.attempt("kvikio", kvikio_best, features, args.device, *grid)
        base.update(kvikio=kv, kvikio_best_gbps=kv and kv["best"]["gbps"])
    for key in ("link_gbps", "kvikio_best_gbps", "disk_gbps"):
        study.figure(key, base.get(key))
    log("baselines: " + ", ".join(f"{k} {fmt(v)}" for k, v in base.items() if k.endswith("gbps")))
    study["runs"] = run_all(study, args, arrays, records, files)
    if cuda:
        transfer_s = args.batch * ROW_BYTES / (base.get("link_gbps") or 50) / 1e9
        study["overlap"] = study.attempt("overlap", overlap_study, arrays, args, transfer_s)
    verdicts(study)
    rows = [
        [
            r["name"],
            r.get("io_mode", f"w{r.get('workers')}"),
            f"{r['samples_per_s']:,.0f}",
            fmt(r["gbps"]),
            fmt(r["cores"], ".1f"),
        ]
        + [fmt(r["cores_per_10gbps"]), fmt(r.get("resident_before"), ".0%")]
        for r in study["runs"]
    ]
    heads = ["run", "io / workers", "samples/s", "GB/s", "cores", "cores/10GB/s", "cached before"]
    rows += [[name, "-", "-", "-", "-", "-", why] for name, why in study["peer_rows_not_run"].items()]
    out = [table(heads, rows, f"file -> {args.device}, batch {args.batch}, shuffled")]
    out.append(table(["baseline", "GB/s"], [[k, fmt(v)] for k, v in base.items() if k.endswith("gbps")]))
    if ov := study.get("overlap"):
        for mode in ("auto", "gds"):
            study.figure(f"overlap_{mode}_over_resident", ov[f"{mode}_over_resident"])
        rows = [["device-resident", fmt(ov["resident_ms"]), "1.000"]]
        rows += [
            [f"fastload {m} ({ov[f'{m}_io']})", fmt(ov[f"{m}_ms"]), fmt(ov[f"{m}_over_resident"], ".3f")]
            for m in ("auto", "gds")
        ]
        title = f"overlap: {ov['gemms_per_step']} bf16 4096^3 GEMMs a step on the default stream "
        title += f"(batch transfer {ov['transfer_ms']:.2f} ms)"
        out.append(table(["feed", "step ms", "x resident"], rows, title))
    return study.finish(*out, plot=plot if study["runs"] else None)


if __name__ == "__main__":
    sys.exit(main())
