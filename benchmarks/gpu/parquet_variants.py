"""Issue 21: the alert table through the loader to cuda under loader settings, each timed as
benchmarks/parquet.py times it (second epoch) against read_table in the same process.
Run from the repo root:  python3 benchmarks/gpu/parquet_variants.py SET [DATA_DIR]
  alert    fetch_threads 2/3, a 0.1 ms GIL switch interval, 8 row groups decoding at once (4M none, 1M snappy)
  offsets  fetch_threads 2/3/4, 6 row groups at once, alone and with fetch_threads 2 (4M none, 1M snappy)
  threads  16/12/8/6 decode threads, pyarrow's own threads on and off (4M none, written if missing)"""

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

from torch_fastload import config  # noqa: E402

FILES = ("alert-4000000-none-rg131072.parquet", "alert-1000000-snappy-rg131072.parquet")
# label, ParquetDataset options, fetch_threads, GIL switch interval (None: unchanged)
SETS = {
    "alert": [
        ("default", {}, 1, None),
        ("fetch_threads=2", {}, 2, None),
        ("fetch_threads=3", {}, 3, None),
        ("switchinterval 0.1ms", {}, 1, 1e-4),
        ("row_groups_at_once=8", {"row_groups_at_once": 8}, 1, None),
        ("fetch_threads=3 at_once=8", {"row_groups_at_once": 8}, 3, None),
        ("default again", {}, 1, None),
    ],
    "offsets": [
        ("default", {}, 1, None),
        ("fetch_threads=2", {}, 2, None),
        ("fetch_threads=3", {}, 3, None),
        ("fetch_threads=4", {}, 4, None),
        ("row_groups_at_once=6", {"row_groups_at_once": 6}, 1, None),
        ("fetch_threads=2 at_once=6", {"row_groups_at_once": 6}, 2, None),
        ("default again", {}, 1, None),
    ],
    "threads": [
        (f"threads {t:2d} arrow_threads {a!s:5s}", {"threads": t, "arrow_threads": a}, 1, None)
        for t in (16, 12, 8, 6, 16)
        for a in (True, False)
    ],
}


def run(path: Path, variants: list) -> None:
    args = types.SimpleNamespace(device=torch.device("cuda"), batch_rows=65536)
    baseline = bench.read_table_best(path)
    sizing = types.SimpleNamespace(batch_rows=65536, batch_mib=16.0)
    rows = bench.batch_rows_of(sizing, bench.pq.read_metadata(path).num_rows, baseline["nbytes"])
    for label, options, fetch_threads, interval in variants:
        old = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        try:
            with config.override(fetch_threads=fetch_threads):
                r = bench.fastload_run(path, args, batch_rows=rows, **options)
        finally:
            sys.setswitchinterval(old)
        split = " ".join(f"{k} {v:.2f}" for k, v in r["stage_ms_per_batch"].items())
        inner = " ".join(f"{k} {v:.2f}" for k, v in r["fetch_ms_per_batch"].items())
        ratio = baseline["seconds"] / r["seconds"]
        first = 1e3 * r["first_batch_s"]
        print(
            f"{path.name:42s} {label:28s} {r['gbps']:5.2f} GB/s  x{ratio:.2f} read_table ({baseline['gbps']:.2f})"
            f"  ms/batch {split} (fetch: {inner}); first batch {first:.0f} ms",
            flush=True,
        )


def main() -> None:
    which = sys.argv[1]
    root = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/fastload-parquet")
    if which == "threads":
        root.mkdir(parents=True, exist_ok=True)
        paths = [parquet_data.write_alert(root, 4_000_000, "none", 131072)]
    else:
        paths = [root / name for name in FILES]
    for path in paths:
        if not path.exists():
            print("missing", path)
            continue
        run(path, SETS[which])


if __name__ == "__main__":
    main()
