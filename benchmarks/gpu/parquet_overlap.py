#!/usr/bin/env python3
"""Issue 21: parquet.py's overlap row alone, in a fresh process: a bf16 GEMM step (1.2x the
loader's own per-batch time on shuffled 16,384-row batches of the 1M-row snappy alert file) fed
by the loader against the same step on device-resident copies, ``--overlap-rounds`` interleaved
pairs. One JSON line on stdout, with the ``output_stream`` in effect (set it with
TORCH_FASTLOAD_OUTPUT_STREAM to compare the two allocations). From the repo root:

  PYTHONPATH=$PWD python3 benchmarks/gpu/parquet_overlap.py [DATA_DIR] [STEPS] [ROUNDS]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parquet  # noqa: E402

from torch_fastload import config  # noqa: E402
from torch_fastload._benchutil.args import resolve_device  # noqa: E402

data = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/pqdata")
args = argparse.Namespace(
    device=resolve_device("cuda"),
    batch_rows=65536,
    batch_mib=16.0,
    overlap_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 60,
    overlap_rounds=int(sys.argv[3]) if len(sys.argv) > 3 else 1,
    dir=data,
)
data.mkdir(parents=True, exist_ok=True)
result = parquet.overlap(args, parquet.write_alert(data, 1_000_000, "snappy", 131072))
result["output_stream"] = config.get("output_stream")
print(json.dumps(result))
