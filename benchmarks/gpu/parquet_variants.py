"""Issue 21: the alert table through the loader to cuda under loader settings, each timed as
benchmarks/parquet.py times it (second epoch) against read_table in the same process.
Run from the repo root:  python3 benchmarks/gpu/parquet_variants.py SET [DATA_DIR]
  alert    fetch_threads 2/3, a 0.1 ms GIL switch interval, 8 row groups decoding at once (4M none, 1M snappy)
  offsets  fetch_threads 2/3/4, 6 row groups at once, alone and with fetch_threads 2 (4M none, 1M snappy)
  threads  16/12/8/6 decode threads, pyarrow's own threads on and off (4M none, written if missing)
  depth    batches in flight (prefetch) and pinned slots, pyarrow's threads on and off
  stages   the pipeline's stage threads (2) at 3/4/6, with deeper prefetch and fewer memcpy threads
  onecall  the one-call stage against the Python one, row groups at once, stage and copy threads
  atonce   row groups decoding at once: the default (about two column chunks a thread), 5, 8, 12, 16
  ceiling  the decode-only ceiling (every row group decoded on 16/12 threads, nothing else) and the
           decode + copy ceiling (each row group also copied to the device on its own thread
           through a pinned buffer: the least any loader of these bytes does), then the loader
           with pyarrow's threads on and off
Each line ends with the timed epoch's CPU seconds by thread group (and preemptions where /proc has them).
ROUNDS=N runs every variant N times, interleaved, each round against its own read_table, and
prints each variant's median ratio: one ~0.2 s epoch moves 10-15% between runs on its own."""

import importlib
import os
import sys
import threading
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

from torch_fastload import config, pipeline  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "1"))  # each variant run this many times, interleaved
FILES = ("alert-4000000-none-rg131072.parquet", "alert-1000000-snappy-rg131072.parquet")
# label, ParquetDataset options, loader config overrides, GIL switch interval (None: unchanged)
# or a dict of module constants set for that variant (``NAME``: torch_fastload.pipeline's,
# ``module.NAME``: torch_fastload.module's)
SETS = {
    "alert": [
        ("default", {}, {"fetch_threads": 1}, None),
        ("fetch_threads=2", {}, {"fetch_threads": 2}, None),
        ("fetch_threads=3", {}, {"fetch_threads": 3}, None),
        ("switchinterval 0.1ms", {}, {"fetch_threads": 1}, 1e-4),
        ("row_groups_at_once=8", {"row_groups_at_once": 8}, {"fetch_threads": 1}, None),
        ("fetch_threads=3 at_once=8", {"row_groups_at_once": 8}, {"fetch_threads": 3}, None),
        ("default again", {}, {"fetch_threads": 1}, None),
    ],
    "offsets": [
        ("default", {}, {"fetch_threads": 1}, None),
        ("fetch_threads=2", {}, {"fetch_threads": 2}, None),
        ("fetch_threads=3", {}, {"fetch_threads": 3}, None),
        ("fetch_threads=4", {}, {"fetch_threads": 4}, None),
        ("row_groups_at_once=6", {"row_groups_at_once": 6}, {"fetch_threads": 1}, None),
        ("fetch_threads=2 at_once=6", {"row_groups_at_once": 6}, {"fetch_threads": 2}, None),
        ("default again", {}, {"fetch_threads": 1}, None),
    ],
    "threads": [
        (f"threads {t:2d} arrow_threads {a!s:5s}", {"threads": t, "arrow_threads": a}, {}, None)
        for t in (16, 12, 8, 6, 16)
        for a in (True, False)
    ],
    "depth": [
        ("default", {}, {}, None),
        ("prefetch 4 slots 5", {}, {"prefetch": 4, "pool_slots": 5}, None),
        ("prefetch 8 slots 9", {}, {"prefetch": 8, "pool_slots": 9}, None),
        ("prefetch 8 slots 5", {}, {"prefetch": 8, "pool_slots": 5}, None),
        ("prefetch 16 slots 17", {}, {"prefetch": 16, "pool_slots": 17}, None),
        ("arrow off prefetch 8 slots 9", {"arrow_threads": False}, {"prefetch": 8, "pool_slots": 9}, None),
        ("default again", {}, {}, None),
    ],
    "stages": [
        ("default", {}, {}, None),
        ("stage threads 3", {}, {}, {"STAGE_THREADS": 3}),
        ("stage threads 4", {}, {}, {"STAGE_THREADS": 4}),
        ("stage threads 4 prefetch 6 slots 7", {}, {"prefetch": 6, "pool_slots": 7}, {"STAGE_THREADS": 4}),
        ("stage threads 6 prefetch 8 slots 9", {}, {"prefetch": 8, "pool_slots": 9}, {"STAGE_THREADS": 6}),
        ("stage threads 4 copy threads 4", {}, {"stage_threads": 4}, {"STAGE_THREADS": 4}),
        ("default again", {}, {}, None),
    ],
    "onecall": [
        ("default", {}, {}, None),
        ("python stage", {}, {}, {"transfer.ONE_CALL_STAGE": False}),
        ("at_once 6", {"row_groups_at_once": 6}, {}, None),
        ("at_once 8", {"row_groups_at_once": 8}, {}, None),
        ("stage threads 3", {}, {}, {"STAGE_THREADS": 3}),
        ("copy threads 4", {}, {"stage_threads": 4}, None),
        ("copy threads 4 at_once 6", {"row_groups_at_once": 6}, {"stage_threads": 4}, None),
    ],
    "atonce": [
        ("default", {}, {}, None),
        ("at_once 5", {"row_groups_at_once": 5}, {}, None),
        ("at_once 8", {"row_groups_at_once": 8}, {}, None),
        ("at_once 12", {"row_groups_at_once": 12}, {}, None),
        ("at_once 16", {"row_groups_at_once": 16}, {}, None),
    ],
    "ceiling": [
        ("default", {}, {}, None),
        ("arrow off", {"arrow_threads": False}, {}, None),
    ],
}


