#!/usr/bin/env python3
"""H2D copy GB/s by size from pageable memory, fresh pinned memory (raw cudaMemcpy: the link's
limit and the baseline) and a slot of torch_fastload's PinnedPool; and what making pinned
memory costs (a fresh pinned allocation vs the pool's touch + cudaHostRegister).

A sample times `inner` back-to-back dst.copy_(src, non_blocking=True) under CUDA events
(>= --sample-bytes), the sources rotating over buffers that cover --rotate-bytes. Pinned and
pool samples are queued behind a calibrated torch.cuda._sleep, so launch gaps are not timed
(pageable copies are staged by the driver on the host and timed without it). The modes
alternate within each rep; pool / pinned is the median of the reps' paired ratios, and a
verdict within 3 points of its target takes up to twice the reps.
Target: the pool slot >= 95% of raw pinned from 16 MiB up, >= 90% below.

    python benchmarks/h2d_copy.py            # ~20 s on one H100
    python benchmarks/h2d_copy.py --quick    # sizes up to 256 MiB, fewer samples
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from torch_fastload._benchutil import (
    CudaSleeper,
    GiB,
    MiB,
    Progress,
    Study,
    aligned_empty,
    empty_host_cache,
    fmt,
    fmt_size,
    gbps,
    needs_cuda,
    parse_study,
    size_arg,
    size_list,
    study_parser,
    table,
)
from torch_fastload.pool import PinnedPool

SIZES = [MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB]


def target_for(nbytes: int) -> float:
    """95% from 16 MiB up, 90% below (the target names 1-4 MiB; 8 MiB gets the lower floor)."""
    return 0.95 if nbytes >= 16 * MiB else 0.90


class Sampler:
    """GB/s samples of one size: ``inner`` copies from rotating sources into one device buffer."""

    def __init__(self, dst: torch.Tensor, nbytes: int, inner: int, sleeper: CudaSleeper):
        self.dst, self.n, self.inner, self.sleeper = dst[:nbytes], nbytes, inner, sleeper
        self.blocker_ms, self.raised = 0.3 + 0.03 * inner, 0

    def __call__(self, srcs: list, blocked: bool, offset: int) -> float:
        """Retried with a longer blocker if the host could not queue every copy before the GPU
        ran dry (a slow launch would otherwise be timed as a slow copy)."""
        for attempt in range(4):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if blocked:
                self.sleeper.sleep_ms(self.blocker_ms)
            t0 = time.perf_counter()
            start.record()
            for i in range(self.inner):
                self.dst.copy_(srcs[(offset + i) % len(srcs)], non_blocking=True)
            end.record()
            queued_ms = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            if blocked and queued_ms > 0.8 * self.blocker_ms and attempt < 3:
                self.blocker_ms, self.raised = max(2 * self.blocker_ms, 1.5 * queued_ms), self.raised + 1
                continue
            break
        return self.n * self.inner / (start.elapsed_time(end) / 1e3) / 1e9

    def check(self, expected: int) -> str | None:
        torch.cuda.synchronize()
        got = (int(self.dst[0]), int(self.dst[-1]))
        return None if got == (expected, expected) else f"copied bytes read {got}, expected {expected}"


def one_size(args, n: int, dst: torch.Tensor, sleeper: CudaSleeper, bar: Progress) -> dict:
    k = max(1, min(args.max_rotate, args.rotate_bytes // n))
    inner = max(1, min(64, -(-args.sample_bytes // n)))
    reps = args.reps * (2 if n <= 8 * MiB else 1)
    pool = PinnedPool(k, n, pin=True)
    slots = [pool.acquire(timeout=30) for _ in range(k)]
    modes = {  # name: (sources, blocked, fill value)
        "pageable": ([aligned_empty(n, fill=1) for _ in range(k)], False, 1),
        "pinned": ([torch.full((n,), 2, dtype=torch.uint8, pin_memory=True) for _ in range(k)], True, 2),
        "pool": ([s.buffer[:n].fill_(3) for s in slots], True, 3),
    }
    sample = Sampler(dst, n, inner, sleeper)
    notes = []
    for name, (srcs, blocked, value) in modes.items():  # warm-up, and the bytes arrive
        sample(srcs, blocked, 0)
        notes += [f"{name}: {problem}"] if (problem := sample.check(value)) else []
    samples: dict = {name: [] for name in modes}

    def one_rep(rep: int) -> None:
        order = list(modes) if rep % 2 == 0 else ["pageable", "pool", "pinned"]
        for name in order:
            srcs, blocked, _ = modes[name]
            samples[name].append(sample(srcs, blocked, rep * inner))
            bar.update(1, fmt_size(n))

    for rep in range(reps):
        one_rep(rep)

    def paired() -> float:  # pool and pinned of one rep ran back to back: drifts cancel
        return statistics.median(a / b for a, b in zip(samples["pool"], samples["pinned"]))

    extra = 0
    while extra < 2 * reps and abs(paired() - target_for(n)) <= 0.03:
        one_rep(reps + extra)
        extra += 1
    done = torch.cuda.Event()
    done.record()
    for s in slots:
        pool.release(s, done)
    pool.close()
    ratio = paired()
    return {
        "bytes": n,
        "rotate_buffers": k,
        "inner": inner,
        "reps": reps + extra,
        **{f"{name}_gbps": statistics.median(v) for name, v in samples.items()},
        "samples_gbps": samples,
        "ratio": ratio,
        "target": target_for(n),
        "verdict": "PASS" if ratio >= target_for(n) else "FAIL",
        "blocker_ms": sample.blocker_ms,
        "notes": notes
        + ([f"close to the target: {extra} extra reps"] if extra else [])
        + ([f"blocker raised {sample.raised}x (slow launches)"] if sample.raised else []),
    }


def pinning_cost(n: int, reps: int) -> dict:
    """Fresh pinned allocation (the caching host allocator emptied first) vs building a
    PinnedPool (anonymous huge-page-eligible mapping, touched, cudaHostRegister) vs the register
    call alone on touched memory; GB/s of each, median of ``reps``."""
    cudart = torch.cuda.cudart()
    fresh, build, register = [], [], []
    for _ in range(reps):
        empty_host_cache()
        t0 = time.perf_counter()
        torch.empty(n, dtype=torch.uint8, pin_memory=True)
        fresh.append(time.perf_counter() - t0)
        empty_host_cache()
        t0 = time.perf_counter()
        pool = PinnedPool(1, n, pin=True)
        build.append(time.perf_counter() - t0)
        pool.close()
        mem = aligned_empty(n, fill=0)
        t0 = time.perf_counter()
        if int(cudart.cudaHostRegister(mem.data_ptr(), n, 0)) == 0:
            register.append(time.perf_counter() - t0)
            cudart.cudaHostUnregister(mem.data_ptr())
        del mem
        gc.collect()
    return {
        "bytes": n,
        "reps": reps,
        **{f"{k}_gbps": gbps(n, statistics.median(v)) for k, v in (("fresh", fresh), ("pool", build)) if v},
        "register_gbps": gbps(n, statistics.median(register)) if register else None,
    }


def plot(data: dict, plt):
    rows = data["sizes"]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    x = [r["bytes"] / MiB for r in rows]
    for key, label, style in (
        ("pageable", "pageable", "o-"),
        ("pinned", "pinned (raw)", "s-"),
        ("pool", "pool", "^--"),
    ):
        ax.plot(x, [r[f"{key}_gbps"] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [fmt_size(r["bytes"]).replace(" ", "") for r in rows], rotation=45)
    ax.set(xlabel="copy size", ylabel="H2D GB/s (1e9 B/s)", title="H2D copy_(non_blocking=True)", ylim=(0, None))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--sizes", type=size_list, help="copy sizes [1MiB..1GiB; quick up to 256MiB]")
    p.add_argument("--reps", type=int, help="samples per size, doubled <= 8 MiB [15; quick 5]")
    p.add_argument("--sample-bytes", type=size_arg, default=64 * MiB, help="bytes per timed sample")
    p.add_argument("--rotate-bytes", type=size_arg, default=256 * MiB, help="bytes of rotated sources per mode")
    p.add_argument("--max-rotate", type=int, default=64, help="at most this many rotated buffers")
    p.add_argument("--alloc-sizes", type=size_list, help="pinning-cost sizes [256MiB,1GiB; quick 256MiB]")
    p.add_argument("--alloc-reps", type=int, help="pinning-cost samples [3; quick 1]")
    args = parse_study(
        p,
        argv,
        sizes=(SIZES, SIZES[:-1], []),
        reps=(15, 5, 1),
        alloc_sizes=([256 * MiB, GiB], [256 * MiB], []),
        alloc_reps=(3, 1, 1),
    )
    if not needs_cuda(args, "h2d_copy.py"):
        return 2
    study = Study("h2d_copy", args, "H2D copy by size: pageable vs raw pinned vs the pool")
    sleeper = CudaSleeper()
    study["sleep_calibration"] = sleeper.calibrate()
    if not sleeper.available:
        study["failures"].append({"what": "torch.cuda._sleep", "error": sleeper.error})
        return study.finish()
    dst = torch.empty(max(args.sizes), dtype=torch.uint8, device=args.device)
    bar = Progress(sum(3 * args.reps * (2 if n <= 8 * MiB else 1) for n in args.sizes), "H2D", args.progress)
    study["sizes"] = [r for n in args.sizes if (r := study.attempt(fmt_size(n), one_size, args, n, dst, sleeper, bar))]
    bar.close()
    del dst
    study["alloc"] = [r for n in args.alloc_sizes if (r := study.attempt("pinning", pinning_cost, n, args.alloc_reps))]
    rows = []
    for r in study["sizes"]:
        label = fmt_size(r["bytes"]).replace(" ", "")
        for key in ("pageable_gbps", "pinned_gbps", "pool_gbps"):
            study.figure(f"{key}_{label}", r[key])
        study.figure(f"pool_over_pinned_{label}", r["ratio"])
        rows.append([fmt_size(r["bytes"]), r["reps"], fmt(r["pageable_gbps"]), fmt(r["pinned_gbps"])])
        rows[-1] += [fmt(r["pool_gbps"]), fmt(100 * r["ratio"], ".1f"), f">={100 * r['target']:.0f}%", r["verdict"]]
        rows[-1] += ["; ".join(r["notes"])]
    for r in study["alloc"]:
        label = fmt_size(r["bytes"]).replace(" ", "")
        for key in ("fresh_gbps", "pool_gbps", "register_gbps"):
            study.figure(f"alloc_{key}_{label}", r.get(key))
    if study["sizes"]:
        worst = min(study["sizes"], key=lambda r: r["ratio"] - r["target"])
        passed = all(r["verdict"] == "PASS" for r in study["sizes"])
        study.verdict(
            "pool / raw pinned >= 95% from 16 MiB, >= 90% below",
            passed,
            f"worst {worst['ratio']:.1%} at {fmt_size(worst['bytes'])}",
        )
    heads = ["size", "samples", "pageable GB/s", "pinned GB/s (baseline)", "pool GB/s", "pool/pinned %", "target"]
    alloc = [
        [fmt_size(r["bytes"]), fmt(r.get("fresh_gbps")), fmt(r.get("pool_gbps")), fmt(r.get("register_gbps"))]
        for r in study["alloc"]
    ]
    return study.finish(
        table(heads + ["verdict", "notes"], rows, title="H2D copy_(non_blocking=True), median GB/s (1e9 B/s)"),
        table(
            ["size", "fresh torch.empty(pin_memory=True) GB/s", "PinnedPool GB/s", "cudaHostRegister alone GB/s"],
            alloc,
            title=f"making pinned memory, median of {args.alloc_reps}",
        )
        if alloc
        else "",
        plot=plot if study["sizes"] else None,
    )


if __name__ == "__main__":
    sys.exit(main())
