#!/usr/bin/env python3
"""Parquet -> GPU tensors with ParquetDataset against pyarrow.parquet.read_table (to host, and
then a pinned H2D copy) and a torch DataLoader over a row-wise Dataset, all in the same run.

Data (benchmarks/parquet_data.py, written under --dir once): the alert table (14 columns: 9
string ids, 2 timestamps, 2 int64, 1 bool) at --alert-rows, snappy and uncompressed; the
profile suite (int, float, string, timestamp, list; run length 1 and 32; cardinality unlimited
and 1000) at --profile-sizes of decoded data (the larger size: run length 1 only, to fit the
run's time).
Figures: GB/s of decoded output (the tensors' bytes) and Gbps of file read (the file's bytes);
hot page cache unless a row says cold (posix_fadvise DONTNEED after fsync, residency shown).
ParquetDataset: --rounds epochs of one loader after its first are timed, its decoded row groups
dropped before each (the first sets up the pinned pool and threads, and is reported beside it:
"1st epoch"); each timed epoch follows a read_table run at its best thread setting, and the
x read_table verdict is the median of those pairs' ratios (one ~0.2 s epoch moves 15-25%
between runs on the GPU machine; a pair shares its moment's conditions); read_table's own
figure is the median of those runs (its first in the process, the slowest, kept beside it).
Batches: --batch-rows rows, or more where that is under --batch-mib of decoded data.
Baselines (same run): read_table to host at its best thread setting; read_table + a pinned H2D
copy of every buffer; torch DataLoader over a row-wise Dataset (numpy columns indexed per row,
default collate), best of --torch-workers, on --torch-rows sampled rows, extrapolated to the
file (said in its row). read_table + H2D: one pinned buffer and one device buffer allocated
before its clock starts, every Arrow buffer copied in, one H2D copy. The decode + copy ceiling:
every row group decoded and copied to the device on its own thread (half or three quarters of
the CPUs, the faster), no batches or pipeline: what pyarrow's decode plus one copy allow on the
machine, and the share of it the loader reaches (the page decoder's loader can pass it). The
loader with decoder="pyarrow" (pyarrow's column reader for every column) beside every file's
default row, one timed epoch. Also: pyarrow's own file
reads vs one pread per row group decoded from memory (read_mode), pyarrow's column threads
on/off, a threads x row-group-size table, and a bf16 step fed by the loader vs the same step
on device-resident batches.
Targets: >= 1.0x read_table (host) throughput delivered on the GPU; >= 5x the torch DataLoader;
the fed bf16 step <= 1.05x the device-resident one when the step is at least the batch's decode.

    python benchmarks/parquet.py --dir /tmp/pq      # ~4 min on the H100 machine
    python benchmarks/parquet.py --quick            # fewer sizes and cells
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from parquet_data import PROFILE_TYPES, write_alert, write_all, write_profile  # noqa: E402
from parquet_report import plot, tables  # noqa: E402

from torch_fastload import DataLoader, config  # noqa: E402
from torch_fastload._benchutil import (  # noqa: E402
    MiB,
    Study,
    drop_page_cache,
    fmt,
    gemm_seconds,
    int_list,
    log,
    parse_study,
    positive_int_list,
    residency_of,
    size_list,
    study_parser,
    sync,
    warm_page_cache,
)
from torch_fastload._benchutil.timing import ThreadCpu  # noqa: E402
from torch_fastload.sources import ParquetDataset, ParquetSampler, parquet_arena  # noqa: E402


def batch_bytes(batch: dict) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def fastload_run(
    path: Path, args, *, shuffle=False, seed=0, cold=False, batch_rows=None, rounds=1, between=None, **options
) -> dict:
    """Epochs of ParquetDataset -> device through one loader, as training runs them: the first
    pays the loader's one-time set-up (pinned pool, threads: ``first_epoch_s``), which
    read_table's warm memory pool never pays either; then ``rounds`` timed epochs, the median
    one reported (``seconds``, every one in ``epochs_s``), ``between()`` run before each (the
    same-run baseline, interleaved). The decoded row groups are dropped before each timed
    epoch: it decodes every row group again (``cold``: from the disk). The consumer touches
    every batch."""
    dataset = ParquetDataset(path, **options)
    sampler = ParquetSampler(dataset, shuffle=shuffle, seed=seed)
    loader = DataLoader(dataset, batch_sampler=sampler.batches(batch_rows or args.batch_rows), device=args.device)
    first_epoch = _epoch(loader, args)
    setup = loader.stats(reset=True)
    timed = []
    for _ in range(max(1, rounds)):
        if between is not None:
            between()
        dataset.close()  # the decoded row groups go; the loader keeps its pool
        if cold:
            drop_page_cache(path)
        resident = residency_of([path])
        dataset.fetch_seconds = dict.fromkeys(dataset.fetch_seconds, 0.0)
        loader.stats(reset=True)
        cpu = ThreadCpu()
        cpu.snapshot()
        # read before the last batch, while the loader's threads (they end with the epoch) are there
        threads: dict = {}
        run = _epoch(loader, args, on_batch={max(1, len(loader) - 1): lambda t=threads, c=cpu: t.update(c.since())})
        timed.append((run, loader.stats(), dict(dataset.fetch_seconds), threads, resident))
    epochs_s = [t[0]["seconds"] for t in timed]
    run, stats, fetch_seconds, threads, resident = sorted(timed, key=lambda t: t[0]["seconds"])[len(timed) // 2]
    dataset.close()
    del loader
    gc.collect()
    seconds, batches = run["seconds"], run["batches"]
    return {
        "seconds": seconds,
        "epochs_s": epochs_s,
        "gbps": run["nbytes"] / seconds / 1e9,
        "file_gbit": os.path.getsize(path) * 8 / seconds / 1e9,
        "batches": batches,
        "resident_before": resident,
        "decode_s_per_batch": seconds / max(1, batches),
        "first_batch_s": run["first_batch_s"],
        "first_epoch_s": first_epoch["seconds"],
        "first_epoch_gbps": first_epoch["nbytes"] / first_epoch["seconds"] / 1e9,
        # where a batch's time goes: fetch (the dataset's batch, waits for decode included),
        # stage (into the pinned slot), copy (to the device); and the pool set up in epoch 1
        "stage_ms_per_batch": {k: 1e3 * v / max(1, batches) for k, v in stats.stage_s.items() if v},
        # the fetch's own split: the batch's rows in Arrow (decode waits) and its tensors
        "fetch_ms_per_batch": {k: 1e3 * v / max(1, batches) for k, v in fetch_seconds.items()},
        # CPU seconds of the timed epoch by thread group (decode, fetch, stage, copy, native)
        "threads_cpu_s": {k: round(v["cpu_s"], 4) for k, v in threads.items()},
        "threads_preempted": {k: v["preempted"] for k, v in threads.items() if v["preempted"] is not None},
        "pool_mib": setup.pool_bytes / MiB,
        "pool_regrows": setup.pool_regrows + stats.pool_regrows,
    }


def _epoch(loader, args, on_batch=None) -> dict:
    sync(args.device)
    started = time.perf_counter()
    nbytes = batches = 0
    first = None
    sink = []
    for batch in loader:
        nbytes += batch_bytes(batch)
        batches += 1
        sink = sink[-3:] + [next(iter(batch.values())).view(-1)[-1:].float()]
        first = first or time.perf_counter() - started
        if on_batch and batches in on_batch:
            on_batch[batches]()
    sync(args.device)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "nbytes": nbytes, "batches": batches, "first_batch_s": first}


PYARROW_CPUS = pa.cpu_count()  # pyarrow's own pool size, before a loader's bind makes it smaller


@contextlib.contextmanager
def pyarrow_own_pool():
    """pyarrow's CPU pool at its own size for the baselines (a running loader's bind leaves
    ``parquet_cores_left`` cores out of it; a baseline run while one is alive must not see that)."""
    size = pa.cpu_count()
    pa.set_cpu_count(PYARROW_CPUS)
    try:
        yield
    finally:
        pa.set_cpu_count(size)


def read_table_once(path: Path, use_threads: bool) -> float:
    """Seconds of one read_table to host (pyarrow's own pool size: ``pyarrow_own_pool``)."""
    with pyarrow_own_pool():
        started = time.perf_counter()
        table = pq.read_table(path, use_threads=use_threads)
        seconds = time.perf_counter() - started
    del table
    return seconds


def read_table_best(path: Path, cold: bool = False) -> dict:
    """pyarrow.parquet.read_table to host, use_threads on and off: the faster kept (``cold``:
    the file dropped from the page cache before each). ``buffer_bytes``: its distinct buffers."""
    best, buffer_bytes = None, 0
    for threads in (True, False):
        if cold:
            drop_page_cache(path)
        started = time.perf_counter()
        t = pq.read_table(path, use_threads=threads)
        seconds = time.perf_counter() - started
        if best is None or seconds < best["seconds"]:
            best = {"seconds": seconds, "use_threads": threads, "nbytes": t.nbytes}
        buffer_bytes = max(buffer_bytes, sum(b.size for b in distinct_buffers(t)))
        del t
    best["buffer_bytes"] = buffer_bytes
    best["gbps"] = best["nbytes"] / best["seconds"] / 1e9
    best["file_gbit"] = os.path.getsize(path) * 8 / best["seconds"] / 1e9
    return best


def distinct_buffers(table: pa.Table) -> list:
    """Every Arrow buffer of ``table`` once. read_table cuts a row group into chunks of 128Ki
    rows that are slices of the row group's buffers: ``chunk.buffers()`` gives each of them the
    whole parent buffer, so summing per chunk counts a row group's bytes once per chunk."""
    seen, out = set(), []
    for column in table.columns:
        for chunk in column.chunks:
            for buf in chunk.buffers():
                if buf is None or buf.size == 0 or (buf.address, buf.size) in seen:
                    continue
                seen.add((buf.address, buf.size))
                out.append(buf)
    return out


def read_table_h2d(path: Path, device: torch.device, use_threads: bool, buffer_bytes: int) -> dict:
    """read_table, then every distinct Arrow buffer copied into one pinned buffer and on to the
    device in one copy; both buffers allocated before the clock starts (``buffer_bytes``: the
    distinct buffers of an untimed read_table of the file, ``read_table_best``)."""
    pin = device.type == "cuda"
    room = buffer_bytes + buffer_bytes // 8 + (1 << 20)  # another read may allocate a little more
    staged = torch.empty(room, dtype=torch.uint8, pin_memory=pin)
    target = torch.empty(room, dtype=torch.uint8, device=device)
    sync(device)
    started = time.perf_counter()
    t = pq.read_table(path, use_threads=use_threads)
    cursor = 0
    for buf in distinct_buffers(t):
        if cursor + buf.size > room:
            raise RuntimeError(f"the staging buffer ({room} bytes) is too small for {path.name}")
        staged[cursor : cursor + buf.size].copy_(torch.frombuffer(buf, dtype=torch.uint8))
        cursor += buf.size
    target[:cursor].copy_(staged[:cursor], non_blocking=True)
    sync(device)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "gbps": t.nbytes / seconds / 1e9,
        "file_gbit": os.path.getsize(path) * 8 / seconds / 1e9,
        "copied_bytes": cursor,
    }


