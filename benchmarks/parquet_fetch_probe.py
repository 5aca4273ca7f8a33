"""Where a Parquet batch's serial fetch goes (issue 21, the alert table's floor).

Times ``ParquetDataset.__fastload_batch__`` on consecutive-row batches and the stage's copy of
each batch into one buffer, in three settings: row groups decoded beforehand (the fetch alone),
the same beside ``--hogs`` threads running Python (GIL contention like the decode threads'),
and a live epoch (decode running, as in the loader). Prints ms a batch and, for the first
setting, the functions the fetch spends its time in (cProfile). ``--device``: also the loader's
epoch to that device over the row groups decoded beforehand (its pipeline's pace without
decode: fetch, stage, copy).

    python benchmarks/parquet_fetch_probe.py --rows 1000000 --compression none --threads 16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parquet_data import write_alert  # noqa: E402

from torch_fastload.sources import ParquetDataset  # noqa: E402
from torch_fastload.staging import ParallelCopier, plan_batch  # noqa: E402


def batch_ranges(rows: int, batch_rows: int) -> list:
    return [range(start, min(rows, start + batch_rows)) for start in range(0, rows, batch_rows)]


def fetch_pass(dataset, ranges, copier, buffer) -> dict:
    """ms a batch: fetch (rows, tensors) and stage (plan + copy into ``buffer``)."""
    dataset.fetch_seconds = dict.fromkeys(dataset.fetch_seconds, 0.0)
    fetch = stage = 0.0
    for index in ranges:
        started = time.perf_counter()
        batch = dataset.__fastload_batch__(index)
        fetched = time.perf_counter()
        plan = plan_batch(batch)
        if plan.total_bytes > buffer.numel():
            buffer = torch.empty(plan.total_bytes * 2, dtype=torch.uint8)
        copier.copy_into(buffer, plan.copy_list())
        stage += time.perf_counter() - fetched
        fetch += fetched - started
    n = len(ranges)
    split = {k: 1e3 * v / n for k, v in dataset.fetch_seconds.items()}
    return {"fetch": 1e3 * fetch / n, "stage": 1e3 * stage / n, **split}


def python_hog(stop: threading.Event) -> None:
    """Python bytecode holding the GIL between short releases, like a decode thread's Python."""
    while not stop.is_set():
        total = 0
        for i in range(2000):
            total += i
        time.sleep(0)


def loader_pass(dataset, ranges, device: torch.device) -> dict:
    """GB/s of the loader's second epoch (the first sets up its pool) over decoded row groups."""
    from torch_fastload import DataLoader

    loader = DataLoader(dataset, batch_sampler=ranges, device=device)
    for _ in range(2):  # the first epoch sets up the pool
        loader.stats(reset=True)
        started, nbytes = time.perf_counter(), 0
        for batch in loader:
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    stats = loader.stats()
    loader.close()
    split = {k: 1e3 * v / len(ranges) for k, v in stats.stage_s.items() if v}
    return {"GB/s": nbytes / seconds / 1e9, **split}


def line(label: str, r: dict) -> str:
    return f"{label:34s} " + "  ".join(f"{k} {v:6.3f}" for k, v in r.items()) + "  ms/batch"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/fastload-parquet")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--compression", default="none")
    p.add_argument("--row-group-rows", type=int, default=131072)
    p.add_argument("--batch-rows", type=int, default=67394)
    p.add_argument("--threads", type=int, default=2, help="decode threads")
    p.add_argument("--copy-threads", type=int, default=2)
    p.add_argument("--hogs", type=int, default=2, help="Python threads beside the warm fetch")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the warm fetch")
    p.add_argument("--device", default=None, help="also the loader's epoch to this device (decoded beforehand)")
    args = p.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = write_alert(Path(args.dir), args.rows, args.compression, args.row_group_rows)
    ranges = batch_ranges(args.rows, args.batch_rows)
    copier = ParallelCopier(args.copy_threads)
    buffer = torch.empty(32 << 20, dtype=torch.uint8)
    print(f"{path.name}: {len(ranges)} batches of {args.batch_rows} rows, threads {args.threads}", flush=True)

    dataset = ParquetDataset(path, threads=args.threads, cache_bytes=4 << 30)
    dataset._reader().get(list(range(len(dataset.plan.row_groups))), [])  # all decoded, kept
    for _ in range(args.repeat):
        print(line("warm (decoded beforehand)", fetch_pass(dataset, ranges, copier, buffer)), flush=True)
    stop = threading.Event()
    hogs = [threading.Thread(target=python_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for t in hogs:
        t.start()
    for _ in range(args.repeat):
        print(line(f"warm beside {args.hogs} Python threads", fetch_pass(dataset, ranges, copier, buffer)), flush=True)
    stop.set()
    for t in hogs:
        t.join()
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        fetch_pass(dataset, ranges, copier, buffer)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
        print("\n".join(text.getvalue().splitlines()[-26:]), flush=True)
    if args.device:
        for _ in range(args.repeat):
            r = loader_pass(dataset, ranges, torch.device(args.device))
            print(line(f"loader to {args.device}, decoded beforehand", r), flush=True)
    dataset.close()
    for _ in range(args.repeat):
        live = ParquetDataset(path, threads=args.threads)
        print(line("live (decoding as it fetches)", fetch_pass(live, ranges, copier, buffer)), flush=True)
        live.close()


if __name__ == "__main__":
    main()
