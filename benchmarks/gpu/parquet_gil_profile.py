"""Issue 21: who holds the GIL while the loader runs epochs of the 1M-row uncompressed alert file.

The small files' epochs are bound by GIL hand-offs (a thread that released the GIL for a
microsecond of C++ waits ~0.3-1 ms to get it back), so the lever is the GIL time each batch
costs, per thread role. Run the loop under py-spy, sampling only the thread that holds the GIL,
then summarise the samples by role (next(), stage threads, fetch thread, decode threads, the
start of an epoch) and by function:

  py-spy record --gil -r 500 -f raw -o gil.txt -- python3 benchmarks/gpu/parquet_gil_profile.py 20
  python3 benchmarks/gpu/parquet_gil_profile.py --summarize gil.txt

The run alone (no py-spy) prints the median epoch: `python3 benchmarks/gpu/parquet_gil_profile.py
SECONDS [DEVICE]`. py-spy is not a dependency: its wheel is carried to the GPU machine.
"""

import collections
import statistics
import sys
import time
from pathlib import Path

ROLES = (  # (role, a frame that marks it), first match wins
    ("close (the script's, between epochs)", "ParquetDataset.close"),
    ("epoch start (iter)", "DataLoader.__iter__"),
    ("stage threads", "_stage_loop"),
    ("fetch thread", "_fetch_loop"),
    ("decode threads", "RowGroupCache._decode"),
    ("next()", "_FastloadIter.__next__"),
)


def summarize(path: str, top: int = 30) -> None:
    roles, functions = collections.Counter(), collections.Counter()
    total = 0
    for line in open(path):
        stack, count = line.rstrip().rsplit(" ", 1)
        if "_find_and_load" in stack or "write_alert" in stack:  # imports and the data's first write
            continue
        n = int(count)
        total += n
        role = next((name for name, frame in ROLES if frame in stack), "no Python frames" if not stack else "other")
        roles[role] += n
        for frame in set(stack.split(";")[1:]):
            functions[frame[:110]] += n
    print(f"{total} samples with the GIL held")
    for role, n in roles.most_common():
        print(f"{n:7d} {100 * n / total:5.1f}%  {role}")
    print("--- inclusive, by frame")
    for frame, n in functions.most_common(top):
        print(f"{n:7d}  {frame}")


def run(seconds: float, device: str) -> None:
    import torch

    sys.path.insert(0, "benchmarks")
    from parquet_data import write_alert

    from torch_fastload import DataLoader
    from torch_fastload.sources import ParquetDataset, ParquetSampler

    root = Path("/tmp/pqdata")
    root.mkdir(exist_ok=True)
    dataset = ParquetDataset(write_alert(root, 1_000_000, "none", 131072))
    loader = DataLoader(dataset, batch_sampler=ParquetSampler(dataset, shuffle=False).batches(65536), device=device)
    deadline, times = time.monotonic() + seconds, []
    while time.monotonic() < deadline:
        dataset.close()  # every epoch decodes every row group again, as benchmarks/parquet.py's do
        started = time.perf_counter()
        for _ in loader:
            pass
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    print(f"median epoch {1e3 * statistics.median(times[3:]):.1f} ms over {len(times) - 3} epochs after 3")
    print(loader.stats())


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        run(float(sys.argv[1]) if len(sys.argv) > 1 else 20, sys.argv[2] if len(sys.argv) > 2 else "cuda")
