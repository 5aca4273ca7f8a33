#!/usr/bin/env python3
"""Pageable -> pinned staging GB/s by thread count: how many CPU cores a given GB/s costs.

The loader's stager, torch_fastload's ParallelCopier (one native copy_ranges call per batch,
GIL released, non-temporal stores: the slot is read by DMA, not the CPU), copies a pageable
tensor into a PinnedPool slot; in the same run, the same copier with plain memcpy and torch's
own dst.copy_(src) with torch.set_num_threads(threads), and torch's copy at its default thread
count (what pin_memory() gets). Host wall time of one call a sample, sources rotating over 3
pre-touched tensors and destinations over 2 slots, median of --reps. On the CPU the slots are
not pinned (the copy is the same).

    python benchmarks/staging.py            # 64 and 256 MiB, 1-16 threads, ~10 s
    python benchmarks/staging.py --quick    # 64 MiB
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from torch_fastload._benchutil import (
    MiB,
    Progress,
    Study,
    aligned_empty,
    fmt,
    fmt_size,
    gbps,
    parse_study,
    positive_int_list,
    size_list,
    study_parser,
    table,
)
from torch_fastload.pool import PinnedPool
from torch_fastload.staging import ParallelCopier


def copy_seconds(copy, dsts: list, srcs: list, reps: int) -> list[float]:
    """Seconds of each of ``reps`` ``copy(dst, src)`` calls after one untimed; the last copy's
    bytes are checked."""
    copy(dsts[0], srcs[0])
    times = []
    for r in range(reps):
        dst, src = dsts[r % len(dsts)], srcs[r % len(srcs)]
        t0 = time.perf_counter()
        copy(dst, src)
        times.append(time.perf_counter() - t0)
    n = dst.numel()
    if not (dst[0] == src[0] and dst[n // 2] == src[n // 2] and dst[-1] == src[-1]):
        raise AssertionError(f"staged bytes differ from the source ({fmt_size(n)})")
    return times


def one_size(n: int, threads: list, reps: int, pin: bool, bar: Progress) -> dict:
    srcs = [aligned_empty(n, fill=11 + i) for i in range(3)]
    pool = PinnedPool(2, n, pin=pin)
    slots = [pool.acquire(timeout=30) for _ in range(2)]
    dsts = [s.buffer[:n].fill_(0) for s in slots]
    saved = torch.get_num_threads()
    rows = []
    try:
        for t in threads:
            row = {"threads": t}
            for key, nontemporal in (("streaming", True), ("memcpy", False)):
                copier = ParallelCopier(t, nontemporal=nontemporal)
                try:
                    stage = lambda d, s, c=copier: c.copy_into(d, [(0, s)])  # noqa: E731
                    row[f"{key}_gbps"] = gbps(n, statistics.median(copy_seconds(stage, dsts, srcs, reps)))
                finally:
                    copier.close()
            torch.set_num_threads(t)
            try:
                row["torch_copy_gbps"] = gbps(n, statistics.median(copy_seconds(torch.Tensor.copy_, dsts, srcs, reps)))
            finally:
                torch.set_num_threads(saved)
            row["cores_per_10gbps"] = 10 * t / row["streaming_gbps"]
            rows.append(row)
            bar.update(1, f"{fmt_size(n)} x{t}")
        default = gbps(n, statistics.median(copy_seconds(torch.Tensor.copy_, dsts, srcs, reps)))
    finally:
        for s in slots:
            pool.release(s, None)
        pool.close()
    return {"bytes": n, "reps": reps, "threads": rows, "torch_default": {"threads": saved, "gbps": default}}


def plot(data: dict, plt):
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for entry in data["sizes"]:
        threads = [r["threads"] for r in entry["threads"]]
        (line,) = ax.plot(
            threads,
            [r["streaming_gbps"] for r in entry["threads"]],
            "o-",
            label=f"ParallelCopier {fmt_size(entry['bytes'])}",
        )
        ax.plot(threads, [r["memcpy_gbps"] for r in entry["threads"]], "s--", color=line.get_color(), label="  memcpy")
        ax.plot(
            threads,
            [r["torch_copy_gbps"] for r in entry["threads"]],
            "x:",
            color=line.get_color(),
            label="  torch copy_",
        )
    ax.set_xscale("log", base=2)
    ax.set(xlabel="threads", ylabel="pageable -> pinned GB/s", title="staging into pool slots", ylim=(0, None))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--sizes", type=size_list, help="bytes staged a call [64MiB,256MiB; quick 64MiB; cpu 4MiB]")
    p.add_argument("--threads", type=positive_int_list, help="thread counts [1,2,4,8,16; cpu 1,2]")
    p.add_argument("--reps", type=int, help="samples per cell [9; quick 3]")
    args = parse_study(
        p,
        argv,
        sizes=([64 * MiB, 256 * MiB], [64 * MiB], [4 * MiB]),
        threads=([1, 2, 4, 8, 16], [1, 2, 4, 8, 16], [1, 2]),
        reps=(9, 3, 2),
    )
    study = Study("staging", args, "pageable -> pinned staging by threads")
    pin = args.device.type == "cuda"
    bar = Progress(len(args.sizes) * len(args.threads), "staging", args.progress)
    study["pinned"] = pin
    study["sizes"] = [
        r for n in args.sizes if (r := study.attempt(fmt_size(n), one_size, n, args.threads, args.reps, pin, bar))
    ]
    bar.close()
    tables = []
    for entry in study["sizes"]:
        label = fmt_size(entry["bytes"]).replace(" ", "")
        rows = []
        for r in entry["threads"]:
            for key in ("streaming_gbps", "memcpy_gbps", "torch_copy_gbps"):
                study.figure(f"{key}_{label}_{r['threads']}t", r[key])
            rows.append(
                [
                    r["threads"],
                    fmt(r["streaming_gbps"]),
                    fmt(r["memcpy_gbps"]),
                    fmt(r["torch_copy_gbps"]),
                    fmt(r["cores_per_10gbps"]),
                ]
            )
        rows.append(
            [f"torch default ({entry['torch_default']['threads']})", "", "", fmt(entry["torch_default"]["gbps"]), ""]
        )
        tables.append(
            table(
                ["threads", "ParallelCopier GB/s", "memcpy GB/s", "torch copy_ GB/s", "cores per 10 GB/s"],
                rows,
                title=f"staging {fmt_size(entry['bytes'])} pageable -> {'pinned' if pin else 'unpinned (CPU)'} slot, "
                f"median of {entry['reps']}",
            )
        )
    return study.finish(*tables, plot=plot if study["sizes"] else None)


if __name__ == "__main__":
    sys.exit(main())
