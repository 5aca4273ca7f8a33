#!/usr/bin/env python3
"""Issue 21: why a 30-step feed of parquet.py's overlap row is either ~1.0x or 1.23-1.30x the
device-resident step, a whole feed at a time (RESULTS.md, twenty-third session). The same step
and batches as ``parquet.overlap``, with each fastload feed instrumented and three variants
interleaved round by round, each fastload feed after a resident feed under the same rule:

- ``as-benchmark``: the host may run as far ahead of the GPU as CUDA's launch queue lets it
  (no sync inside a feed), the dataset's decoded row groups kept from the feed before;
- ``window-2``: the host waits for the step two steps back before launching the next (as a
  loop with ``loss.item()`` one step late would): if the slow regime is the training thread
  blocked in a full launch queue while it holds the GIL, it goes away here;
- ``cache-dropped``: ``dataset.close()`` before each fastload feed: if the slow regime is the
  decode cache's state after the previous feed stopped mid-epoch, it goes away here.

Each feed records: ms a step, the ratio to the resident feed just before it, the host's lead
over the GPU at each next() (steps launched and not finished: pops finished events from the
oldest, one query a step), the time inside next(), the host's time inside the step's launches
(near the GPU's step time once the launch queue is full: the thread blocks there holding the
GIL), and the loader's stage seconds a batch.
One JSON, $OUT/parquet_regimes.json (the current folder without $OUT), a table on stdout.
From the repo root, on a GPU host:

  PYTHONPATH=$PWD python3 benchmarks/gpu/parquet_regimes.py [DATA_DIR] [STEPS] [ROUNDS]
"""

import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parquet  # noqa: E402

from torch_fastload import DataLoader  # noqa: E402
from torch_fastload._benchutil.args import resolve_device  # noqa: E402
from torch_fastload.sources import ParquetDataset, ParquetSampler  # noqa: E402

VARIANTS = ("as-benchmark", "window-2", "cache-dropped")
WARMUP = 4


def main() -> int:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/pqdata")
    steps_wanted = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    device = resolve_device("cuda")
    path, rows, decode, step, gemms = parquet.overlap_probe_setup(data, device)

    dataset = ParquetDataset(path)
    loader = DataLoader(
        dataset, batch_sampler=ParquetSampler(dataset, shuffle=True, seed=1).batches(rows), device=device
    )
    steps = min(steps_wanted, len(loader) - WARMUP)
    first = iter(loader)
    resident = [{k: v.clone() for k, v in b.items()} for _, b in zip(range(steps), first)]
    first.close()

    def feed(kind: str, variant: str) -> dict:
        if kind == "fastload" and variant == "cache-dropped":
            dataset.close()
        batches = iter(resident) if kind == "resident" else iter(loader)
        if kind == "fastload":
            for _ in range(WARMUP):
                step(next(batches))
        torch.cuda.synchronize(device)
        window = 2 if variant == "window-2" else None
        launched: deque = deque()  # an event after each step not yet seen finished
        leads, waits, launching = [], [], []  # launching: host time inside step() (blocked if the queue is full)
        loader.stats(reset=True)
        started = time.perf_counter()
        for _ in range(steps):
            while launched and launched[0].query():
                launched.popleft()
            leads.append(len(launched))
            if window is not None and len(launched) > window:
                launched[-window - 1].synchronize()
            t = time.perf_counter()
            batch = next(batches)
            waits.append(time.perf_counter() - t)
            t = time.perf_counter()
            step(batch)
            launching.append(time.perf_counter() - t)
            event = torch.cuda.Event()
            event.record()
            launched.append(event)
        torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - started) / steps
        stats = loader.stats() if kind == "fastload" else None
        getattr(batches, "close", lambda: None)()
        out = {
            "ms": seconds * 1e3,
            "lead_mean": float(np.mean(leads)),
            "lead_max": int(max(leads)),
            "next_ms_mean": float(np.mean(waits)) * 1e3,
            "next_ms_p90": float(np.percentile(waits, 90)) * 1e3,
            "launch_ms_mean": float(np.mean(launching)) * 1e3,
        }
        if stats is not None:
            out["stage_ms_per_batch"] = {k: 1e3 * v / max(1, stats.batches) for k, v in stats.stage_s.items() if v}
        return out

    results = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS:
            res = feed("resident", variant)
            fast = feed("fastload", variant)
            results[variant].append({"round": r, "resident": res, "fastload": fast, "ratio": fast["ms"] / res["ms"]})
            print(
                f"round {r} {variant:<14} resident {res['ms']:6.2f} ms (lead {res['lead_mean']:4.1f})  "
                f"fastload {fast['ms']:6.2f} ms (lead mean {fast['lead_mean']:4.1f} max {fast['lead_max']:2d}, "
                f"next() {fast['next_ms_mean']:5.2f} ms mean / {fast['next_ms_p90']:5.2f} p90, "
                f"launches {fast['launch_ms_mean']:5.2f} ms; resident's {res['launch_ms_mean']:5.2f})  "
                f"x{fast['ms'] / res['ms']:.3f}",
                flush=True,
            )
    dataset.close()
    summary = {v: sorted(e["ratio"] for e in results[v]) for v in VARIANTS}
    for v, ratios in summary.items():
        print(f"{v:<14} ratios {', '.join(f'{x:.3f}' for x in ratios)}")
    out = Path(os.environ.get("OUT", ".")) / "parquet_regimes.json"
    doc = {"steps": steps, "gemms_per_step": gemms, "decode_ms": decode * 1e3, "feeds": results, "ratios": summary}
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
