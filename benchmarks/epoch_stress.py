#!/usr/bin/env python3
"""Back-to-back short epochs on each loader path, for hangs at start and shutdown: on the CPU
(any machine) or, with ``--device cuda``, through the GPU paths (copies, events, the hand-over
to the training stream, and a stop that waits for the copies). Every third epoch breaks early
(the iterator is dropped mid-epoch); every whole epoch must deliver each sample once. A path
that makes no progress for --stall seconds dumps every thread's stack (faulthandler) and the
script exits 1; a wrong epoch exits 1 too.

It found the native loop's stop race (benchmarks/JOURNAL.md, twenty-first session): `stop()`
raised its flag without the workers' mutex, and the join at an epoch's end hung after 22,000
epochs of `tensors` on a 2-core machine; after the fix 592,418 epochs ran in 20 minutes.

    python benchmarks/epoch_stress.py                          # every path, 60 s each
    python benchmarks/epoch_stress.py --seconds 1200 tensors   # one path, longer
    python benchmarks/epoch_stress.py --device cuda            # the GPU paths (GPU machine)
"""

import argparse
import faulthandler
import os
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

import torch_fastload
from torch_fastload import ArrayDataset, DataLoader

PATHS = ("tensors", "python", "arrays", "parquet", "workers", "images")


class _PerSample(Dataset):
    """Per-sample Python, fetched by torch's worker processes."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return torch.full((4,), i), i


def _loader_factory(path: str, tmp: str, device: str = "cpu"):
    """(a function making a fresh loader, a function giving a batch's sample ids or None)."""
    if path in ("tensors", "python"):
        data = TensorDataset(torch.randn(64, 4, 6), torch.arange(64))
        return lambda: DataLoader(data, batch_size=2, shuffle=True, device=device), lambda b: b[1]
    if path == "arrays":
        file = os.path.join(tmp, "rows.npy")
        np.save(file, np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
        data = ArrayDataset(file)
        return lambda: DataLoader(data, batch_size=4, shuffle=True, device=device), lambda b: (b[:, 0] // 8).long()
    if path == "workers":
        per_sample = _PerSample()
        return lambda: DataLoader(per_sample, batch_size=4, shuffle=True, num_workers=2, device=device), lambda b: b[1]
    if path == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        from torch_fastload.sources import ParquetDataset

        file = os.path.join(tmp, "rows.parquet")
        pq.write_table(pa.table({"x": np.arange(256), "s": [str(i) for i in range(256)]}), file, row_group_size=32)
        data = ParquetDataset(file, threads=2)
        return lambda: DataLoader(data, batch_size=16, shuffle=True, device=device), lambda b: b["x"]
    if path == "images":
        from torch_fastload.sources import ImageFolder
        from torch_fastload.vision import TrainTransform
        from torch_fastload.vision.sample_data import make_image_folder

        train, _ = make_image_folder(tmp, classes=3, train_per_class=8, val_per_class=1, progress=False)
        data = ImageFolder(train, TrainTransform(), seed=7)
        return lambda: DataLoader(data, batch_size=4, shuffle=True, device=device), None
    raise ValueError(f"unknown path {path!r}; one of {PATHS}")


def stress(path: str, seconds: float, stall: float, device: str = "cpu") -> int:
    """Epochs of ``path`` for ``seconds``; returns the number run (raises on a wrong epoch)."""
    with tempfile.TemporaryDirectory() as tmp:
        make, ids = _loader_factory(path, tmp, device)
        started = time.monotonic()
        epochs = 0
        faulthandler.dump_traceback_later(stall, exit=True)
        with torch_fastload.config.override(native="off" if path == "python" else "auto"):
            while time.monotonic() - started < seconds:
                loader = make()
                seen = []
                for k, batch in enumerate(loader):
                    if epochs % 3 == 1 and k == 2:
                        break  # dropped mid-epoch
                    if ids is not None:
                        seen.append(ids(batch))
                if ids is not None and epochs % 3 != 1:
                    got = sorted(torch.cat(seen).tolist())
                    if got != list(range(len(loader.dataset))):
                        raise AssertionError(f"{path}: epoch {epochs} delivered {len(got)} samples, not each once")
                epochs += 1
                faulthandler.cancel_dump_traceback_later()
                faulthandler.dump_traceback_later(stall, exit=True)
        faulthandler.cancel_dump_traceback_later()
        took = time.monotonic() - started
        print(f"{path} ({device}): {epochs} epochs in {took:.0f} s, no hang ({loader.stats().path})")
        return epochs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", metavar="PATH", help=f"any of {', '.join(PATHS)} (default: all)")
    parser.add_argument("--seconds", type=float, default=60.0, help="per path (default 60)")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds without an epoch that count as a hang")
    parser.add_argument("--device", default="cpu", help="where batches go: cpu (default) or cuda (the GPU paths)")
    args = parser.parse_args(argv)
    unknown = [path for path in args.paths if path not in PATHS]
    if unknown:
        parser.error(f"unknown path(s) {unknown}; choose from {', '.join(PATHS)}")
    for path in args.paths or PATHS:
        stress(path, args.seconds, args.stall, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
