"""Decodes each row group of a generated table (1M rows: a string id, a timestamp, a float, an
int, a bool; 4 row groups; snappy and uncompressed) through arrow_pool.cpp's size-class arena
and through pyarrow, checks the tables are equal, reports what went through the arena (the
table's buffers stay live in it, the rest is scratch) and times both."""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arrow_pool  # noqa: E402  (built by build.sh)


def main():
    n = 1_000_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": pa.array([f"id{v:012d}" for v in rng.integers(0, 1 << 40, n)]),
            "ts": pa.array(rng.integers(0, 1 << 50, n).astype("datetime64[us]")),
            "x": rng.standard_normal(n),
            "k": rng.integers(0, 1000, n),
            "b": rng.random(n) < 0.5,
        }
    )
    for compression in ("snappy", "none"):
        path = f"/tmp/arrow_pool-{compression}.parquet"
        pq.write_table(table, path, row_group_size=250_000, compression=compression)
        f = pq.ParquetFile(path)
        before = arrow_pool.pool_stats()
        ours = arrow_pool.read_row_group(path, 0)
        after = arrow_pool.pool_stats()
        assert ours.equals(f.read_row_group(0))
        print(
            f"{compression}: table {ours.nbytes / 1e6:.1f} MB, live in the pool {after[1] / 1e6:.1f} MB, "
            f"{(after[0] - before[0]) / 1e6:.1f} MB allocated in {after[2] - before[2]} calls "
            f"({after[3] - before[3]} reallocations moved, {after[4] - before[4]} in place); "
            f"arena carved {after[5] / 1e6:.0f} MB"
        )
        del ours
        ours_ms, theirs_ms = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for rg in range(f.num_row_groups):
                arrow_pool.read_row_group(path, rg)
            ours_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            for rg in range(f.num_row_groups):
                f.read_row_group(rg)
            theirs_ms.append((time.perf_counter() - t0) * 1e3)
        print(
            f"{compression}: 4 row groups through the pool {statistics.median(ours_ms):.0f} ms, "
            f"pyarrow's read_row_group {statistics.median(theirs_ms):.0f} ms (medians of 5)"
        )


if __name__ == "__main__":
    main()