def decode_copy_ceiling(path: Path, device: torch.device, threads: int) -> dict:
    """The least any loader of these bytes to ``device`` does with pyarrow's decode, nothing
    else: every row group decoded and copied on its own thread (``threads`` at once, pyarrow's
    column threads on), through a pinned buffer per thread, one device copy per row group,
    waited for. No batches, no order, no pipeline: the loader's ceiling on this machine."""
    meta = pq.read_metadata(path)
    local = threading.local()
    cuda = device.type == "cuda"

    def one(i):
        if not hasattr(local, "file"):
            local.file = pq.ParquetFile(path, pre_buffer=True)
            local.stream = torch.cuda.Stream(device) if cuda else None
            local.pinned = None
        table = local.file.read_row_group(i)
        chunks = [chunk for column in table.columns for chunk in column.chunks]
        buffers = [b for chunk in chunks for b in chunk.buffers() if b is not None and b.size]
        total = sum(b.size for b in buffers)
        if local.pinned is None or local.pinned.numel() < total:
            local.pinned = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        offset = 0
        for b in buffers:
            local.pinned[offset : offset + b.size].copy_(torch.frombuffer(b, dtype=torch.uint8))
            offset += b.size
        if cuda:
            with torch.cuda.stream(local.stream):
                torch.empty(total, dtype=torch.uint8, device=device).copy_(local.pinned[:total], non_blocking=True)
            local.stream.synchronize()
        return table.nbytes

    intra = torch.get_num_threads()
    torch.set_num_threads(1)  # each copy into the pinned buffer on its own thread, as the loader's
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(min(threads, meta.num_row_groups))))  # threads, files, buffers made
            started = time.perf_counter()
            nbytes = sum(pool.map(one, range(meta.num_row_groups)))
            seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(intra)
    return {"seconds": seconds, "gbps": nbytes / seconds / 1e9, "threads": threads}


