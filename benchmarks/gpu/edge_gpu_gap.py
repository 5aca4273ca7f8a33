#!/usr/bin/env python3
"""Issue 17: where the GPU waits at an epoch's edge (GPU host). beside_step.py's quick GEMM row
costs TensorDataset ~1.6-2.4 ms of step time an epoch and ArrayDataset (mapped) <= 0.4 ms, at the
same route (copy engines) and host edges within 0.5 ms of each other (thirty-third session).
This times, with CUDA events on the training stream, the GPU's idle gap before each step
(its start event after the previous step's end event): inside an epoch and at its first step,
for both feeds and for device-resident batches cut into epochs of the same length (control),
beside the torch caching allocator's counters for each epoch (device allocations and frees,
retries, syncs of all streams) and the host's edge. The feeds alternate for ``--rounds`` rounds.

  OUT=... PYTHONPATH=$PWD python3 benchmarks/gpu/edge_gpu_gap.py [--data-gib 0.5] [--epochs 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from beside_step import GemmStep, feeds, first_field, make_data  # noqa: E402

from torch_fastload._benchutil import InflightWindow, h2d_copy_seconds  # noqa: E402

ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
FEEDS = ("TensorDataset (C++ loop, default: auto)", "ArrayDataset mapped (default: auto)")


def epochs_of(make, batches_per_epoch: int, resident: list | None, paths: list | None = None):
    """``(epoch, batch, edge)`` for each batch of ``make()``'s loader, reused epoch after epoch
    (closed when the generator is), ``edge`` the host's seconds from the next() that ended the
    epoch to the next epoch's first batch (0 elsewhere); for ``resident``, its batches cycled
    and numbered into epochs of the loader's length. ``paths`` gets the loader's path (its route)
    at the end."""
    if resident is not None:
        i = 0
        while True:
            yield i // batches_per_epoch, resident[i % len(resident)], 0.0
            i += 1
    loader = make()
    try:
        epoch, it = 0, iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(it)
                edge = 0.0
            except StopIteration:
                epoch += 1
                it = iter(loader)
                batch = next(it)
                edge = time.perf_counter() - asked
            yield epoch, batch, edge
    finally:
        if paths is not None:
            paths.append(loader.stats().path)
        loader.close()


def run(make, step, batches_per_epoch: int, epochs: int, warmup_epochs: int, resident=None) -> dict:
    window = InflightWindow(torch.device("cuda"), 2)
    marks, edges, counters = [], [], []
    paths: list[str] = []
    source = epochs_of(make, batches_per_epoch, resident, paths)
    last_epoch, position = -1, 0
    for epoch, batch, edge in source:
        if epoch >= warmup_epochs + epochs:
            break
        timed = epoch >= warmup_epochs
        if epoch != last_epoch:
            if timed:
                stats = torch.cuda.memory_stats()
                counters.append({k: stats.get(k, 0) for k in ALLOCATOR_KEYS})
                if edge:
                    edges.append(edge)
            last_epoch, position = epoch, 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(first_field(batch))
        end.record()
        if timed:
            marks.append((epoch, position, start, end))
        position += 1
        window.step_done()
    window.drain()
    source.close()
    within, at_edge, steps = [], [], []
    by_position: dict[int, list[float]] = {}
    epoch_starts = [start for _, position, start, _ in marks if position == 0]
    for (e0, _, _, end0), (e1, position, start1, end1) in zip(marks, marks[1:]):
        gap = end0.elapsed_time(start1)
        (at_edge if e1 != e0 else within).append(gap)
        by_position.setdefault(position, []).append(gap)
        steps.append(start1.elapsed_time(end1))
    epoch_ms = [a.elapsed_time(b) for a, b in zip(epoch_starts, epoch_starts[1:])]
    per_epoch = [{k: b[k] - a[k] for k in ALLOCATOR_KEYS} for a, b in zip(counters, counters[1:])]
    return {
        "gap_within_ms": {"median": statistics.median(within), "mean": statistics.fmean(within)},
        "gap_at_edge_ms": {"median": statistics.median(at_edge), "mean": statistics.fmean(at_edge), "all": at_edge},
        "gap_by_position_ms": {p: statistics.fmean(g) for p, g in sorted(by_position.items())},
        "step_ms_median": statistics.median(steps),
        "path": paths[0] if paths else "",
        "epoch_ms_median": statistics.median(epoch_ms),
        "host_edge_ms_median": statistics.median(edges) * 1e3 if edges else 0.0,
        "allocator_per_epoch": {k: statistics.fmean(p[k] for p in per_epoch) for k in ALLOCATOR_KEYS}
        if per_epoch
        else {},
    }


def describe(res: dict) -> str:
    within, edge = res["gap_within_ms"], res["gap_at_edge_ms"]
    alloc = ", ".join(f"{key.removeprefix('num_')} {v:.1f}" for key, v in res["allocator_per_epoch"].items())
    by_position = " ".join(f"{g:.2f}" for g in res["gap_by_position_ms"].values())
    return (
        f"epoch {res['epoch_ms_median']:.2f} ms, mean gap by position {by_position}; "
        f"gap within {within['median']:.3f} ms (mean {within['mean']:.3f}), at the edge {edge['median']:.3f} "
        f"(mean {edge['mean']:.3f}); step {res['step_ms_median']:.3f}; host edge {res['host_edge_ms_median']:.2f} ms; "
        f"an epoch: {alloc}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-gib", type=float, default=0.5, help="each dataset's size (0.5: 10 batches an epoch)")
    p.add_argument("--row-kib", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=12, help="timed epochs a run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--unordered-copies",
        action="store_true",
        help="the control: the loop's workers enqueue copies as they get there (native.ORDERED_COPIES off)",
    )
    args = p.parse_args()
    if args.unordered_copies:
        import torch_fastload.native

        torch_fastload.native.ORDERED_COPIES = False
    if not torch.cuda.is_available():
        print("edge_gpu_gap.py times the GPU's idle gaps: it needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    row_bytes = args.row_kib * 1024
    rows = int(args.data_gib * (1 << 30)) // row_bytes
    out: dict = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp), rows, row_bytes)
        batch_bytes = args.batch_size * row_bytes
        src = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(batch_bytes, dtype=torch.uint8, device=device)
        transfer = statistics.median(h2d_copy_seconds(src, dst, reps=10))
        step = GemmStep(transfer, device)
        batches_per_epoch = rows // args.batch_size
        out.update(transfer_ms=transfer * 1e3, gemm_ms=step.seconds * 1e3, batches_per_epoch=batches_per_epoch)
        log = f"batch transfer {transfer * 1e3:.2f} ms, GEMMs {step.seconds * 1e3:.2f} ms"
        print(f"{log}, {batches_per_epoch} batches an epoch")
        resident = [data["tensor"][i * args.batch_size : (i + 1) * args.batch_size].to(device) for i in range(8)]
        makers = {name: make for name, make in feeds(data, args.batch_size, device).items() if name in FEEDS}
        order = ["device-resident", *FEEDS]
        for round_ in range(args.rounds):
            for name in order if round_ % 2 == 0 else order[::-1]:
                if name == "device-resident":
                    res = run(None, step, batches_per_epoch, args.epochs, 2, resident)
                else:
                    res = run(makers[name], step, batches_per_epoch, args.epochs, 2)
                res.update(feed=name, round=round_)
                out["runs"].append(res)
                print(f"{name:42s} {describe(res)}", flush=True)
                if res["path"]:
                    print(f"  path: {res['path']}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "edge-gpu-gap.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
