"""Issue 21: the Parquet page decoder alone, nothing else: whole files decoded into the pinned
arena (torch_fastload._arrow.read_row_group) with 1, 3 and 8 row groups at once on persistent
threads (their readers opened first), 5 rounds each (median GB/s of Arrow bytes, range, and
when the first row group came back); then each column of the first file's row group 2 on one
thread, and that whole row group on one thread. parquet_timeline.py's decode-only rows time the
same call inside its run (with the cores used); this one gives each round's spread and the
per-column times.

    python3 benchmarks/gpu/parquet_decode_alone.py FILE.parquet [FILE.parquet ...]
"""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq

from torch_fastload import _arrow

_arrow.make_arena(4 << 30)


def decode(path, group, columns, threads=True):
    return _arrow.read_row_group(path, group, columns, threads, by_pages=True, into_arena=True)


for path in sys.argv[1:]:
    meta = pq.ParquetFile(path).metadata
    groups, columns = range(meta.num_row_groups), list(range(meta.num_columns))
    for at_once in (1, 3, 8):
        with ThreadPoolExecutor(at_once) as pool:
            list(pool.map(decode, [path] * len(groups), groups, [columns] * len(groups)))  # readers opened
            rates, firsts = [], []
            for _ in range(5):
                started = time.perf_counter()
                futures = [pool.submit(decode, path, g, columns) for g in groups]
                futures[0].result()
                firsts.append(time.perf_counter() - started)
                tables = [f.result() for f in futures]
                rates.append(sum(t.nbytes for t in tables) / (time.perf_counter() - started) / 1e9)
                del tables
        print(
            f"{path.rsplit('/', 1)[-1]} {at_once} at once: {statistics.median(rates):6.2f} GB/s "
            f"({min(rates):.2f}-{max(rates):.2f}); first row group {1e3 * statistics.median(firsts):.1f} ms",
            flush=True,
        )

first = sys.argv[1]
columns = list(range(pq.ParquetFile(first).metadata.num_columns))
per = []
for c in columns:
    best = 1e9
    for _ in range(5):
        started = time.perf_counter()
        decode(first, 2, [c], threads=False)
        best = min(best, time.perf_counter() - started)
    per.append(f"{1e3 * best:.2f}")
started = time.perf_counter()
decode(first, 3, columns, threads=False)
whole = 1e3 * (time.perf_counter() - started)
print(f"per column, one thread (ms): {' '.join(per)}; a row group on one thread {whole:.1f} ms")
