"""Issue 21: a per-thread timeline of one timed loader epoch over the alert table, to find the
serial chain between the decode threads, the fetch thread, the stage threads and ``next()``.

Every span is (thread, what, batch or row group, start, end) in perf_counter seconds:
  decode/prepare   a row group read by pyarrow / its tensors made (decode threads)
  credit           the fetch thread waiting for a read-ahead credit (granted by next())
  rows/tensors     the batch's rows in Arrow (waits for decodes) / its column tensors
  get/put          a pipeline thread blocked on the fetched or ready queue
  slot/memcpy/start-copy   a stage thread taking a pinned slot / copying into it / enqueueing H2D
                   (with the one-call stage, memcpy spans the copies and the device copy's enqueue)
  next             the consumer inside next()
plus a GIL probe: a thread sleeping 200 us at a time records how late it wakes (the GIL wait).

  python3 benchmarks/gpu/parquet_timeline.py DATA_DIR OUT_DIR [variant ...]
variants: default, arrow-off, pageable (no decode arena), prefetch8 (prefetch 8, 9 slots), stage4,
at-onceN (VARIANTS below). Writes timeline-<variant>.json and a summary line per
variant; benchmarks/gpu/parquet_timeline_plot.py draws the PNG.
"""

import json
import os
import sys
import threading
import time
import types
from pathlib import Path

os.environ["TORCH_FASTLOAD_TRACE"] = "1"

import torch  # noqa: E402

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

from torch_fastload import DataLoader, config, fetch, pipeline, staging, transfer  # noqa: E402
from torch_fastload.sources import (  # noqa: E402
    ParquetDataset,
    ParquetSampler,
    parquet_decode,  # noqa: E402
)
from torch_fastload.sources import parquet as pq_source  # noqa: E402

SPANS: list = []
RECORDING = threading.Event()


def span(what: str, key_of=None):
    """Wrap a function so each call, while recording, appends its span on the calling thread."""

    def wrap(fn):
        def wrapper(*args, **kwargs):
            if not RECORDING.is_set():
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = key_of(*args, **kwargs) if key_of else -1
                SPANS.append((threading.current_thread().name, what, key, started, time.perf_counter()))

        return wrapper

    return wrap


def instrument() -> None:
    cache = parquet_decode.RowGroupCache
    cache._read = span("decode", lambda self, group, names: group.index)(cache._read)
    parquet_decode.prepare_row_group = span("prepare")(parquet_decode.prepare_row_group)
    cache.get = span("rows-wait")(cache.get)
    fetch.ReadAhead.take = span("credit")(fetch.ReadAhead.take)
    pq_source.ParquetDataset._table = span("rows")(pq_source.ParquetDataset._table)
    pq_source.columns_to_tensors = span("tensors")(pq_source.columns_to_tensors)
    pq_source.range_tensors = span("tensors")(pq_source.range_tensors)
    pipeline.Pipeline._get = span("get")(pipeline.Pipeline._get)
    pipeline.Pipeline._put = span("put")(pipeline.Pipeline._put)
    staging.ParallelCopier.copy_into = span("memcpy")(staging.ParallelCopier.copy_into)
    transfer.CopyEngine.start_staged = span("memcpy")(transfer.CopyEngine.start_staged)  # + the device copy
    # the stage's parts: its layout, the batch's device memory, the C++ call, the typed views
    from torch_fastload import stager

    stager.plan_batch = span("plan")(stager.plan_batch)
    transfer.CopyEngine.reserve = span("reserve")(transfer.CopyEngine.reserve)
    if transfer._stage_host_batch is not None:
        transfer._stage_host_batch = span("native")(transfer._stage_host_batch)
    staging.StagingPlan.unpack = span("unpack")(staging.StagingPlan.unpack)


def gil_probe(stop: threading.Event, samples: list) -> None:
    """Sleep 200 us at a time; how late each wake-up comes back is the GIL's queue (+ the OS)."""
    while not stop.is_set():
        asked = 2e-4
        started = time.perf_counter()
        time.sleep(asked)
        now = time.perf_counter()
        if RECORDING.is_set():
            samples.append((started, now - started - asked))


VARIANTS = {
    "default": ({}, {}),
    "arrow-off": ({"arrow_threads": False}, {}),
    "pageable": ({"pinned_arena": 0}, {}),  # decode into Arrow's pool, staged through the slot (no arena)
    "prefetch8": ({}, {"prefetch": 8, "pool_slots": 9}),
    "stage4": ({}, {"stage_threads": 4}),
    "stage4-prefetch6": ({}, {"stage_threads": 4, "prefetch": 6, "pool_slots": 8}),
    **{f"at-once{n}": ({"row_groups_at_once": n}, {}) for n in (1, 2, 4, 6, 8, 16)},
    "python-stage": ({}, {}),  # the stage's copies and device copy as torch calls (transfer.ONE_CALL_STAGE off)
}