def _owner(name: str):
    """The module a variant's constant lives in: ``pipeline`` unless the name says ``module.NAME``."""
    if "." not in name:
        return pipeline
    return importlib.import_module("torch_fastload." + name.rsplit(".", 1)[0])


def decode_only(path: Path, threads: int, arrow_threads: bool) -> tuple:
    """GB/s of decoding every row group on ``threads`` threads and nothing else (the decode
    pool's ceiling), and the cores it used."""
    from concurrent.futures import ThreadPoolExecutor

    meta = bench.pq.read_metadata(path)
    local = threading.local()

    def one(i):
        if not hasattr(local, "file"):
            local.file = bench.pq.ParquetFile(path, pre_buffer=True)
        return local.file.read_row_group(i, use_threads=arrow_threads).nbytes

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(min(threads, meta.num_row_groups))))  # threads and files opened
        cpu0, started = time.process_time(), time.perf_counter()
        nbytes = sum(pool.map(one, range(meta.num_row_groups)))
        seconds = time.perf_counter() - started
    return nbytes / seconds / 1e9, (time.process_time() - cpu0) / seconds


def cpu_text(r: dict) -> str:
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["threads_cpu_s"].items(), key=lambda kv: -kv[1]) if v >= 0.005)
    pre = ", ".join(f"{k} {v}" for k, v in r.get("threads_preempted", {}).items() if v)
    return f"; cpu s: {cpu}" + (f"; preempted: {pre}" if pre else "")


