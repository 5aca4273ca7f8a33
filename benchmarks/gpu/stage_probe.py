"""What one Parquet batch's stage costs, step by step: the Python route (torch calls) against
the one-call stage (``transfer.ONE_CALL_STAGE``), each alone, beside one thread spinning Python
(a training loop's stand-in: every GIL release then waits up to the 5 ms switch interval) and
beside 8 threads decoding row groups as the loader's do (cores and the GIL contended).

    python3 benchmarks/gpu/stage_probe.py [DATA_DIR]     (CUDA; ~1 min; ms per call, mean)
"""

import collections
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

from torch_fastload import DataLoader, stager, staging, transfer  # noqa: E402
from torch_fastload.sources import (  # noqa: E402
    ParquetDataset,
    ParquetSampler,
    parquet_tensors,  # noqa: E402
)

SECONDS = collections.defaultdict(list)
BATCH_ROWS = 67517  # the alert table's 16 MiB batch in benchmarks/parquet.py


def timed(name, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[name].append(time.perf_counter() - started)

    return wrapper


def instrument() -> None:
    stager.plan_batch = timed("plan_batch", stager.plan_batch)
    staging.StagingPlan.unpack = timed("unpack", staging.StagingPlan.unpack)
    staging._native_copy = timed("native_copy", staging._native_copy)
    staging._native_rebase = timed("rebase", staging._native_rebase)
    staging.ParallelCopier.copy_into = timed("copy_into", staging.ParallelCopier.copy_into)
    transfer.CopyEngine.start = timed("engine.start", transfer.CopyEngine.start)
    transfer.CopyEngine.start_staged = timed("engine.start_staged", transfer.CopyEngine.start_staged)
    transfer.CopyEngine.reserve = timed("engine.reserve", transfer.CopyEngine.reserve)
    transfer.CopyEngine.hand_off = timed("hand_off", transfer.CopyEngine.hand_off)
    stager.BatchStager.stage = timed("stage (total)", stager.BatchStager.stage)


def report(label: str) -> None:
    print(label, " | ".join(f"{k} {1e3 * sum(v) / len(v):.3f}" for k, v in SECONDS.items() if v), flush=True)
    SECONDS.clear()


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fastload-parquet")
    root.mkdir(parents=True, exist_ok=True)
    path = parquet_data.write_alert(root, 4_000_000, "none", 131072)
    instrument()
    dataset = ParquetDataset(path)
    loader = DataLoader(
        dataset, batch_sampler=ParquetSampler(dataset, shuffle=False).batches(BATCH_ROWS), device="cuda"
    )
    for _ in loader:  # the pool, the copy stream, the decode threads
        pass
    resources = loader.resources
    consumer = torch.cuda.current_stream()
    one = stager.BatchStager(resources, collated=True, stop=threading.Event(), poll=0.05, consumer=consumer)
    batches = [dataset.__fastload_batch__(range(i * BATCH_ROWS, (i + 1) * BATCH_ROWS)) for i in range(20)]

    def stage_all(rounds: int = 3) -> None:
        for _ in range(rounds):
            for k, batch in enumerate(batches):
                resources.engine.hand_off(one.stage(k, batch).copy)
        torch.cuda.synchronize()

    def spin(stop):
        while not stop.is_set():
            sum(range(1000))

    def decode(k, stop):
        file = bench.pq.ParquetFile(path, pre_buffer=True)
        while not stop.is_set():
            table = file.read_row_group(k % file.num_row_groups, use_threads=True)
            parquet_tensors.prepare_row_group(dataset.plan.columns, table)
            k += 8

    for one_call in (False, True, False, True):
        transfer.ONE_CALL_STAGE = one_call
        route = "one-call stage" if one_call else "Python stage"
        stage_all(1)
        SECONDS.clear()
        stage_all()
        report(f"{route}, alone:")
        for label, target, count in (("one pure-Python thread", spin, 1), ("8 decoding threads", decode, 8)):
            stop = threading.Event()
            threads = [
                threading.Thread(target=target, args=(stop,) if count == 1 else (k, stop), daemon=True)
                for k in range(count)
            ]
            for thread in threads:
                thread.start()
            time.sleep(0.2)
            stage_all()
            report(f"{route}, beside {label}:")
            stop.set()
            for thread in threads:
                thread.join()


if __name__ == "__main__":
    main()
