"""Issue 21: the epoch's start on small files, A/B in one process. parquet.py's timed epochs
(``dataset.close()`` first, read_table run just before each, as ``fastload_run`` does), with
``parquet.DECODE_AT_ITER`` on (the epoch's first row groups decode from ``iter()`` on; with
``parquet_decode.FIRST_ALONE`` the first one alone until it is read) and off (from the fetch
thread's first batch on), interleaved round by round on the same loader.

Per file and variant: the median epoch, the first batch's time after ``iter()``, and the median
of each round's read_table / epoch ratio (parquet.py's verdict figure). One JSON under $OUT.

  PYTHONPATH=$PWD [AB_PROFILES=string:64,int:64] python3 benchmarks/gpu/epoch_start_ab.py \
      DATA_DIR [ROUNDS] [ROWS,...] [CODECS]
  (AB_PROFILES: parquet.py's profile files too, run length 1, unlimited cardinality, snappy)
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parquet as bench  # noqa: E402

from torch_fastload import DataLoader  # noqa: E402
from torch_fastload._benchutil.args import resolve_device  # noqa: E402
from torch_fastload.sources import (  # noqa: E402
    ParquetDataset,
    ParquetSampler,
    parquet_decode,  # noqa: E402
)
from torch_fastload.sources import parquet as pq_source  # noqa: E402

#: name -> (parquet.DECODE_AT_ITER, parquet_decode.FIRST_ALONE)
VARIANTS = {"at-iter-alone": (True, True), "at-iter": (True, False), "at-first-batch": (False, False)}


def use(variant: tuple) -> None:
    pq_source.DECODE_AT_ITER, parquet_decode.FIRST_ALONE = variant


def epoch(loader, device) -> tuple[float, float]:
    """(seconds, first batch seconds) of one epoch, every batch touched as parquet.py does."""
    bench.sync(device)
    started = time.perf_counter()
    first, sink = None, []
    for batch in loader:
        sink = sink[-3:] + [next(iter(batch.values())).view(-1)[-1:].float()]
        first = first or time.perf_counter() - started
    bench.sync(device)
    return time.perf_counter() - started, first


def one_file(path: Path, rounds: int, device) -> dict:
    bench.warm_page_cache([path])
    rows_total = bench.pq.read_metadata(path).num_rows
    table_bytes = bench.pq.read_table(path).nbytes
    rows = max(65536, int(16 * bench.MiB / max(1.0, table_bytes / rows_total)))  # parquet.py's batch
    dataset = ParquetDataset(path)
    loader = DataLoader(dataset, batch_sampler=ParquetSampler(dataset, shuffle=False).batches(rows), device=device)
    for variant in VARIANTS.values():  # the first epochs: pool, threads, files opened
        use(variant)
        dataset.close()
        epoch(loader, device)
    runs: dict = {name: [] for name in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS.items())
        for name, variant in order if r % 2 == 0 else order[::-1]:
            read_table_s = bench.read_table_once(path, True)
            use(variant)
            dataset.close()
            seconds, first = epoch(loader, device)
            runs[name].append({"epoch_s": seconds, "first_batch_s": first, "read_table_s": read_table_s})
    use(VARIANTS["at-iter-alone"])
    dataset.close()
    del loader
    out = {"file": path.name, "batch_rows": rows, "rounds": rounds, "runs": runs}
    for name, rs in runs.items():
        out[name] = {
            "epoch_ms": 1e3 * statistics.median(x["epoch_s"] for x in rs),
            "first_batch_ms": 1e3 * statistics.median(x["first_batch_s"] for x in rs),
            "over_read_table": statistics.median(x["read_table_s"] / x["epoch_s"] for x in rs),
            "read_table_ms": 1e3 * statistics.median(x["read_table_s"] for x in rs),
        }
        o = out[name]
        print(
            f"{path.name:<40} {name:<15} epoch {o['epoch_ms']:6.1f} ms  first batch {o['first_batch_ms']:5.1f} ms  "
            f"read_table {o['read_table_ms']:6.1f} ms  ratio (median of rounds) {o['over_read_table']:.3f}x",
            flush=True,
        )
    return out


def main() -> int:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/pqdata")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    sizes = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "240000,1000000").split(",")]
    codecs = (sys.argv[4] if len(sys.argv) > 4 else "none,snappy").split(",")
    device = resolve_device(os.environ.get("AB_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    data.mkdir(parents=True, exist_ok=True)
    results = []
    paths = [bench.write_alert(data, rows, codec, 131072) for rows in sizes for codec in codecs]
    for spec in filter(None, os.environ.get("AB_PROFILES", "").split(",")):  # e.g. string:64
        kind, mib = spec.split(":")
        paths.append(bench.write_profile(data, kind, int(mib) << 20, 1, 0, "snappy"))
    for path in paths:
        results.append(one_file(path, rounds, device))
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    out = out / "epoch_start_ab.json"
    out.write_text(json.dumps({"device": str(device), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
