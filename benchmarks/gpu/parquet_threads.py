"""Issue 21: the alert table (4M rows, uncompressed) through the loader to cuda at 16/12/8/6
decode threads, pyarrow's own threads on and off, against read_table in the same process.
Run from the repo root: python3 benchmarks/gpu/parquet_threads.py   (~2 min on an H200)"""

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

root = Path("/tmp/fastload-parquet")
root.mkdir(exist_ok=True)
path = parquet_data.write_alert(root, 4_000_000, "none", 131072)
args = types.SimpleNamespace(device=torch.device("cuda"), batch_rows=65536)
baseline = bench.read_table_best(path)
sizing = types.SimpleNamespace(batch_rows=65536, batch_mib=16.0)
rows = bench.batch_rows_of(sizing, bench.pq.read_metadata(path).num_rows, baseline["nbytes"])
for threads in (16, 12, 8, 6, 16):
    for arrow_threads in (True, False):
        r = bench.fastload_run(path, args, batch_rows=rows, threads=threads, arrow_threads=arrow_threads)
        print(
            f"threads {threads:2d} arrow_threads {arrow_threads!s:5s}: {r['gbps']:.2f} GB/s "
            f"x{baseline['seconds'] / r['seconds']:.2f} read_table ({baseline['gbps']:.2f})  "
            f"stage {r['stage_ms_per_batch']}  fetch {r['fetch_ms_per_batch']}",
            flush=True,
        )
