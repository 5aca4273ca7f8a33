"""Issue 21: a per-thread timeline of one timed loader epoch over the alert table, to find the
serial chain between the decode threads, the fetch thread, the stage threads and ``next()``.

Every span is (thread, what, batch or row group, start, end) in perf_counter seconds:
  queued           a row group's decode submitted and not yet started by a decode thread
  decode/prepare   a row group read by pyarrow / its tensors made (decode threads)
  credit           the fetch thread waiting for a read-ahead credit (granted by next())
  rows/tensors     the batch's rows in Arrow (waits for decodes) / its column tensors
  get/put          a pipeline thread blocked on the fetched or ready queue
  slot/memcpy/start-copy   a stage thread taking a pinned slot / copying into it / enqueueing H2D
                   (with the one-call stage, memcpy spans the copies and the device copy's enqueue)
  next             the consumer inside next()
plus a GIL probe: a thread sleeping 200 us at a time records how late it wakes (the GIL wait),
the loader's own stats (the device copies' GB/s from their events), and over three more
untraced epochs the cores each thread group used, page faults and context switches (ThreadCPU).

  python3 benchmarks/gpu/parquet_timeline.py DATA_DIR OUT_DIR [variant ...]
  env: TIMELINE_ROWS=4000000,1000000 (the two files), TIMELINE_AT_ONCE=1,2,3,4,8,16 (decode-only rows),
       TIMELINE_REPEAT=1 (the variants' list run this many times, interleaved)
variants: default, arrow-off, pageable (no decode arena), prefetch8 (prefetch 8, 9 slots), prefetchP-slotsS, stage4
(stage_threads=4: threads copying into a slot; the pipeline's stage threads stay 2),
at-onceN, host (batches on the CPU), switchNus (the interpreter's switch interval), cpuN and
cpuN-at-onceM (pyarrow's CPU pool at N threads), leftN (parquet_cores_left=N), pipeline-stagesN
(the pipeline's stage threads) (VARIANTS below).
Writes timeline-<variant>.json and a summary per variant; benchmarks/gpu/parquet_timeline_plot.py draws the PNG.
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
    submitted: dict = {}
    start, decode = cache._start, cache._decode

    def _start(self, index):
        if RECORDING.is_set() and index not in self.entries:
            submitted[index] = time.perf_counter()
        return start(self, index)

    def _decode(self, index, order=-1):
        if RECORDING.is_set() and index in submitted:
            SPANS.append((threading.current_thread().name, "queued", index, submitted.pop(index), time.perf_counter()))
        return decode(self, index, order)

    cache._start, cache._decode = _start, _decode
    cache._read = span("decode", lambda self, group, names, order=-1: group.index)(cache._read)
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
    # the pipeline's depth (read-ahead credits) apart from its pinned slots
    **{f"prefetch{p}-slots{s}": ({}, {"prefetch": p, "pool_slots": s}) for p in (2, 4, 5, 8) for s in (3, 4, 6, 9)},
    "stage4-prefetch6": ({}, {"stage_threads": 4, "prefetch": 6, "pool_slots": 8}),
    **{
        f"deep-at-once{n}": ({"row_groups_at_once": n}, {"stage_threads": 4, "prefetch": 8, "pool_slots": 10})
        for n in (3, 4, 6, 8)
    },
    **{f"at-once{n}": ({"row_groups_at_once": n}, {}) for n in (1, 2, 4, 6, 8, 12, 16)},
    "python-stage": ({}, {}),  # the stage's copies and device copy as torch calls (transfer.ONE_CALL_STAGE off)
    "host": ({}, {}),  # batches on the CPU: no arena, no copies to the GPU
    # pyarrow's CPU pool (the column decodes) smaller than the machine: cores left to the
    # pipeline's Python threads and the training thread (a GIL holder preempted by a decode
    # thread stalls every thread waiting for the GIL)
    **{f"cpu{n}": ({}, {}) for n in (8, 10, 12, 13, 14)},
    # the pipeline's stage threads (pipeline.STAGE_THREADS, a constant 2; a stalled one halves the stage)
    **{f"pipeline-stages{n}": ({}, {}) for n in (3, 4)},
    # the loader's own setting of that (ParquetDataset._leave_cores; the default is 6)
    **{f"left{n}": ({}, {"parquet_cores_left": n}) for n in (0, 2, 4, 6)},
    **{
        f"left{n}-at-once{m}": ({"row_groups_at_once": m}, {"parquet_cores_left": n}) for n in (0, 4, 6) for m in (4, 6)
    },
    **{f"cpu{n}-at-once{m}": ({"row_groups_at_once": m}, {}) for n in (10, 12, 13, 14) for m in (4, 6, 8)},
    # the interpreter's switch interval (5 ms by default): how long a thread wanting the GIL back
    # waits for one running Python; a shorter one tells whether the decodes wait for the GIL
    **{f"switch{us}us": ({}, {}) for us in (100, 500, 1000)},
    **{f"switch100us-at-once{n}": ({"row_groups_at_once": n}, {}) for n in (6, 12)},
}


class ThreadCPU:
    """Cores used by each thread group of this process over a window: /proc/self/task read every
    10 ms by a thread of its own (the loader's threads end with their epoch; each keeps its last
    reading), named by the Python thread's name, else the kernel's (pyarrow's pools, CUDA's and
    the engine's threads); the total from getrusage."""

    def __init__(self):
        self.seen: dict = {}  # tid -> [name, cpu seconds at the first reading, latest]
        self.stop = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def _read(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/self/task/{tid}/status") as f:
                    waits = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
            except (OSError, StopIteration):  # the thread ended
                continue
            cpu = (int(fields[11]) + int(fields[12])) / self.tick
            entry = self.seen.setdefault(int(tid), [None, cpu, cpu, waits, waits])
            entry[0] = entry[0] or names.get(int(tid)) or f"native:{comm}"
            entry[2], entry[4] = cpu, waits

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            self._read()

    def __enter__(self):
        import resource

        self._read()
        self.started, self.rusage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        self.thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        import resource

        self.stop.set()
        self.thread.join()
        self._read()
        seconds = time.perf_counter() - self.started
        now = resource.getrusage(resource.RUSAGE_SELF)
        user, system = now.ru_utime - self.rusage.ru_utime, now.ru_stime - self.rusage.ru_stime
        faults = now.ru_minflt - self.rusage.ru_minflt
        waits, preempted = now.ru_nvcsw - self.rusage.ru_nvcsw, now.ru_nivcsw - self.rusage.ru_nivcsw
        groups: dict = {}  # group -> [cpu seconds, waits]
        for name, first, latest, first_waits, latest_waits in self.seen.values():
            group = groups.setdefault(name.rstrip("0123456789._-").rstrip("0123456789._-"), [0.0, 0])
            group[0] += latest - first
            group[1] += latest_waits - first_waits
        parts = ", ".join(
            f"{g} {u / seconds:.2f} ({w / seconds / 1e3:.1f}k waits/s)"
            for g, (u, w) in sorted(groups.items(), key=lambda kv: -kv[1][0])
            if u > 0 or w > 0
        )
        self.report = (
            f"cores used {(user + system) / seconds:.2f} ({system / seconds:.2f} in the kernel) over {seconds:.2f} s, "
            f"{faults / seconds / 1e3:.0f}k page faults/s, context switches/s {waits / seconds / 1e3:.0f}k waiting, "
            f"{preempted / seconds / 1e3:.0f}k preempted ({parts})"
        )


def decode_only(path: Path, at_once: int, arrow_threads: bool = True, arena: bool = False) -> str:
    """Every row group decoded in order on ``at_once`` threads (pyarrow's column threads on),
    nothing else: the rate, how evenly row groups finish (the gaps between completions), and
    the cores it used. ``arena``: through ``_arrow.read_row_group`` into the decode arena (the
    loader's own decode call) instead of pyarrow's Python API."""
    from concurrent.futures import ThreadPoolExecutor

    from torch_fastload.sources import parquet_arena

    meta = bench.pq.read_metadata(path)
    local = threading.local()
    done: list = []
    columns = list(range(meta.num_columns))
    decode = parquet_arena.decoder(torch.device("cuda"), 2 << 30) if arena else None
    if arena and decode is None:
        return f"decode only into the arena: unavailable ({parquet_arena.unavailable_reason()})"

    def read(i):
        if decode is not None:
            nbytes = decode(str(path), i, columns, arrow_threads).nbytes
        else:
            if not hasattr(local, "file"):
                local.file = bench.pq.ParquetFile(path, pre_buffer=True)
            nbytes = local.file.read_row_group(i, use_threads=arrow_threads).nbytes
        done.append(time.perf_counter())
        return nbytes

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(read, range(min(at_once, meta.num_row_groups))))
        done.clear()
        with ThreadCPU() as cpu:
            started = time.perf_counter()
            nbytes = 0
            for _ in range(3):  # three passes: the CPU clock ticks at 10 ms
                nbytes += sum(pool.map(read, range(meta.num_row_groups)))
            seconds = time.perf_counter() - started
        cores = cpu.report
    first = 1e3 * (min(done) - started)
    gaps = sorted(b - a for a, b in zip(sorted(done), sorted(done)[1:])) or [0.0]  # one row group: none
    return (
        f"decode only{' into the arena' if arena else ''}, {at_once:2d} at once, arrow threads {arrow_threads}: "
        f"{nbytes / seconds / 1e9:.2f} GB/s, first row group after {first:.1f} ms, gaps between completions median "
        f"{1e3 * gaps[len(gaps) // 2]:.1f} ms max {1e3 * gaps[-1]:.1f} ms; {cores}"
    )


def one(path: Path, variant: str, out: Path, read_table_s: float, rows: int) -> dict:
    options, settings = VARIANTS[variant]
    transfer.ONE_CALL_STAGE = variant != "python-stage"
    switch, arrow_cpus = sys.getswitchinterval(), bench.pa.cpu_count()
    if variant.startswith("switch"):
        sys.setswitchinterval(int(variant[len("switch") :].split("us")[0]) * 1e-6)
    if variant.startswith("cpu"):
        bench.pa.set_cpu_count(int(variant[len("cpu") :].split("-")[0]))
    stage_threads = pipeline.STAGE_THREADS
    if variant.startswith("pipeline-stages"):
        pipeline.STAGE_THREADS = int(variant[len("pipeline-stages") :])
    try:
        return _one(path, variant, out, read_table_s, rows, options, settings)
    finally:
        sys.setswitchinterval(switch)
        bench.pa.set_cpu_count(arrow_cpus)
        pipeline.STAGE_THREADS = stage_threads


def _one(path: Path, variant: str, out: Path, read_table_s: float, rows: int, options: dict, settings: dict) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and variant != "host" else "cpu")
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
        stats = str(loader.stats())  # the copy stage's GB/s: the device copies' own events
        with ThreadCPU() as cpu:  # three more epochs, untraced, for the cores each thread group uses
            for _ in range(3):
                dataset.close()  # its decoded row groups dropped, as before the timed epoch
                for _batch in loader:
                    pass
            if device.type == "cuda":
                torch.cuda.synchronize()
        cores = cpu.report
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
        "cores": cores,
        "stats": stats,
    }
    (out / f"timeline-{variant}.json").write_text(json.dumps(record))
    print(summary(record), flush=True)
    print("  " + stats.replace("\n", "\n  "), flush=True)
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
        f"{r['batches']} batches; {gil}\n  ms busy: {parts}\n  three more epochs: {r['cores']}"
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
        for at_once in [int(n) for n in os.environ.get("TIMELINE_AT_ONCE", "1,2,3,4,8,16").split(",") if n]:
            print(f"  {decode_only(path, at_once)}", flush=True)
            if torch.cuda.is_available():
                print(f"  {decode_only(path, at_once, arena=True)}", flush=True)
        print(f"  {decode_only(path, 16, arrow_threads=False)}", flush=True)
        for variant in variants * int(os.environ.get("TIMELINE_REPEAT", "1")):  # interleaved repeats
            record = one(path, variant, out, baseline["seconds"], rows)
            os.replace(out / f"timeline-{variant}.json", out / f"timeline-{path.stem}-{variant}.json")
            del record


if __name__ == "__main__":
    main()