def run(path: Path, variants: list) -> None:
    args = types.SimpleNamespace(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"), batch_rows=65536)
    cpu0, started = time.process_time(), time.perf_counter()
    baseline = bench.read_table_best(path)
    print(
        f"{path.name}: read_table {baseline['gbps']:.2f} GB/s ({baseline['use_threads']=}); both read_table calls "
        f"used {(time.process_time() - cpu0) / (time.perf_counter() - started):.1f} cores",
        flush=True,
    )
    if variants is SETS["ceiling"]:
        for threads, arrow in ((16, False), (16, True), (12, False)):
            gbps, cores = decode_only(path, threads, arrow)
            print(
                f"{path.name}: decode only, {threads} threads, arrow_threads {arrow}: {gbps:.2f} GB/s "
                f"(x{gbps / baseline['gbps']:.2f} read_table) on {cores:.1f} cores",
                flush=True,
            )
        if args.device.type == "cuda":
            for threads in (8, 12):
                gbps = bench.decode_copy_ceiling(path, args.device, threads)["gbps"]
                print(
                    f"{path.name}: decode + copy to the device, {threads} threads: {gbps:.2f} GB/s "
                    f"(x{gbps / baseline['gbps']:.2f} read_table)",
                    flush=True,
                )
    sizing = types.SimpleNamespace(batch_rows=65536, batch_mib=16.0)
    rows = bench.batch_rows_of(sizing, bench.pq.read_metadata(path).num_rows, baseline["nbytes"])
    ratios: dict = {label: [] for label, *_ in variants}
    for round_ in range(ROUNDS):
        if round_:  # each round's own baseline: the machine's pace drifts over a minute
            baseline = bench.read_table_best(path)
        for label, options, settings, interval in variants:
            r = _one_variant(path, args, rows, options, settings, interval)
            ratio = baseline["seconds"] / r["seconds"]
            ratios[label].append(ratio)
            split = " ".join(f"{k} {v:.2f}" for k, v in r["stage_ms_per_batch"].items())
            inner = " ".join(f"{k} {v:.2f}" for k, v in r["fetch_ms_per_batch"].items())
            first = 1e3 * r["first_batch_s"]
            print(
                f"{path.name:42s} {label:28s} {r['gbps']:5.2f} GB/s  x{ratio:.2f} read_table ({baseline['gbps']:.2f})"
                f"  ms/batch {split} (fetch: {inner}); first batch {first:.0f} ms; {r['seconds'] * 1e3:.0f} ms"
                + cpu_text(r),
                flush=True,
            )
    if ROUNDS > 1:
        for label, values in ratios.items():
            values = sorted(values)
            print(
                f"{path.name:42s} {label:28s} median x{values[len(values) // 2]:.2f} read_table over {len(values)} "
                f"rounds (min {values[0]:.2f}, max {values[-1]:.2f})",
                flush=True,
            )


def _one_variant(path: Path, args, rows: int, options: dict, settings: dict, interval) -> dict:
    old = sys.getswitchinterval()
    constants = interval if isinstance(interval, dict) else {}
    saved = {name: getattr(_owner(name), name.rsplit(".", 1)[-1]) for name in constants}
    if interval and not constants:
        sys.setswitchinterval(interval)
    for name, value in constants.items():
        setattr(_owner(name), name.rsplit(".", 1)[-1], value)
    try:
        with config.override(**settings):
            return bench.fastload_run(path, args, batch_rows=rows, **options)
    finally:
        sys.setswitchinterval(old)
        for name, value in saved.items():
            setattr(_owner(name), name.rsplit(".", 1)[-1], value)


def main() -> None:
    which = sys.argv[1]
    root = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/fastload-parquet")
    if which in ("threads", "ceiling", "depth", "stages", "onecall", "atonce"):
        root.mkdir(parents=True, exist_ok=True)
        paths = [parquet_data.write_alert(root, 4_000_000, "none", 131072)]
        if which in ("ceiling", "depth", "stages", "onecall", "atonce"):
            paths.append(parquet_data.write_alert(root, 1_000_000, "snappy", 131072))
        if which == "atonce":
            paths.append(parquet_data.write_alert(root, 1_000_000, "none", 131072))
    else:
        paths = [root / name for name in FILES]
    for path in paths:
        if not path.exists():
            print("missing", path)
            continue
        run(path, SETS[which])


if __name__ == "__main__":
    main()
