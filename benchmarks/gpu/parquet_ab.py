"""Issue 21: one tree's loader against read_table on the alert files, as benchmarks/parquet.py
times them (read_table / loader epoch pairs, interleaved; median of the pairs' ratios), printed
as one JSON line. parquet-ab.sh runs it alternately with two trees (PYTHONPATH), so a change is
measured against its parent on the same instance, not against figures from another one.

  python3 benchmarks/gpu/parquet_ab.py DATA_DIR LABEL [ROUNDS]
  env: AB_ROWS=1000000,4000000 (alert rows), AB_COMPRESSIONS=none,snappy
"""

import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet as bench  # noqa: E402
import parquet_data  # noqa: E402

import torch_fastload  # noqa: E402


def main() -> None:
    data, label = Path(sys.argv[1]), sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    rows = [int(r) for r in os.environ.get("AB_ROWS", "1000000").split(",")]
    compressions = os.environ.get("AB_COMPRESSIONS", "none,snappy").split(",")
    device = torch.device(os.environ.get("AB_DEVICE", "cuda"))
    args = types.SimpleNamespace(device=device, batch_rows=65536, batch_mib=16.0)
    out = {"label": label, "package": os.path.dirname(torch_fastload.__file__), "files": {}}
    for n in rows:
        for compression in compressions:
            path = parquet_data.write_alert(data, n, compression, 131072)
            bench.warm_page_cache([path])
            table = bench.read_table_best(path)
            batch_rows = bench.batch_rows_of(args, n, table["nbytes"])
            paired: list = []
            run = bench.fastload_run(
                path,
                args,
                batch_rows=batch_rows,
                rounds=rounds,
                between=lambda p=paired, f=path, t=table["use_threads"]: p.append(bench.read_table_once(f, t)),
            )
            ratios = [t / e for t, e in zip(paired, run["epochs_s"])]
            out["files"][f"{n // 1000}K-{compression}"] = {
                "over_read_table": statistics.median(ratios),
                "ratios": [round(r, 3) for r in ratios],
                "epoch_ms": [round(1e3 * s, 2) for s in run["epochs_s"]],
                "read_table_ms": [round(1e3 * s, 2) for s in paired],
                "first_batch_ms": round(1e3 * run["first_batch_s"], 2),
                "stage_ms_per_batch": {k: round(v, 3) for k, v in run["stage_ms_per_batch"].items()},
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