def decode_only(path: Path, at_once: int, arrow_threads: bool = True) -> str:
    """Every row group decoded in order on ``at_once`` threads (pyarrow's column threads on),
    nothing else: the rate, and how evenly row groups finish (the gaps between completions)."""
    from concurrent.futures import ThreadPoolExecutor

    meta = bench.pq.read_metadata(path)
    local = threading.local()
    done: list = []

    def read(i):
        if not hasattr(local, "file"):
            local.file = bench.pq.ParquetFile(path, pre_buffer=True)
        nbytes = local.file.read_row_group(i, use_threads=arrow_threads).nbytes
        done.append(time.perf_counter())
        return nbytes

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(read, range(min(at_once, meta.num_row_groups))))
        done.clear()
        started = time.perf_counter()
        nbytes = sum(pool.map(read, range(meta.num_row_groups)))
        seconds = time.perf_counter() - started
    first = 1e3 * (min(done) - started)
    gaps = sorted(b - a for a, b in zip(sorted(done), sorted(done)[1:])) or [0.0]  # one row group: none
    return (
        f"decode only, {at_once:2d} at once, arrow threads {arrow_threads}: {nbytes / seconds / 1e9:.2f} GB/s, "
        f"first row group after {first:.1f} ms, gaps between completions median {1e3 * gaps[len(gaps) // 2]:.1f} ms "
        f"max {1e3 * gaps[-1]:.1f} ms"
    )


def one(path: Path, variant: str, out: Path, read_table_s: float, rows: int) -> dict:
    options, settings = VARIANTS[variant]
    transfer.ONE_CALL_STAGE = variant != "python-stage"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with config.override(**settings):
        dataset = ParquetDataset(path, **options)
        loader = DataLoader(dataset, batch_sampler=ParquetSampler(dataset, shuffle=False).batches(rows), device=device)
        for _ in loader:  # the first epoch: pool, threads, files opened
            pass
        dataset.close()
        loader.stats(reset=True)
        SPANS.clear()
        gil: list = []
        stop = threading.Event()
        probe = threading.Thread(target=gil_probe, args=(stop, gil), name="gil-probe", daemon=True)
        probe.start()
        if device.type == "cuda":
            torch.cuda.synchronize()
        RECORDING.set()
        t0 = time.perf_counter()
        nbytes = batches = 0
        for batch in loader:
            nbytes += bench.batch_bytes(batch)
            batches += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        RECORDING.clear()
        stop.set()
        probe.join()
        trace = [t for t in _loader_trace(loader) if t[2] >= t0]
        dataset.close()
    seconds = t1 - t0
    record = {
        "variant": variant,
        "file": path.name,
        "t0": t0,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "x_read_table": read_table_s / seconds,
        "batches": batches,
        "batch_rows": rows,
        "spans": [list(s) for s in SPANS],
        "trace": [list(t) for t in trace],
        "gil": gil,
    }
    (out / f"timeline-{variant}.json").write_text(json.dumps(record))
    print(summary(record), flush=True)
    return record


def _loader_trace(loader):
    """The loader's own TORCH_FASTLOAD_TRACE spans (fetch, staged, next, ...), as (what, batch, start, end)."""
    return loader.resources.stats.trace or []


def summary(r: dict) -> str:
    """Busy seconds by (thread group, what) over the epoch, and the GIL probe's lateness."""
    t0, seconds = r["t0"], r["seconds"]
    busy: dict = {}
    for thread, what, _key, start, end in r["spans"]:
        group = "decode" if thread.startswith("fastload-parquet") else thread
        busy[(group, what)] = busy.get((group, what), 0.0) + min(end, t0 + seconds) - max(start, t0)
    parts = ", ".join(f"{g}/{w} {1e3 * s:.0f}" for (g, w), s in sorted(busy.items(), key=lambda kv: -kv[1])[:14])
    late = sorted(x for _, x in r["gil"])
    gil = (
        f"GIL probe n={len(late)} median {1e6 * late[len(late) // 2]:.0f} us "
        f"p90 {1e6 * late[int(len(late) * 0.9)]:.0f} us"
        if late
        else "no GIL samples"
    )
    return (
        f"{r['file']} {r['variant']}: {r['gbps']:.2f} GB/s x{r['x_read_table']:.2f} read_table, "
        f"{1e3 * seconds:.0f} ms, "
        f"{r['batches']} batches; {gil}\n  ms busy: {parts}"
    )


def main() -> None:
    root = Path(sys.argv[1])
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    variants = sys.argv[3:] or ["default", "arrow-off", "prefetch8"]
    instrument()
    root.mkdir(parents=True, exist_ok=True)
    big, small = (int(n) for n in os.environ.get("TIMELINE_ROWS", "4000000,1000000").split(","))
    for path in (
        parquet_data.write_alert(root, big, "none", 131072),
        parquet_data.write_alert(root, small, "snappy", 131072),
    ):
        baseline = bench.read_table_best(path)
        sizing = types.SimpleNamespace(batch_rows=65536, batch_mib=16.0)
        rows = bench.batch_rows_of(sizing, bench.pq.read_metadata(path).num_rows, baseline["nbytes"])
        print(f"{path.name}: read_table {baseline['gbps']:.2f} GB/s in {1e3 * baseline['seconds']:.0f} ms", flush=True)
        for at_once in (1, 2, 3, 4, 8, 16):
            print(f"  {decode_only(path, at_once)}", flush=True)
        print(f"  {decode_only(path, 16, arrow_threads=False)}", flush=True)
        for variant in variants:
            record = one(path, variant, out, baseline["seconds"], rows)
            os.replace(out / f"timeline-{variant}.json", out / f"timeline-{path.stem}-{variant}.json")
            del record


if __name__ == "__main__":
    main()