def decode_copy_best(path: Path, device: torch.device) -> dict:
    """``decode_copy_ceiling`` at half and three quarters of the CPUs: the faster kept."""
    cpus = os.cpu_count() or 1
    counts = sorted({max(1, cpus // 2), max(1, cpus * 3 // 4)})
    return min((decode_copy_ceiling(path, device, n) for n in counts), key=lambda r: r["seconds"])


class RowWise(torch.utils.data.Dataset):
    """What torch users write: the table in memory, one row (a dict) per __getitem__ from
    numpy columns. Only the sampled rows are converted (``rows``): converting 4M rows of 9
    string columns to Python objects would take longer than the rest of the benchmark, and the
    per-row cost is the same."""

    def __init__(self, path: Path, rows: np.ndarray):
        table = pq.read_table(path).take(pa.array(rows))
        self.columns = {}
        for name, column in zip(table.column_names, table.columns):
            t = column.type
            if pa.types.is_timestamp(t):
                column = column.cast(pa.int64())
            self.columns[name] = column.to_numpy() if not pa.types.is_list(t) else column.to_pylist()
        self.rows = table.num_rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        row = {}
        for name, values in self.columns.items():
            v = values[i]
            row[name] = torch.tensor(v) if isinstance(v, list) else v
        return row


def collate_rows(rows: list) -> dict:
    out = {}
    for name in rows[0]:
        values = [r[name] for r in rows]
        if isinstance(values[0], torch.Tensor):
            out[name] = torch.cat(values)
        elif isinstance(values[0], str):
            out[name] = values
        else:
            out[name] = torch.from_numpy(np.asarray(values))
    return out


def torch_run(path: Path, args) -> dict:
    """The row-wise baseline per worker setting on sampled rows (at least --torch-rows, and 4
    batches a worker), timed from its first batch (worker start-up left out), extrapolated."""
    total = pq.read_metadata(path).num_rows
    batch = max(1, min(args.batch_rows, 1024, args.torch_rows // 8))  # at least 8 batches
    most = min(total, max(args.torch_rows, 4 * batch * max(args.torch_workers)))
    dataset = RowWise(path, np.random.default_rng(0).choice(total, most, replace=False))
    cells = []
    for workers in args.torch_workers:
        rows = min(most, max(args.torch_rows, 4 * batch * workers))
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(dataset, range(rows)),
            batch_size=batch,
            num_workers=workers,
            collate_fn=collate_rows,
            pin_memory=args.device.type == "cuda",
        )
        counted = 0
        for k, b in enumerate(loader):
            if k == 0:
                started = time.perf_counter()
            else:
                counted += len(next(iter(b.values())))
            for v in b.values():
                if isinstance(v, torch.Tensor):
                    v.to(args.device, non_blocking=True)
        sync(args.device)
        seconds = time.perf_counter() - started
        rate = counted / seconds if counted else 0.0
        cells.append({"workers": workers, "rows_per_s": rate, "sampled_rows": rows})
        log(f"    torch row-wise w{workers}: {rate:,.0f} rows/s on {rows} sampled rows (from its first batch)")
    best = max(cells, key=lambda c: c["rows_per_s"])
    return {"cells": cells, "best": best, "sampled_rows": most, "extrapolated_s": total / best["rows_per_s"]}


def batch_rows_of(args, rows: int, nbytes: int) -> int:
    """--batch-rows, or more rows where that is under --batch-mib of decoded data: 64Ki rows of
    one int64 column are 512 KiB, a batch that measures the loader's per-batch cost, not Parquet."""
    per_row = max(1.0, nbytes / max(1, rows))
    return max(args.batch_rows, int(args.batch_mib * MiB / per_row))


def compare_file(study: Study, args, path: Path, name: str, torch_baseline: bool) -> dict:
    """Every way of reading one file, hot (and the fastload row of the first file cold too)."""
    warm_page_cache([path])
    rows = pq.read_metadata(path).num_rows
    cell = {"name": name, "file": path.name, "rows": rows, "file_bytes": os.path.getsize(path)}
    with pyarrow_own_pool():
        cell["read_table"] = read_table_best(path)
        cell["read_table_h2d"] = read_table_h2d(
            path, args.device, cell["read_table"]["use_threads"], cell["read_table"]["buffer_bytes"]
        )
        cell["decode_copy"] = decode_copy_best(path, args.device)
    cell["batch_rows"] = batch_rows_of(args, rows, cell["read_table"]["nbytes"])
    # read_table and the loader's timed epochs interleaved, --rounds pairs: one ~0.2 s epoch moves
    # 15-25% between runs on the GPU machine, and each pair shares its moment's conditions
    paired: list = []
    use_threads = cell["read_table"]["use_threads"]
    cell["fastload"] = fastload_run(
        path,
        args,
        batch_rows=cell["batch_rows"],
        rounds=args.rounds,
        between=(lambda: paired.append(read_table_once(path, use_threads))) if args.rounds > 1 else None,
    )
    cell["fastload_shuffled"] = fastload_run(path, args, shuffle=True, batch_rows=cell["batch_rows"])
    # the same with pyarrow's column reader for every column instead of the page decoder
    cell["fastload_pyarrow_decoder"] = fastload_run(path, args, batch_rows=cell["batch_rows"], decoder="pyarrow")
    if args.device.type == "cuda":  # the same without the pinned decode arena: staged through a slot
        cell["fastload_pageable"] = fastload_run(path, args, batch_rows=cell["batch_rows"], pinned_arena=0)
    with pyarrow_own_pool(), config.override(parquet_cores_left=0):  # every core decoding
        cell["fastload_all_cores"] = fastload_run(path, args, batch_rows=cell["batch_rows"])
    cell["decoded_bytes"] = cell["fastload"]["gbps"] * cell["fastload"]["seconds"] * 1e9
    if torch_baseline:
        run = study.attempt(f"torch {name}", torch_run, path, args)
        if run:
            cell["torch"] = run
            cell["torch"]["seconds"] = run["extrapolated_s"]
    if paired:  # the median of the rounds' ratios, each read_table run against the epoch after it
        ratios = sorted(r / f for r, f in zip(paired, cell["fastload"]["epochs_s"]))
        cell["read_table_rounds_s"] = paired
        cell["over_read_table_rounds"] = ratios
        cell["over_read_table"] = ratios[len(ratios) // 2]
        # read_table's figure everywhere (rows, ceiling, plot): the median of its interleaved runs,
        # pool warm; its first run in the process (the slowest) is kept beside it
        first, middle = cell["read_table"], sorted(paired)[len(paired) // 2]
        cell["read_table"] = dict(
            first,
            first_run_s=first["seconds"],
            first_run_gbps=first["gbps"],
            seconds=middle,
            gbps=first["nbytes"] / middle / 1e9,
            file_gbit=cell["file_bytes"] * 8 / middle / 1e9,
        )
    else:
        cell["over_read_table"] = cell["read_table"]["seconds"] / cell["fastload"]["seconds"]
    cell["over_read_table_first_epoch"] = cell["read_table"]["seconds"] / cell["fastload"]["first_epoch_s"]
    cell["ceiling_over_read_table"] = cell["read_table"]["seconds"] / cell["decode_copy"]["seconds"]
    cell["of_ceiling"] = cell["decode_copy"]["seconds"] / cell["fastload"]["seconds"]
    if "torch" in cell:
        cell["over_torch"] = cell["torch"]["seconds"] / cell["fastload"]["seconds"]
    run = cell["fastload"]
    log(
        f"  {name:<40} fastload {run['gbps']:6.2f} GB/s ({run['file_gbit']:6.1f} Gbps file)"
        f"  read_table {cell['read_table']['gbps']:6.2f} GB/s  x{cell['over_read_table']:.2f}"
        + (f" (median of {len(paired)} interleaved rounds, {min(ratios):.2f}-{max(ratios):.2f})" if paired else "")
        + f"  decode+copy ceiling x{cell['ceiling_over_read_table']:.2f} read_table"
        f" ({cell['of_ceiling']:.0%} of it reached)"
        f"  [first epoch {run['first_epoch_gbps']:.2f} GB/s, x{cell['over_read_table_first_epoch']:.2f};"
        f" first batch {1e3 * (run['first_batch_s'] or 0):.0f} ms; ms/batch "
        + " ".join(f"{k} {v:.2f}" for k, v in run["stage_ms_per_batch"].items())
        + " (fetch: "
        + " ".join(f"{k} {v:.2f}" for k, v in run["fetch_ms_per_batch"].items())
        + f"); pool {run['pool_mib']:.0f} MiB, regrows {run['pool_regrows']}]"
    )
    _log_variant(
        cell,
        "fastload_pyarrow_decoder",
        "pages_over_pyarrow_decoder",
        "pyarrow's column reader for every column (decoder='pyarrow')",
        "the page decoder",
    )
    if "fastload_pageable" in cell:
        _log_variant(cell, "fastload_pageable", "arena_over_pageable", "without the pinned arena", "the arena")
    _log_variant(
        cell,
        "fastload_all_cores",
        "cores_left_over_all_cores",
        "pyarrow's pool on every core (parquet_cores_left=0)",
        "cores left",
    )
    return cell


def _log_variant(cell: dict, variant: str, gain_key: str, label: str, default_is: str) -> None:
    """A same-run variant of the fastload row: its GB/s and x read_table, and the default's
    speed-up over it, kept as ``cell[gain_key]``."""
    other = cell[variant]
    cell[gain_key] = other["seconds"] / cell["fastload"]["seconds"]
    log(
        f"  {'':<40} {label} {other['gbps']:6.2f} GB/s"
        f" x{cell['read_table']['seconds'] / other['seconds']:.2f} read_table;"
        f" {default_is} x{cell[gain_key]:.2f} that"
    )


def read_modes(args, path: Path) -> list:
    """pyarrow's own reads vs one pread per row group, with pyarrow's column threads on/off, hot and cold."""
    cells = []
    for mode in ("pyarrow", "pread"):
        for arrow_threads in (True, False):
            for cold in (False, True):
                if not cold:
                    warm_page_cache([path])
                run = fastload_run(path, args, cold=cold, read_mode=mode, arrow_threads=arrow_threads)
                cells.append({"read_mode": mode, "arrow_threads": arrow_threads, "cold": cold, **run})
                log(
                    f"  read_mode={mode:<8} arrow_threads={arrow_threads!s:<5} {'cold' if cold else 'hot ':<4}"
                    f" {run['gbps']:6.2f} GB/s  {run['file_gbit']:6.1f} Gbps"
                    f" (resident {fmt(run['resident_before'], '.0%')})"
                )
    for at_once in (None, os.cpu_count()):  # ordered row groups (default) vs all threads' worth at once
        warm_page_cache([path])
        run = fastload_run(path, args, row_groups_at_once=at_once)
        cells.append(
            {"read_mode": "pyarrow", "arrow_threads": True, "cold": False, "at_once": at_once or "auto", **run}
        )
        log(f"  row groups at once {at_once or 'auto':<5} hot {run['gbps']:6.2f} GB/s  {run['file_gbit']:6.1f} Gbps")
    for cold in (False, True):  # the baseline on the same page cache
        drop_page_cache(path) if cold else warm_page_cache([path])
        resident = residency_of([path])
        run = read_table_best(path, cold=cold)
        cells.append({"read_mode": "read_table", "arrow_threads": run["use_threads"], "cold": cold, **run})
        cells[-1]["resident_before"] = resident
    return cells


def thread_grid(args) -> list:
    cells = []
    for rg_rows in args.row_group_rows:
        path = write_alert(args.dir, args.grid_rows, "snappy", rg_rows)
        warm_page_cache([path])
        base = read_table_best(path)
        for threads in args.threads:
            run = fastload_run(path, args, threads=threads)
            cells.append({"row_group_rows": rg_rows, "threads": threads, **run, "read_table_gbps": base["gbps"]})
            log(
                f"  row group {rg_rows:>8} rows, threads {threads:>2}: {run['gbps']:6.2f} GB/s"
                f" (read_table {base['gbps']:.2f})"
            )
    return cells


class _FeedWatch:
    """One overlap feed's host side: the host's lead over the GPU at each step (steps launched
    and not finished), the garbage collector's pauses and collections by generation."""

    def __init__(self):
        self.launched: list = []
        self.leads: list = []
        self.gc_ms = 0.0
        self.collections = [0, 0, 0]
        self._gc_started = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._gc_started) * 1e3
            self.collections[info["generation"]] += 1

    def stepped(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.launched.append(event)
        while self.launched and self.launched[0].query():
            self.launched.pop(0)
        self.leads.append(len(self.launched))

    def done(self) -> dict:
        gc.callbacks.remove(self._gc)
        return {
            "lead_mean": float(np.mean(self.leads)) if self.leads else 0.0,
            "lead_max": int(max(self.leads, default=0)),
            "gc_ms": self.gc_ms,
            "gc_collections": self.collections,
        }


def overlap_step(device: torch.device, decode_s: float):
    """The overlap row's stand-in training step: bf16 GEMMs for at least 1.2x a batch's decode,
    then a read of the batch (so a step cannot finish before its batch arrived); and their count."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    gemms = max(1, int(np.ceil(1.2 * decode_s / gemm_seconds(a, a, warmup=5))))

    def step(batch):
        x = a
        for _ in range(gemms):
            x = x @ a
        return x.view(-1)[0].float() + next(iter(batch.values())).view(-1)[-1:].float()

    return step, gemms


def overlap_batch_rows(batch_rows: int) -> int:
    """The overlap row's batch: a quarter of ``--batch-rows``, enough batches in one epoch of the file."""
    return max(1024, batch_rows // 4)


def overlap_setup(path: Path, args) -> tuple:
    """(batch rows, the loader's seconds a batch on them, the stand-in step sized from it, its
    GEMMs): the decode is timed on the batches the step is fed, the same shuffled order."""
    rows = overlap_batch_rows(args.batch_rows)
    decode = fastload_run(path, args, shuffle=True, seed=1, batch_rows=rows)["decode_s_per_batch"]
    step, gemms = overlap_step(args.device, decode)
    return rows, decode, step, gemms


def overlap_probe_setup(data: Path, device: torch.device) -> tuple:
    """For the probes in benchmarks/gpu: the overlap row's file (the 1M-row snappy alert table,
    written under ``data`` once) and ``overlap_setup`` at parquet.py's defaults: (path, rows,
    decode seconds a batch, step, GEMMs)."""
    data.mkdir(parents=True, exist_ok=True)
    path = write_alert(data, 1_000_000, "snappy", 131072)
    args = argparse.Namespace(device=device, batch_rows=65536, batch_mib=16.0, dir=data)
    return (path, *overlap_setup(path, args))


def overlap(args, path: Path) -> dict | None:
    """A bf16 GEMM step per batch (at least 1.2x a batch's decode), fed by the loader vs on
    device-resident copies of the same batches; the loader's first batches are not timed."""
    if args.device.type != "cuda":
        return None
    rows, decode, step, gemms = overlap_setup(path, args)
    dataset = ParquetDataset(path)
    sampler = ParquetSampler(dataset, shuffle=True, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler.batches(rows), device=args.device)
    warmup = 4
    steps = min(args.overlap_steps, len(loader) - warmup)
    first = iter(loader)
    resident = [{k: v.clone() for k, v in b.items()} for _, b in zip(range(steps), first)]
    first.close()  # stopped now, not by a garbage collection inside a timed feed

    feeds: list = []  # what each feed saw: the host's lead, next()'s time, the collector's pauses

    def timed(feed: str) -> float:
        batches = iter(resident) if feed == "resident" else iter(loader)
        if feed == "fastload":
            for _ in range(warmup):
                step(next(batches))
        sync(args.device)
        watch = _FeedWatch()
        started = time.perf_counter()
        for _, b in zip(range(steps), batches):
            step(b)
            watch.stepped()
        sync(args.device)
        seconds = (time.perf_counter() - started) / steps
        feeds.append({"feed": feed, "ms": seconds * 1e3, **watch.done()})
        getattr(batches, "close", lambda: None)()
        return seconds

    # resident / fastload pairs, interleaved: the median of the pairs' ratios, as the epochs'
    # comparison with read_table does (one run of each swings with the machine's state)
    pairs = [(timed("resident"), timed("fastload")) for _ in range(args.overlap_rounds)]
    path = loader.stats().path
    dataset.close()
    ratios = sorted(f / r for r, f in pairs)
    return {
        # the process's state beside the feeds: the slow regime showed in this benchmark's
        # process and not in a fresh one (benchmarks/gpu/parquet_overlap.py)
        "feeds": feeds,
        "process": {
            "threads_alive": threading.active_count(),
            "pyarrow_cpu_count": pa.cpu_count(),
            "arena": parquet_arena.arena_stats(),
            "python_objects": len(gc.get_objects()),
            "loader_path": path,
        },
        "batch_rows": rows,
        "steps": steps,
        "rounds": len(pairs),
        "decode_ms": decode * 1e3,
        "gemms_per_step": gemms,
        "resident_ms": float(np.median([r for r, _ in pairs])) * 1e3,
        "fastload_ms": float(np.median([f for _, f in pairs])) * 1e3,
        "pair_ratios": ratios,
        "pairs_ms": [[r * 1e3, f * 1e3] for r, f in pairs],  # (resident, fastload) in the order run
        "over_resident": float(np.median(ratios)),
    }


def verdicts(study: Study) -> None:
    cells = study["alert"] + study["profiles"]
    if study.args.device.type == "cuda":
        worst = min(cells, key=lambda c: c["over_read_table"])
        study.verdict(
            "GPU tensors >= 1.0x read_table to host (every file)",
            worst["over_read_table"] >= 1.0,
            f"worst {worst['over_read_table']:.2f}x ({worst['name']})",
        )
    with_torch = [c for c in cells if "over_torch" in c]
    if with_torch:
        worst = min(with_torch, key=lambda c: c["over_torch"])
        study.verdict(
            ">= 5x the torch DataLoader (row-wise, extrapolated)",
            worst["over_torch"] >= 5,
            f"worst {worst['over_torch']:.1f}x ({worst['name']})",
        )
    if ov := study.get("overlap"):
        leads = ", ".join(f"{f['feed'][0]} {f['lead_mean']:.1f}" for f in ov.get("feeds", []))
        study.verdict(
            "bf16 step fed <= 1.05x device-resident",
            ov["over_resident"] <= 1.05,
            f"{ov['over_resident']:.3f}x, median of {ov['rounds']} interleaved pairs "
            f"({', '.join(f'{r:.3f}' for r in ov['pair_ratios'])}; {ov['fastload_ms']:.2f} vs "
            f"{ov['resident_ms']:.2f} ms a step, decode {ov['decode_ms']:.2f} ms a batch; host lead, "
            f"steps: {leads})",
        )
    for c in cells:
        study.figure(f"{c['name']}_gbps".replace(" ", "_"), c["fastload"]["gbps"])
        study.figure(f"{c['name']}_over_read_table".replace(" ", "_"), c["over_read_table"])
        study.figure(f"{c['name']}_of_decode_copy_ceiling".replace(" ", "_"), c["of_ceiling"])
        study.figure(f"{c['name']}_pages_over_pyarrow_decoder".replace(" ", "_"), c["pages_over_pyarrow_decoder"])


def profile_cells(args) -> list:
    """(size, type, run length, cardinality) of every profile file (the larger sizes: run length
    1 only, to fit the run's time)."""
    return [
        (size, kind, run_length, cardinality)
        for size in args.profile_sizes
        for kind in PROFILE_TYPES
        for run_length in ((1, 32) if size == args.profile_sizes[0] else (1,))
        for cardinality in (0, 1000)
    ]


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--dir", type=Path, help="data directory [OUT/data]")
    p.add_argument("--alert-rows", type=positive_int_list, help="alert table rows [240000,1000000,2000000,4000000]")
    p.add_argument("--profile-sizes", type=size_list, help="decoded bytes of each profile file [64M,512M]")
    p.add_argument("--alert-row-group-rows", type=int, help="alert table: rows a row group [131072; CPU: 1024]")
    p.add_argument("--batch-rows", type=int, help="rows a batch [65536]")
    p.add_argument("--batch-mib", type=float, help="at least this many MiB of decoded data a batch [16]")
    p.add_argument("--prepare-workers", type=int, help="processes writing the data files [8]")
    p.add_argument("--threads", type=positive_int_list, help="grid: decode threads [1,4,8,16]")
    p.add_argument("--row-group-rows", type=int_list, help="grid: row group rows [16384,131072,1048576]")
    p.add_argument("--grid-rows", type=int, help="grid: the alert table's rows [2000000]")
    p.add_argument("--torch-workers", type=int_list, help="torch num_workers [0,8,16]")
    p.add_argument("--torch-rows", type=int, help="rows the torch baseline reads, extrapolated [20000]")
    p.add_argument("--overlap-steps", type=int, default=30, help="steps of each overlap feed")
    p.add_argument("--overlap-rounds", type=int, default=3, help="interleaved resident / loader pairs of the overlap")
    p.add_argument("--budget-s", type=float, default=None, help="skip the profile files left after this many s")
    p.add_argument("--rounds", type=int, help="read_table / loader epoch pairs a file, interleaved; median ratio [5]")
    args = parse_study(
        p,
        argv,
        alert_rows=([240_000, 1_000_000, 2_000_000, 4_000_000], [240_000, 1_000_000], [6000]),
        profile_sizes=([64 * MiB, 512 * MiB], [64 * MiB], [MiB // 4]),
        alert_row_group_rows=(131072, 131072, 1024),
        batch_rows=(65536, 65536, 1024),
        batch_mib=(16.0, 16.0, 0.25),
        prepare_workers=(8, 8, 1),
        threads=([1, 4, 8, 16], [4, 16], [1, 2]),
        row_group_rows=([16384, 131072, 1048576], [131072], [1024, 4096]),
        grid_rows=(2_000_000, 1_000_000, 6000),
        torch_workers=([0, 8, 16], [0, 8], [0]),
        torch_rows=(20000, 10000, 1000),
        rounds=(5, 3, 2),
    )
    args.dir = args.dir or args.out / "data"
    args.dir.mkdir(parents=True, exist_ok=True)
    study = Study("parquet", args, "Parquet -> tensors vs pyarrow.read_table and a torch DataLoader")
    rg = args.alert_row_group_rows
    study["alert"], study["profiles"], study["skipped"] = [], [], []
    write_all(
        args.dir,
        [(rows, ("snappy", "none"), rg) for rows in args.alert_rows]
        + [(args.grid_rows, ("snappy",), rows) for rows in args.row_group_rows],
        [(kind, size, run, card, "snappy") for size, kind, run, card in profile_cells(args)],
        args.prepare_workers,
    )
    log(f"data ready under {args.dir} after {time.perf_counter() - study.began:.0f} s")
    for rows in args.alert_rows:
        for compression in ("snappy", "none"):
            path = write_alert(args.dir, rows, compression, rg)
            name = f"alert {rows // 1000}K {compression}"
            cell = study.attempt(name, compare_file, study, args, path, name, compression == "snappy")
            if cell:
                study["alert"].append(cell)
            study.save()  # a run cut short by a time limit keeps what it measured
    mid = write_alert(args.dir, args.alert_rows[min(1, len(args.alert_rows) - 1)], "snappy", rg)
    study["read_modes"] = study.attempt("read modes", read_modes, args, mid) or []
    study["grid"] = study.attempt("threads x row groups", thread_grid, args) or []
    study["overlap"] = study.attempt("overlap", overlap, args, mid)
    study.save()
    log(f"alert tables, read modes, grid and overlap done after {time.perf_counter() - study.began:.0f} s")
    for size, kind, run_length, cardinality in profile_cells(args):
        name = f"{kind} {size >> 20}MiB run{run_length} card{cardinality or 'inf'}"
        if args.budget_s is not None and time.perf_counter() - study.began > args.budget_s:
            study["skipped"].append(name)  # said in the output: the run's time was spent
            continue
        path = write_profile(args.dir, kind, size, run_length, cardinality, "snappy")
        cell = study.attempt(name, compare_file, study, args, path, name, False)
        if cell:
            study["profiles"].append(cell)
        study.save()
    log(f"profile suite done after {time.perf_counter() - study.began:.0f} s")
    verdicts(study)
    return study.finish(*tables(study), plot=plot if study["alert"] else None)


if __name__ == "__main__":
    sys.exit(main())
