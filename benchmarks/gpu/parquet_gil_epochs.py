"""Issue 21: loader epochs over one alert file, back to back for SECONDS, for a sampling profiler
run beside them (``py-spy record --gil``: only the thread holding the GIL is sampled, so the
samples say what the pipeline's Python costs, thread by thread, when the GIL is the bound).

  python3 benchmarks/gpu/parquet_gil_epochs.py DATA_DIR [ROWS] [COMPRESSION] [SECONDS]
  (defaults 1000000 none 4; the file is written under DATA_DIR once)
  py-spy record --gil -r 500 -f raw -o gil.txt -- \
      python3 benchmarks/gpu/parquet_gil_epochs.py /tmp/pqdata 1000000 none 20
  python3 benchmarks/gpu/parquet_gil_epochs.py --summarize gil.txt   (GIL-held samples by thread role and frame)

Each epoch drops the decoded row groups first, as benchmarks/parquet.py's timed epochs do; the
epochs' median time is printed at the end.
"""

import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet_data  # noqa: E402

from torch_fastload import DataLoader  # noqa: E402
from torch_fastload.sources import ParquetDataset, ParquetSampler  # noqa: E402

BATCH_ROWS = 67394  # 16 MiB of the alert table's decoded columns (benchmarks/parquet.py's sizing)
ROLES = (  # (role, a frame that marks it), the first that matches
    ("close (between epochs)", "ParquetDataset.close"),
    ("epoch start (iter)", "DataLoader.__iter__"),
    ("stage threads", "_stage_loop"),
    ("fetch thread", "_fetch_loop"),
    ("decode threads", "RowGroupCache._decode"),
    ("next()", "_FastloadIter.__next__"),
)


def summarize(path: str, top: int = 30, roles_by_frame=ROLES) -> None:
    """py-spy's raw samples (``-f raw``: one stack and its count a line) by role and by frame,
    leaving out imports and the data's first write."""
    roles, frames = collections.Counter(), collections.Counter()
    total = 0
    for line in open(path):
        stack, count = line.rstrip().rsplit(" ", 1)
        if "_find_and_load" in stack or "write_alert" in stack:
            continue
        n = int(count)
        total += n
        roles[
            next((name for name, frame in roles_by_frame if frame in stack), "other" if stack else "no Python frames")
        ] += n
        for frame in set(stack.split(";")[1:]):
            frames[frame[:110]] += n
    print(f"{total} samples with the GIL held")
    for role, n in roles.most_common():
        print(f"{n:7d} {100 * n / total:5.1f}%  {role}")
    print("--- inclusive, by frame")
    for frame, n in frames.most_common(top):
        print(f"{n:7d}  {frame}")


def main() -> None:
    root = Path(sys.argv[1])
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    compression = sys.argv[3] if len(sys.argv) > 3 else "none"
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 4.0
    root.mkdir(parents=True, exist_ok=True)
    path = parquet_data.write_alert(root, rows, compression, 131072)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = ParquetDataset(path)
    batches = ParquetSampler(dataset, shuffle=False).batches(BATCH_ROWS)
    loader = DataLoader(dataset, batch_sampler=batches, device=device)
    for _ in loader:  # the pool, the threads, the arena
        pass
    epochs = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        dataset.close()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _batch in loader:
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()
        epochs.append(time.perf_counter() - started)
    epochs.sort()
    print(f"{path.name}: {len(epochs)} epochs, median {1e3 * epochs[len(epochs) // 2]:.1f} ms", flush=True)
    print(loader.stats(), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        main()
