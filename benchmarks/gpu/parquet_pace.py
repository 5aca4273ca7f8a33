#!/usr/bin/env python3
"""Issue 21: the loader's own pace over parquet.py's overlap batches is bimodal (a batch of the
1M snappy alert file took 4.0-5.1 ms in most epochs and 7.6-7.8 ms in others, so the
overlap row's step, sized from one such epoch, was sometimes shorter than the loader's pace
beside it: RESULTS.md, twenty-fourth session). This runs the loader alone, epoch after epoch in
one process, with two kinds of epoch interleaved:

- ``closed``: ``dataset.close()`` first (as ``parquet.fastload_run`` times an epoch), a whole epoch;
- ``feed``: a new iterator over the kept cache, WARMUP + STEPS batches, then closed mid-epoch
  (as the overlap row's feeds).

Each epoch records ms a batch (after the first), the spread of batch intervals, the dataset's
fetch split (rows in Arrow / tensors), the loader's stage seconds, CPU seconds by thread group,
involuntary context switches and minor page faults, so a slow epoch says where its time went.
One JSON, $OUT/parquet_pace.json (the current folder without $OUT), a line an epoch on stdout.
From the repo root, on a GPU host (run it once per ``ARROW_DEFAULT_MEMORY_POOL`` to compare pyarrow's
allocators):

  PYTHONPATH=$PWD python3 benchmarks/gpu/parquet_pace.py [DATA_DIR] [ROUNDS] [STEPS]
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parquet  # noqa: E402

from torch_fastload import DataLoader  # noqa: E402
from torch_fastload._benchutil.args import resolve_device  # noqa: E402
from torch_fastload._benchutil.timing import ThreadCpu  # noqa: E402
from torch_fastload.sources import ParquetDataset, ParquetSampler  # noqa: E402

WARMUP = 4


def main() -> int:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/pqdata")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    device = resolve_device(os.environ.get("PACE_DEVICE", "cuda"))  # cpu: a smoke run
    data.mkdir(parents=True, exist_ok=True)
    path = parquet.write_alert(data, 1_000_000, "snappy", 131072)
    rows = parquet.overlap_batch_rows(65536)  # the overlap row's batch at parquet.py's defaults
    dataset = ParquetDataset(path)
    loader = DataLoader(
        dataset, batch_sampler=ParquetSampler(dataset, shuffle=True, seed=1).batches(rows), device=device
    )
    pool = os.environ.get("ARROW_DEFAULT_MEMORY_POOL", "default") + f" ({pa.default_memory_pool().backend_name})"

    def epoch(kind: str) -> dict:
        if kind == "closed":
            dataset.close()
        wanted = len(loader) if kind == "closed" else WARMUP + steps
        dataset.fetch_seconds = dict.fromkeys(dataset.fetch_seconds, 0.0)
        loader.stats(reset=True)
        cpu = ThreadCpu()
        cpu.snapshot()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        threads: dict = {}
        parquet.sync(device)
        marks = [time.perf_counter()]
        batches = iter(loader)
        sink = []
        for n, batch in zip(range(wanted), batches):
            sink = sink[-3:] + [next(iter(batch.values())).view(-1)[-1:].float()]
            marks.append(time.perf_counter())
            if n == wanted - 2:
                threads = cpu.since()  # while the loader's threads are there
        parquet.sync(device)
        marks[-1] = time.perf_counter()
        batches.close()
        after = resource.getrusage(resource.RUSAGE_SELF)
        intervals = np.diff(marks[1:]) * 1e3  # after the first batch
        stats = loader.stats()
        got = len(marks) - 1
        return {
            "kind": kind,
            "batches": got,
            "ms_per_batch": float(intervals.mean()),
            "first_ms": (marks[1] - marks[0]) * 1e3,
            "interval_ms_p50_p90_max": [float(np.percentile(intervals, q)) for q in (50, 90, 100)],
            "fetch_ms_per_batch": {k: 1e3 * v / got for k, v in dataset.fetch_seconds.items()},
            "stage_ms_per_batch": {k: 1e3 * v / got for k, v in stats.stage_s.items() if v},
            "threads_cpu_s": {k: round(v["cpu_s"], 4) for k, v in threads.items()},
            "threads_preempted": {k: v["preempted"] for k, v in threads.items() if v["preempted"]},
            "minor_faults": after.ru_minflt - usage.ru_minflt,
            "involuntary_switches": after.ru_nivcsw - usage.ru_nivcsw,
            "voluntary_switches": after.ru_nvcsw - usage.ru_nvcsw,
        }

    epochs = []
    for r in range(rounds):
        for kind in ("closed", "feed"):
            e = epoch(kind)
            e["round"] = r
            epochs.append(e)
            cpu_total = sum(e["threads_cpu_s"].values())
            print(
                f"{pool} round {r:2d} {kind:<6} {e['ms_per_batch']:5.2f} ms/batch "
                f"(p50 {e['interval_ms_p50_p90_max'][0]:5.2f} p90 {e['interval_ms_p50_p90_max'][1]:5.2f} "
                f"max {e['interval_ms_p50_p90_max'][2]:6.2f}) first {e['first_ms']:6.1f} ms  "
                f"fetch {e['fetch_ms_per_batch']}  cpu {cpu_total:5.2f} s  "
                f"faults {e['minor_faults']:7d}  preempted {e['involuntary_switches']:5d}",
                flush=True,
            )
    dataset.close()
    for kind in ("closed", "feed"):
        paces = sorted(round(e["ms_per_batch"], 2) for e in epochs if e["kind"] == kind)
        print(f"{pool} {kind:<6} ms/batch sorted: {paces}")
    out = (
        Path(os.environ.get("OUT", ".")) / f"parquet_pace-{os.environ.get('ARROW_DEFAULT_MEMORY_POOL', 'default')}.json"
    )
    out.write_text(json.dumps({"pool": pool, "batch_rows": rows, "steps": steps, "epochs": epochs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
