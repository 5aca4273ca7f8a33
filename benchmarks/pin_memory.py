#!/usr/bin/env python3
"""torch_fastload pin-memory study: what pinned staging buys, and what it costs.

Part 1  H2D GB/s of ``dst.copy_(src, non_blocking=True)`` by size, from (a) pageable memory,
        (b) fresh pinned memory (``torch.empty(pin_memory=True)``, the raw cudaMemcpy baseline)
        and (c) a slot of torch_fastload's ``PinnedPool`` (touched memory + cudaHostRegister);
        pool / raw-pinned ratio checked against the project target (>= 95 % for >= 16 MiB,
        >= 90 % below). Plus the cost of making pinned memory: fresh pinned allocation vs
        touching + registering ordinary memory (the pool's way).
Part 2  pageable -> pinned staging GB/s by thread count with torch_fastload's ParallelCopier,
        against a single ``dst.copy_(src)``: how many CPU cores a given GB/s costs.
Part 3  a training-loop experiment: K steps, each needing a fresh pageable batch of B bytes
        plus simulated GPU compute, fed (i) pageable ``x.cuda()``, (ii) ``x.pin_memory().cuda
        (non_blocking=True)``, (iii) a background thread staging into a PinnedPool with a
        ParallelCopier and copying on a side stream, (iv) ``torch_fastload.DataLoader``.
        Reports step time, effective GB/s and overlap = compute-only step / step.

Prints tables (the summary last), writes JSON with every number and the machine's details,
and a PNG plot. ``--cpu-smoke`` runs Part 2 alone on the CPU (unpinned pool) for machines
without a GPU.

    python benchmarks/pin_memory.py                 # full study, ~35 s on one H100
    python benchmarks/pin_memory.py --quick         # ~12 s
    python benchmarks/pin_memory.py --cpu-smoke --quick
    python benchmarks/pin_memory.py --parts 3 --compute matmul --compute-ms 2,5,10

If the native copier (torch_fastload._C.copy_ranges) crashes in a child-process probe, the run
says so and falls back to ParallelCopier's numpy thread pool (``--copier numpy`` forces that).
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout, not some installed copy

import torch  # noqa: E402

from torch_fastload._benchutil import (
    Progress,
    cpu_affinity,
    error_text,
    float_list,
    fmt,
    git_state,  # noqa: E402
    log,
    machine_basics,
    positive_int_list,
    run_quiet,
    table,
    write_json,
)

MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096
DEFAULT_SIZES = [1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB]


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'64MiB', '64M', '1GiB', '1G', '512KiB', '4096B'; a bare number means MiB."""
    s = str(text).strip().lower().replace(" ", "")
    units = [
        ("gib", GiB),
        ("gb", GiB),
        ("g", GiB),
        ("mib", MiB),
        ("mb", MiB),
        ("m", MiB),
        ("kib", 1024),
        ("kb", 1024),
        ("k", 1024),
        ("b", 1),
    ]
    for suffix, mult in units:
        if s.endswith(suffix):
            number = s[: -len(suffix)]
            break
    else:
        number, mult = s, MiB
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r} (try 64MiB, 1GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return int(value * mult)


def parse_size_list(text: str) -> list[int]:
    return [parse_size(x) for x in str(text).split(",") if x.strip()]


def fmt_size(nbytes: int) -> str:
    if nbytes >= GiB and nbytes % GiB == 0:
        return f"{nbytes // GiB} GiB"
    if nbytes >= MiB and nbytes % MiB == 0:
        return f"{nbytes // MiB} MiB"
    return f"{nbytes / MiB:.2f} MiB"


def gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aligned_empty(nbytes: int, fill: int | None = None) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of ``nbytes`` (a view into a slightly larger one),
    touched with ``fill`` so every page is resident."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    view = raw[shift : shift + nbytes]
    if fill is not None:
        view.fill_(fill)
    return view


def stage_copy(copier, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into the uint8 CPU slice ``dst`` with a torch_fastload ParallelCopier
    (``copy_into(dst, [(offset, src)])``, or the older ``copy([(dst, src)])``)."""
    if hasattr(copier, "copy_into"):
        copier.copy_into(dst, [(0, src)])
    else:
        copier.copy([(dst, src)])


def copier_backend(copier) -> str:
    native = getattr(copier, "native", None)
    if native is None:
        return "numpy thread pool (no native flag)"
    return "native C++ copy_ranges" if native else "numpy thread pool"


def choose_copier(choice: str) -> str:
    """'numpy' turns torch_fastload's native copy_ranges off for this process (ParallelCopier then
    uses its numpy thread pool); this reaches into a private name, so it is checked."""
    if choice == "auto":
        try:
            from torch_fastload.staging import ParallelCopier

            copier = ParallelCopier(1)
            backend = copier_backend(copier)
            copier.close()
            return f"auto: {backend}"
        except Exception as exc:
            return f"auto: ParallelCopier unusable ({error_text(exc)})"
    import torch_fastload.staging as staging

    if not hasattr(staging, "_native_copy"):
        return "numpy requested, but torch_fastload.staging has no _native_copy switch: auto"
    staging._native_copy = None
    return "numpy (native copy_ranges disabled by --copier numpy)"


_PROBE = r"""
import torch
from torch_fastload.staging import ParallelCopier
c = ParallelCopier(2)
src = torch.full((4 << 20,), 7, dtype=torch.uint8)
dst = torch.zeros_like(src)
if hasattr(c, "copy_into"):
    c.copy_into(dst, [(0, src)])
else:
    c.copy([(dst, src)])
assert int(dst[0]) == 7 and int(dst[-1]) == 7, "native copy wrote wrong bytes"
c.close()
"""


def probe_native_copier(timeout: float = 180.0) -> str | None:
    """Run one small native ParallelCopier copy in a child process: a crash there (seen once: a
    segfault in copy_ranges) must not take the whole study down. None when it works or when
    the native path is not in use; otherwise why it failed."""
    try:
        from torch_fastload.staging import ParallelCopier

        copier = ParallelCopier(1)
        native = getattr(copier, "native", False)
        copier.close()
    except Exception as exc:
        return f"ParallelCopier unusable: {error_text(exc)}"
    if not native:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        res = subprocess.run(
            [sys.executable, "-c", _PROBE], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"native copy probe hung for {timeout:.0f} s"
    if res.returncode == 0:
        return None
    how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
    tail = (res.stderr or "").strip().splitlines()[-1:] or [""]
    return f"native copy_ranges probe failed ({how}) {tail[0]}".strip()


# --------------------------------------------------------------------------------------------
# machine information
# --------------------------------------------------------------------------------------------
def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GiB
    except (OSError, ValueError):
        pass
    return None


def machine_info(use_cuda: bool) -> dict:
    info = {
        **machine_basics(),
        "numpy": None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": cpu_affinity(),
        "torch_num_threads": torch.get_num_threads(),
        "mem_total_gib": _mem_total_gib(),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except Exception:
        pass
    try:
        import torch_fastload.pool as _pool_mod

        info["torch_fastload_path"] = str(Path(_pool_mod.__file__).resolve().parent)
    except Exception as exc:
        info["torch_fastload_path"] = f"import failed: {error_text(exc)}"
    info.update(git_state(REPO))
    if use_cuda:
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        info["gpu"] = {
            "index": dev,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_memory_gib": round(props.total_memory / GiB, 2),
            "multiprocessors": getattr(props, "multi_processor_count", None),
            "device_count": torch.cuda.device_count(),
        }
        smi = run_quiet(
            [
                "nvidia-smi",
                f"--id={dev}",
                "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,"
                "pcie.link.width.current,pcie.link.width.max,clocks.sm,clocks.max.sm",
                "--format=csv,noheader",
            ]
        )
        info["nvidia_smi"] = smi
    return info


# --------------------------------------------------------------------------------------------
# CUDA timing helpers
# --------------------------------------------------------------------------------------------
def empty_host_cache() -> bool:
    """Return the CUDA caching host allocator's cached pinned blocks to the driver."""
    gc.collect()
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        return False
    try:
        fn()
        return True
    except Exception:
        return False


def host_alloc_count() -> int | None:
    """How many pinned blocks the caching host allocator has created (None where unknown)."""
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:
        return None
    for key in ("num_host_alloc", "host_alloc_time.count"):
        if key in stats:
            try:
                return int(stats[key])
            except (TypeError, ValueError):
                pass
    return None


class Sleeper:
    """GPU busy-wait of a chosen length: ``torch.cuda._sleep(cycles)`` calibrated by timing
    (``get_device_properties().clock_rate`` is not in every torch, and the SM clock moves)."""

    def __init__(self):
        self.available = hasattr(torch.cuda, "_sleep")
        self.cycles_per_ms = None
        self.offset_ms = 0.0
        self.error = None if self.available else "torch.cuda._sleep is missing in this torch"

    def _time_cycles(self, cycles: int, reps: int = 5) -> float:
        times = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(int(cycles))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def calibrate(self, warm_s: float = 0.2) -> dict:
        if not self.available:
            return {"available": False, "error": self.error}
        # spin for a while first so the SM clock has left its idle state
        deadline = time.perf_counter() + warm_s
        while time.perf_counter() < deadline:
            torch.cuda._sleep(1_000_000)
            torch.cuda.synchronize()
        c1, c2 = 1_000_000, 5_000_000
        t1, t2 = self._time_cycles(c1), self._time_cycles(c2)
        if t2 <= t1:
            self.available = False
            self.error = f"torch.cuda._sleep did not scale with cycles ({c1}: {t1} ms, {c2}: {t2} ms)"
            return {"available": False, "error": self.error}
        self.cycles_per_ms = (c2 - c1) / (t2 - t1)
        self.offset_ms = max(0.0, t1 - c1 / self.cycles_per_ms)
        return {
            "available": True,
            "cycles_per_ms": self.cycles_per_ms,
            "offset_ms": self.offset_ms,
            "implied_sm_clock_mhz": self.cycles_per_ms / 1e3,
        }

    def cycles(self, ms: float) -> int:
        if not self.cycles_per_ms or ms <= 0:
            return 0
        return max(0, int((ms - self.offset_ms) * self.cycles_per_ms))

    def sleep_ms(self, ms: float) -> None:
        cycles = self.cycles(ms)
        if cycles > 0:
            torch.cuda._sleep(cycles)

    def measure_ms(self, ms: float, reps: int = 5) -> float | None:
        cycles = self.cycles(ms)
        return self._time_cycles(cycles, reps) if cycles > 0 else None


# --------------------------------------------------------------------------------------------
# Part 1: H2D bandwidth by size and source memory
# --------------------------------------------------------------------------------------------
def target_for(nbytes: int) -> float:
    """Pool / raw-pinned floor: 95 % from 16 MiB up, 90 % below (the target names 1-4 MiB;
    8 MiB, which it does not name, gets the lower floor)."""
    return 0.95 if nbytes >= 16 * MiB else 0.90


def part1_h2d(args, sleeper: Sleeper, results: dict, save) -> None:
    from torch_fastload.pool import PinnedPool

    sizes = sorted({s for s in args.sizes if s <= args.max_size})
    if not sizes:
        raise ValueError(f"no H2D size <= --max-size {fmt_size(args.max_size)} in --sizes")
    device = torch.device("cuda", torch.cuda.current_device())
    rot_budget = max(args.rotate_bytes, 0)
    max_n = max(sizes)
    arena_n = max(min(rot_budget, max_n), 0)
    out: dict = {
        "sizes": [],
        "method": {
            "timed": "CUDA events around `inner` back-to-back dst.copy_(src, non_blocking=True); "
            "GB/s = inner*size/elapsed; median over reps samples; modes interleaved per rep",
            "ratio": "median over reps of pool_sample / pinned_sample (taken back to back)",
            "pinned_blocker": "pinned/pool samples are queued behind a calibrated torch.cuda._sleep so "
            "launch gaps are not timed; pageable copies are host-staged by the driver "
            "and timed without it",
            "rotation_bytes": rot_budget,
        },
    }
    results["part1_h2d"] = out

    dst = torch.empty(max_n, dtype=torch.uint8, device=device)
    # rotation arenas shared by all sizes that fit; bigger sizes get their own buffers
    pageable_arena = aligned_empty(arena_n, fill=1) if arena_n else None
    pinned_arena = torch.empty(arena_n, dtype=torch.uint8, pin_memory=True).fill_(2) if arena_n else None

    total_samples = sum(args.reps * (2 if n <= 8 * MiB else 1) * 3 for n in sizes)
    bar = Progress(total_samples, "part 1: H2D", args.progress)
    try:
        for n in sizes:
            row = _part1_one_size(args, n, dst, pageable_arena, pinned_arena, rot_budget, sleeper, PinnedPool, bar)
            out["sizes"].append(row)
            save()
    finally:
        bar.close()
        del pageable_arena, pinned_arena, dst
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        empty_host_cache()

    log()
    rows = []
    for r in out["sizes"]:
        rows.append(
            [
                fmt_size(r["bytes"]),
                r["inner"],
                r["reps"] + r["extra_reps"],
                fmt(r["pageable_gbps"]),
                fmt(r["pinned_gbps"]),
                fmt(r["pool_gbps"]),
                fmt(None if r["ratio"] is None else 100 * r["ratio"], ".1f"),
                f">={int(100 * r['target'])}%",
                r["verdict"],
            ]
        )
    log(
        table(
            [
                "size",
                "copies/sample",
                "samples",
                "pageable GB/s",
                "pinned GB/s",
                "pool GB/s",
                "pool/pinned %",
                "target",
                "verdict",
            ],
            rows,
            title="Part 1: H2D copy_(non_blocking=True) GB/s (1e9 B/s), median of samples",
            first_left=False,
        )
    )
    for r in out["sizes"]:
        for note in r.get("notes", []):
            log(f"  note {fmt_size(r['bytes'])}: {note}")

    if not args.skip_alloc:
        part1_alloc(args, PinnedPool, out, save)


def _part1_one_size(args, n, dst, pageable_arena, pinned_arena, rot_budget, sleeper, PinnedPool, bar):
    notes: list[str] = []
    k = max(1, min(args.max_rotate, rot_budget // n)) if rot_budget >= n else 1
    inner = max(1, min(64, -(-args.sample_bytes // n)))
    reps = args.reps * (2 if n <= 8 * MiB else 1)
    d = dst[:n]

    own_pageable = own_pinned = None
    if pageable_arena is not None and k * n <= pageable_arena.numel():
        pageable_srcs = [pageable_arena[i * n : (i + 1) * n] for i in range(k)]
        pinned_srcs = [pinned_arena[i * n : (i + 1) * n] for i in range(k)]
    else:
        own_pageable = aligned_empty(n, fill=1)
        own_pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(2)
        pageable_srcs, pinned_srcs = [own_pageable], [own_pinned]

    pool = None
    pool_srcs = None
    pool_error = None
    try:
        pool = PinnedPool(k, n, pin=True)
        slots = [pool.acquire(timeout=30) for _ in range(k)]
        for s in slots:
            s.buffer.fill_(3)
        pool_srcs = [s.buffer[:n] for s in slots]
    except Exception as exc:
        pool_error = error_text(exc)
        notes.append(f"PinnedPool failed: {pool_error}")
        slots = []

    blocker = {"ms": 0.3 + 0.03 * inner, "raised": 0}

    def sample(srcs, use_blocker: bool, offset: int) -> float:
        """GB/s of ``inner`` copies from rotating ``srcs``; retried with a longer blocker if the
        host could not queue them all before the GPU ran dry."""
        for attempt in range(4):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            blocked = use_blocker and sleeper.available and sleeper.cycles_per_ms
            if blocked:
                sleeper.sleep_ms(blocker["ms"])
            t0 = time.perf_counter()
            start.record()
            for i in range(inner):
                d.copy_(srcs[(offset + i) % len(srcs)], non_blocking=True)
            end.record()
            queued_ms = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            ms = start.elapsed_time(end)
            if blocked and queued_ms > 0.8 * blocker["ms"] and attempt < 3:
                blocker["ms"] = max(blocker["ms"] * 2, queued_ms * 1.5)
                blocker["raised"] += 1
                continue
            return n * inner / (ms / 1e3) / 1e9
        return n * inner / (ms / 1e3) / 1e9

    def check(expected: int, what: str):
        torch.cuda.synchronize()
        got = (int(d[0].item()), int(d[-1].item()))
        if got != (expected, expected):
            notes.append(f"{what}: copied bytes read {got}, expected {expected}")

    modes = [("pageable", pageable_srcs, False, 1), ("pinned", pinned_srcs, True, 2)]
    if pool_srcs is not None:
        modes.append(("pool", pool_srcs, True, 3))
    samples: dict[str, list] = {name: [] for name, *_ in modes}
    for name, srcs, blk, value in modes:  # warm-up, and a check that the bytes arrive
        sample(srcs, blk, 0)
        check(value, name)

    def one_rep(rep, count=True):
        order = modes if rep % 2 == 0 else [modes[0]] + modes[1:][::-1]
        for name, srcs, blk, _ in order:
            samples[name].append(sample(srcs, blk, rep * inner))
            if count:
                bar.update(1, note=fmt_size(n))
        if pool_srcs is None and count:
            bar.update(1)

    for rep in range(reps):
        one_rep(rep)
    # The link is shared and noisy (dips hit every mode at once, so the paired ratio mostly
    # cancels them); where the verdict is close, take up to 2x more reps before judging.
    extra = 0
    tgt = target_for(n)
    while pool_srcs is not None and extra < 2 * reps:
        paired = [a / b for a, b in zip(samples["pool"], samples["pinned"]) if a and b]
        if paired and abs(statistics.median(paired) - tgt) > 0.03:
            break
        one_rep(reps + extra, count=False)
        extra += 1
    if extra:
        notes.append(f"verdict close to the target: took {extra} extra reps")

    if slots:
        done = torch.cuda.Event()
        done.record()
        for s in slots:
            pool.release(s, done)
    if pool is not None:
        try:
            pool.close()
        except Exception as exc:
            notes.append(f"pool.close failed: {error_text(exc)}")
    del own_pageable, own_pinned, pool_srcs, slots, pool
    if blocker["raised"]:
        notes.append(f"blocker raised {blocker['raised']}x to {blocker['ms']:.2f} ms (slow launches)")

    pinned = median(samples["pinned"])
    pool_g = median(samples.get("pool", []))
    # pool and pinned samples of one rep run back to back: the median of their ratios cancels
    # slow drifts and transients better than a ratio of medians
    paired = [a / b for a, b in zip(samples.get("pool", []), samples["pinned"]) if a and b]
    ratio = median(paired)
    ratio_of_medians = pool_g / pinned if (pool_g and pinned) else None
    verdict = "ERROR" if ratio is None else ("PASS" if ratio >= tgt else "FAIL")
    return {
        "bytes": n,
        "rotate_buffers": k,
        "inner": inner,
        "reps": reps,
        "pageable_gbps": median(samples["pageable"]),
        "pinned_gbps": pinned,
        "pool_gbps": pool_g,
        "pageable_best_gbps": max(samples["pageable"]),
        "pinned_best_gbps": max(samples["pinned"]),
        "pool_best_gbps": max(samples["pool"]) if samples.get("pool") else None,
        "samples_gbps": samples,
        "ratio": ratio,
        "ratio_of_medians": ratio_of_medians,
        "extra_reps": extra,
        "target": tgt,
        "verdict": verdict,
        "pool_error": pool_error,
        "blocker_ms": blocker["ms"],
        "notes": notes,
    }


def part1_alloc(args, PinnedPool, out: dict, save) -> None:
    """Cost of making pinned memory: fresh pinned allocation vs touch + cudaHostRegister."""
    sizes = [s for s in args.alloc_sizes if s <= args.max_size]
    res: list[dict] = []
    out["alloc"] = res
    if not sizes:
        return
    cudart = torch.cuda.cudart()
    can_empty = empty_host_cache()
    reps = args.alloc_reps if can_empty else 1
    bar = Progress(len(sizes) * reps, "part 1: pinning cost", args.progress)
    for n in sizes:
        fresh, construct, close, touch, register, unregister = [], [], [], [], [], []
        notes = []
        for _ in range(reps):
            # (a) fresh pinned memory from the caching host allocator (cudaHostAlloc)
            empty_host_cache()
            before = host_alloc_count()
            t0 = time.perf_counter()
            x = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            fresh.append(time.perf_counter() - t0)
            after = host_alloc_count()
            if before is not None and after is not None and after == before:
                notes.append("pinned allocation was served from the host cache (not fresh)")
            del x
            empty_host_cache()
            # (b) the pool: one allocation, touched, registered
            try:
                t0 = time.perf_counter()
                pool = PinnedPool(1, n, pin=True)
                construct.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                pool.close()
                close.append(time.perf_counter() - t0)
                del pool
            except Exception as exc:
                notes.append(f"PinnedPool failed: {error_text(exc)}")
            # (c) the parts: first touch of ordinary memory, then cudaHostRegister alone
            t0 = time.perf_counter()
            mem = aligned_empty(n, fill=0)
            touch.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            err = int(cudart.cudaHostRegister(mem.data_ptr(), n, 0))
            reg_s = time.perf_counter() - t0
            if err != 0:
                notes.append(f"cudaHostRegister failed with CUDA error {err}")
            else:
                register.append(reg_s)
                t0 = time.perf_counter()
                cudart.cudaHostUnregister(mem.data_ptr())
                unregister.append(time.perf_counter() - t0)
            del mem
            gc.collect()
            bar.update(1, note=fmt_size(n))
        row = {
            "bytes": n,
            "reps": reps,
            "host_cache_emptied": can_empty,
            "fresh_pinned_s": median(fresh),
            "fresh_pinned_gbps": gbps(n, median(fresh)),
            "pool_construct_s": median(construct),
            "pool_construct_gbps": gbps(n, median(construct)),
            "pool_close_s": median(close),
            "first_touch_gbps": gbps(n, median(touch)),
            "register_gbps": gbps(n, median(register)),
            "unregister_s": median(unregister),
            "samples_s": {"fresh": fresh, "construct": construct, "touch": touch, "register": register},
            "notes": sorted(set(notes)),
        }
        res.append(row)
        save()
    bar.close()
    rows = [
        [
            fmt_size(r["bytes"]),
            fmt(r["fresh_pinned_gbps"]),
            fmt(r["pool_construct_gbps"]),
            fmt(r["first_touch_gbps"]),
            fmt(r["register_gbps"]),
            fmt(
                None
                if not (r["fresh_pinned_s"] and r["pool_construct_s"])
                else r["fresh_pinned_s"] / r["pool_construct_s"],
                ".1f",
            ),
        ]
        for r in res
    ]
    log()
    log(
        table(
            [
                "size",
                "fresh pinned GB/s",
                "pool (touch+register) GB/s",
                "first touch GB/s",
                "register only GB/s",
                "pool speed-up x",
            ],
            rows,
            title="Part 1b: making pinned memory (median of %d)" % reps,
            first_left=False,
        )
    )
    for r in res:
        for note in r["notes"]:
            log(f"  note {fmt_size(r['bytes'])}: {note}")


# --------------------------------------------------------------------------------------------
# Part 2: pageable -> pinned staging by thread count
# --------------------------------------------------------------------------------------------
def part2_staging(args, pin: bool, results: dict, save) -> None:
    from torch_fastload.pool import PinnedPool
    from torch_fastload.staging import ParallelCopier

    sizes = [s for s in args.stage_sizes if s <= args.max_size] or [min(args.stage_sizes)]
    threads = args.threads
    out: dict = {
        "pinned_destination": pin,
        "sizes": [],
        "torch_threads": torch.get_num_threads(),
        "method": "host wall time of one ParallelCopier.copy_into(slot, [(0, src)]) per "
        "sample; sources rotate over pre-touched pageable tensors, destinations "
        "over 2 pool slots; median of reps. torch_copy_gbps: dst.copy_(src) with "
        "torch.set_num_threads(threads)",
    }
    results["part2_staging"] = out
    bar = Progress(len(sizes) * (len(threads) + 1), "part 2: staging", args.progress)
    for n in sizes:
        nsrc = 3
        srcs = [aligned_empty(n, fill=11 + i) for i in range(nsrc)]
        pool = PinnedPool(2, n, pin=pin)
        slots = [pool.acquire(timeout=30) for _ in range(2)]
        dsts = [s.buffer[:n] for s in slots]
        for dbuf in dsts:
            dbuf.fill_(0)
        reps = args.stage_reps
        entry = {"bytes": n, "reps": reps, "threads": [], "notes": []}

        def timed(fn, rep_count):
            times = []
            for r in range(rep_count):
                dbuf, sbuf = dsts[r % 2], srcs[r % nsrc]
                t0 = time.perf_counter()
                fn(dbuf, sbuf)
                times.append(time.perf_counter() - t0)
                if r == rep_count - 1:
                    exp = 11 + r % nsrc
                    got = (int(dbuf[0]), int(dbuf[n // 2]), int(dbuf[-1]))
                    if got != (exp, exp, exp):
                        entry["notes"].append(f"copy check failed: read {got}, expected {exp}")
            return times

        saved_threads = torch.get_num_threads()
        for t in threads:
            copier = ParallelCopier(t)
            try:
                entry["copier_backend"] = copier_backend(copier)
                timed(lambda dbuf, sbuf: stage_copy(copier, dbuf, sbuf), 1)  # warm the thread pool
                times = timed(lambda dbuf, sbuf: stage_copy(copier, dbuf, sbuf), reps)
            finally:
                copier.close()
            # the same native copier with plain memcpy (cached stores) instead of streaming stores
            cached_times = None
            if getattr(copier, "native", False) and getattr(copier, "nontemporal", False):
                cached = ParallelCopier(t, nontemporal=False)
                try:
                    timed(lambda dbuf, sbuf: stage_copy(cached, dbuf, sbuf), 1)
                    cached_times = timed(lambda dbuf, sbuf: stage_copy(cached, dbuf, sbuf), reps)
                finally:
                    cached.close()
            # reference: torch's own copy_ with the same number of intra-op threads
            try:
                torch.set_num_threads(t)
                timed(lambda dbuf, sbuf: dbuf.copy_(sbuf), 1)
                ttimes = timed(lambda dbuf, sbuf: dbuf.copy_(sbuf), reps)
            finally:
                torch.set_num_threads(saved_threads)
            sec, tsec = median(times), median(ttimes)
            entry["threads"].append(
                {
                    "threads": t,
                    "median_s": sec,
                    "gbps": gbps(n, sec),
                    "samples_s": times,
                    "torch_copy_median_s": tsec,
                    "torch_copy_gbps": gbps(n, tsec),
                    "memcpy_gbps": gbps(n, median(cached_times)) if cached_times else None,
                }
            )
            bar.update(1, note=f"{fmt_size(n)} x{t}")
        # torch reference at its default thread count: what pin_memory() gets
        timed(lambda dbuf, sbuf: dbuf.copy_(sbuf), 1)
        times = timed(lambda dbuf, sbuf: dbuf.copy_(sbuf), reps)
        entry["torch_copy"] = {
            "threads": torch.get_num_threads(),
            "median_s": median(times),
            "gbps": gbps(n, median(times)),
        }
        bar.update(1)
        base = entry["threads"][0]["gbps"] if entry["threads"][0]["threads"] == 1 else None
        for e in entry["threads"]:
            g = e["gbps"] or 0.0
            e["gbps_per_thread"] = g / e["threads"]
            e["threads_per_10gbps"] = 10.0 * e["threads"] / g if g else None
            e["speedup_vs_1"] = g / base if base else None
        for s in slots:
            pool.release(s, None)
        pool.close()
        del srcs, dsts, slots, pool
        gc.collect()
        out["sizes"].append(entry)
        save()
    bar.close()

    for entry in out["sizes"]:
        rows = [
            [
                e["threads"],
                fmt(1e3 * e["median_s"]),
                fmt(e["gbps"]),
                fmt(e["gbps_per_thread"]),
                fmt(e["threads_per_10gbps"]),
                fmt(e["speedup_vs_1"], ".2f"),
                fmt(e.get("memcpy_gbps")),
                fmt(e["torch_copy_gbps"]),
            ]
            for e in entry["threads"]
        ]
        tc = entry["torch_copy"]
        rows.append(
            [f"torch default ({tc['threads']})", fmt(1e3 * tc["median_s"]), fmt(tc["gbps"]), "", "", "", "", ""]
        )
        dst_kind = "pinned pool slot" if pin else "unpinned pool slot (cpu smoke)"
        log()
        log(
            table(
                [
                    "threads",
                    "ms",
                    "GB/s",
                    "GB/s per thread",
                    "cores per 10 GB/s",
                    "speed-up",
                    "memcpy GB/s",
                    "torch copy_ GB/s",
                ],
                rows,
                title=f"Part 2: staging {fmt_size(entry['bytes'])} pageable -> {dst_kind}, "
                f"ParallelCopier ({entry.get('copier_backend')}), median of {entry['reps']}",
                first_left=False,
            )
        )
        for note in entry["notes"]:
            log(f"  note: {note}")


# --------------------------------------------------------------------------------------------
# Part 3: training-loop experiment
# --------------------------------------------------------------------------------------------
class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc
        self.tb = traceback.format_exc()


class ThreadedPinnedFeeder:
    """Mode (iii): a background thread stages each batch into a PinnedPool slot with a
    ParallelCopier and copies it to the GPU on a side stream. A slot is reused only after the
    event recorded after its copy has completed (pool.acquire waits for it); the consumer's
    stream waits on that event and the output is record_stream'd for the consumer."""

    def __init__(self, srcs, total: int, nbytes: int, slots: int, threads: int, device):
        from torch_fastload.pool import PinnedPool
        from torch_fastload.staging import ParallelCopier

        self.srcs, self.total, self.nbytes, self.device = srcs, total, nbytes, device
        self.pool = PinnedPool(slots, nbytes, pin=True)
        self.copier = ParallelCopier(threads)
        self.stream = torch.cuda.Stream(device=device)
        self.q: queue.Queue = queue.Queue(maxsize=slots)
        self.stop = threading.Event()
        self.stage_s = 0.0
        self.slot_wait_s = 0.0
        self.consumer_wait_s = 0.0
        self.thread = threading.Thread(target=self._run, name="pin-bench-feeder", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            torch.cuda.set_device(self.device)
            for step in range(self.total):
                if self.stop.is_set():
                    return
                t0 = time.perf_counter()
                slot = self.pool.acquire(stop=self.stop, timeout=60)
                t1 = time.perf_counter()
                span = slot.buffer[: self.nbytes]
                try:
                    stage_copy(self.copier, span, self.srcs[step % len(self.srcs)])
                    t2 = time.perf_counter()
                    with torch.cuda.stream(self.stream):
                        out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                        out.copy_(span, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self.stream)
                except BaseException:
                    self.pool.release(slot, None)
                    raise
                self.pool.release(slot, done)
                self.slot_wait_s += t1 - t0
                self.stage_s += t2 - t1
                if not self._put((out, done)):
                    return
        except BaseException as exc:  # carried to the consumer's next()
            self._put(_Failure(exc))

    def __next__(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            item = self.q.get(timeout=120)
        except queue.Empty:
            raise RuntimeError("threaded feeder produced nothing for 120 s") from None
        self.consumer_wait_s += time.perf_counter() - t0
        if isinstance(item, _Failure):
            raise RuntimeError(f"feeder thread failed:\n{item.tb}") from item.exc
        out, done = item
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out

    def __iter__(self):
        return self

    def close(self):
        self.stop.set()
        self.thread.join(timeout=30)
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        torch.cuda.synchronize(self.device)
        self.copier.close()
        self.pool.close()


class _SourceDataset(torch.utils.data.Dataset):
    """Map-style dataset whose items are whole batches (for batch_size=None)."""

    def __init__(self, srcs, length: int):
        self.srcs = srcs
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.srcs[index % len(self.srcs)]


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def make_compute(kind: str, ms: float, sleeper: Sleeper, device):
    """A callable that enqueues about ``ms`` of GPU work on the current stream, and its info."""
    if ms <= 0:
        return (lambda: None), {"kind": "none", "target_ms": 0.0}
    if kind == "sleep" and sleeper.available and sleeper.cycles_per_ms:
        cycles = sleeper.cycles(ms)
        return (lambda: torch.cuda._sleep(cycles)), {"kind": "sleep", "target_ms": ms, "cycles": cycles}
    # matmul (asked for, or _sleep unavailable)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.matmul(a, b, out=c)
    end.record()
    end.synchronize()
    per = start.elapsed_time(end) / 20
    count = max(1, round(ms / per))

    def run():
        for _ in range(count):
            torch.matmul(a, b, out=c)

    return run, {
        "kind": "matmul",
        "target_ms": ms,
        "matmul_4096_bf16_ms": per,
        "matmuls": count,
        "note": None if kind == "matmul" else f"fell back to matmul: {sleeper.error}",
    }


def run_loop(batches, compute, total: int, warm: int, nbytes: int, expected, max_inflight: int, device) -> dict:
    """Consume ``total`` batches, compute per step; time the last ``total - warm`` steps.

    The step time is read on the GPU: between the events recorded after step ``warm - 1`` and
    after the last step on the consumer stream, so work still queued when timing starts is not
    charged to the timed steps (the host runs up to ``max_inflight`` steps ahead). The host's
    wall time over the same steps is kept as ``host_step_ms``.
    """
    chk = torch.zeros((total, 2), dtype=torch.uint8, device=device)
    inflight: collections.deque = collections.deque()
    t0 = None
    first_ev = last_ev = None
    for step in range(total):
        if step == warm:
            t0 = time.perf_counter()
        x = next(batches)
        t = _first_tensor(x)
        if t is None or t.device.type != "cuda" or t.numel() * t.element_size() != nbytes:
            what = type(x).__name__ if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}"
            raise RuntimeError(f"step {step}: expected a CUDA tensor of {nbytes} bytes, got {what}")
        flat = t.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        compute()
        chk[step].copy_(flat[:: max(1, flat.numel() - 1)][:2])  # first and last byte, on the GPU
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if step == warm - 1:
            first_ev = ev
        last_ev = ev
        inflight.append(ev)
        if len(inflight) > max_inflight:  # a real loop cannot run ahead of the GPU forever
            inflight.popleft().synchronize()
        del x, t, flat
    torch.cuda.synchronize()
    host_elapsed = time.perf_counter() - t0
    timed = total - warm
    elapsed = first_ev.elapsed_time(last_ev) / 1e3
    res = {
        "steps": timed,
        "elapsed_s": elapsed,
        "step_ms": 1e3 * elapsed / timed,
        "gbps": nbytes * timed / elapsed / 1e9,
        "host_step_ms": 1e3 * host_elapsed / timed,
    }
    if expected is not None:
        got = chk.cpu().tolist()
        wrong = [s for s in range(total) if got[s] != [expected(s), expected(s)]]
        res["data_check"] = (
            "ok"
            if not wrong
            else f"{len(wrong)} of {total} batches had wrong bytes (first: step {wrong[0]}: {got[wrong[0]]}, "
            f"expected {expected(wrong[0])})"
        )
    else:
        res["gbps"] = None  # no batch moved: compute only
    return res


def part3_loop(args, sleeper: Sleeper, results: dict, save) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    B = args.batch_bytes
    R = args.sources
    K, W = args.steps, args.warmup_steps
    total = K + W
    values = [(11 + 29 * i) % 251 + 1 for i in range(R)]
    srcs = [aligned_empty(B, fill=values[i]) for i in range(R)]

    def expected(step):
        return values[step % R]

    out: dict = {
        "batch_bytes": B,
        "sources": R,
        "steps": K,
        "warmup_steps": W,
        "max_inflight": args.max_inflight,
        "stage_threads": args.loader_threads,
        "slots": args.slots,
        "compute_kind": args.compute,
        "settings": [],
    }
    results["part3_loop"] = out

    modes = [
        "compute-only",
        "(i) pageable .cuda()",
        "(ii) pin_memory().cuda(nb)",
        "(iii) threaded pinned pool",
        "(iv) torch_fastload.DataLoader",
    ]
    bar = Progress(len(args.compute_ms) * len(modes), "part 3: loop", args.progress)
    for ms in args.compute_ms:
        compute, cinfo = make_compute(args.compute, ms, sleeper, device)
        setting = {"compute_ms": ms, "compute": cinfo, "modes": {}}
        out["settings"].append(setting)

        def record(name, fn):
            try:
                res = fn()
            except Exception as exc:
                res = {"error": error_text(exc), "traceback": traceback.format_exc()}
            setting["modes"][name] = res
            save()
            bar.update(1, note=f"{ms:g} ms {name.split(')')[0].strip('(')}")
            return res

        def compute_only():
            dummy = torch.zeros(B, dtype=torch.uint8, device=device)
            return run_loop(iter(lambda: dummy, None), compute, total, W, B, None, args.max_inflight, device)

        base = record(modes[0], compute_only)

        def pageable():
            gen = (srcs[s % R].cuda(device) for s in range(total))
            return run_loop(gen, compute, total, W, B, expected, args.max_inflight, device)

        def pinned():
            gen = (srcs[s % R].pin_memory().cuda(device, non_blocking=True) for s in range(total))
            return run_loop(gen, compute, total, W, B, expected, args.max_inflight, device)

        def threaded():
            feeder = ThreadedPinnedFeeder(srcs, total, B, args.slots, args.loader_threads, device)
            try:
                res = run_loop(feeder, compute, total, W, B, expected, args.max_inflight, device)
            finally:
                feeder.close()
            res["feeder"] = {
                "copier_backend": copier_backend(feeder.copier),
                "stage_s": feeder.stage_s,
                "stage_gbps": gbps(B * total, feeder.stage_s),
                "slot_wait_s": feeder.slot_wait_s,
                "consumer_wait_s": feeder.consumer_wait_s,
            }
            return res

        def project_loader():
            import torch_fastload

            loader_cls = getattr(torch_fastload, "DataLoader", None)
            if loader_cls is None:
                raise ImportError(
                    f"torch_fastload has no DataLoader yet (module at {getattr(torch_fastload, '__path__', '?')})"
                )
            kwargs = dict(batch_size=None, device="cuda", stage_threads=args.loader_threads)
            kwargs.update(args.loader_kwargs)
            loader = loader_cls(_SourceDataset(srcs, total), **kwargs)
            faulthandler.dump_traceback_later(args.loader_timeout, exit=True)
            try:
                it = iter(loader)
                res = run_loop(it, compute, total, W, B, expected, args.max_inflight, device)
                try:
                    next(it)
                    res["note"] = "loader yielded more batches than the dataset holds"
                except StopIteration:
                    pass
                del it
            finally:
                faulthandler.cancel_dump_traceback_later()
            res["loader_kwargs"] = {k: v for k, v in kwargs.items()}
            stats_fn = getattr(loader, "stats", None)
            if stats_fn is not None:
                try:
                    snap = stats_fn()
                    res["stats_text"] = str(snap)
                    res["wait_fraction"] = getattr(snap, "wait_fraction", None)
                    res["stats_gbps"] = getattr(snap, "gbps", None)
                    if hasattr(snap, "as_dict"):
                        res["stats"] = snap.as_dict()
                except Exception as exc:
                    res["stats_error"] = error_text(exc)
            close = getattr(loader, "close", None) or getattr(loader, "shutdown", None)
            if callable(close):
                close()
            del loader
            gc.collect()
            return res

        for name, fn in zip(modes[1:], [pageable, pinned, threaded, project_loader]):
            record(name, fn)
            gc.collect()

        base_ms = base.get("step_ms") if ms > 0 else None
        for name, res in setting["modes"].items():
            if "step_ms" in res and base_ms:
                res["overlap"] = base_ms / res["step_ms"]
                res["input_overhead_ms"] = res["step_ms"] - base_ms
        save()
    bar.close()
    if sleeper.available and sleeper.cycles_per_ms and args.compute == "sleep":
        # the SM clock can move during a run: re-measure the sleep once more for the record
        probe = max(args.compute_ms) or 1.0
        out["sleep_recheck"] = {"target_ms": probe, "measured_ms": sleeper.measure_ms(probe)}
    del srcs
    gc.collect()

    for setting in out["settings"]:
        log()
        log(part3_table(setting, out))
        for name, res in setting["modes"].items():
            if res.get("stats_text"):
                log(f"  {name} loader.stats():")
                for line in res["stats_text"].splitlines():
                    log("    " + line)


def part3_table(setting: dict, out: dict) -> str:
    rows = []
    for name, res in setting["modes"].items():
        if "error" in res:
            rows.append([name, "-", "-", "-", "-", "ERROR: " + res["error"][:90]])
            continue
        extra = []
        if res.get("data_check") not in (None, "ok"):
            extra.append("DATA WRONG: " + res["data_check"])
        if res.get("wait_fraction") is not None:
            extra.append(
                f"stats: wait {100 * res['wait_fraction']:.1f}%, "
                f"{fmt(res.get('stats_gbps'), '.1f')} GB/s (warm-up included)"
            )
        if res.get("feeder"):
            f = res["feeder"]
            extra.append(
                f"stage {fmt(f['stage_gbps'], '.1f')} GB/s, consumer wait {fmt(f['consumer_wait_s'] * 1e3, '.0f')} ms"
            )
        if res.get("note"):
            extra.append(res["note"])
        rows.append(
            [
                name,
                fmt(res["step_ms"]),
                fmt(res["gbps"]),
                fmt(res.get("overlap"), ".2f"),
                fmt(res.get("input_overhead_ms")),
                "; ".join(extra) or ("data ok" if res.get("data_check") == "ok" else ""),
            ]
        )
    c = setting["compute"]
    desc = f"{c['kind']}" + (f" (target {c['target_ms']:g} ms)" if c.get("target_ms") else "")
    return table(
        ["mode", "step ms", "GB/s", "overlap", "input ms/step", "notes"],
        rows,
        title=f"Part 3: {out['steps']} steps x {fmt_size(out['batch_bytes'])} batch, "
        f"compute {desc}, stage_threads {out['stage_threads']}, slots {out['slots']}",
        first_left=False,
    )


# --------------------------------------------------------------------------------------------
# plot and summary
# --------------------------------------------------------------------------------------------
def make_plot(results: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"no plot: matplotlib unavailable ({error_text(exc)})"
    p1 = results.get("part1_h2d", {}).get("sizes") or []
    p2 = results.get("part2_staging", {}).get("sizes") or []
    p3 = results.get("part3_loop", {}).get("settings") or []
    panels = [p for p, data in (("h2d", p1), ("stage", p2), ("loop", p3)) if data]
    if not panels:
        return "no plot: nothing measured"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    axes = list(axes[0])
    gpu = (results.get("machine", {}).get("gpu") or {}).get("name", "CPU only")
    for ax, panel in zip(axes, panels):
        if panel == "h2d":
            x = [r["bytes"] / MiB for r in p1]
            for key, label, style in (
                ("pageable_gbps", "pageable", "o-"),
                ("pinned_gbps", "pinned (torch.empty pin_memory)", "s-"),
                ("pool_gbps", "PinnedPool slot (register)", "^--"),
            ):
                y = [r.get(key) for r in p1]
                if any(v is not None for v in y):
                    ax.plot(x, [float("nan") if v is None else v for v in y], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(x)
            ax.set_xticklabels([fmt_size(r["bytes"]).replace(" ", "") for r in p1], rotation=45)
            ax.set_xlabel("copy size")
            ax.set_ylabel("H2D GB/s (1e9 B/s)")
            ax.set_title("H2D copy_(non_blocking=True)")
            ax.set_ylim(bottom=0)
        elif panel == "stage":
            for entry in p2:
                th = [e["threads"] for e in entry["threads"]]
                (line,) = ax.plot(
                    th, [e["gbps"] for e in entry["threads"]], "o-", label=f"ParallelCopier {fmt_size(entry['bytes'])}"
                )
                tg = [e.get("torch_copy_gbps") for e in entry["threads"]]
                if any(tg):
                    ax.plot(
                        th,
                        [float("nan") if v is None else v for v in tg],
                        "x:",
                        color=line.get_color(),
                        label=f"torch copy_ {fmt_size(entry['bytes'])}",
                    )
            ax.set_xscale("log", base=2)
            allth = sorted({e["threads"] for entry in p2 for e in entry["threads"]})
            ax.set_xticks(allth)
            ax.set_xticklabels([str(t) for t in allth])
            ax.set_xlabel("staging threads")
            ax.set_ylabel("pageable -> pool GB/s")
            pinned = results.get("part2_staging", {}).get("pinned_destination")
            ax.set_title("staging into " + ("pinned" if pinned else "unpinned (cpu smoke)") + " slots")
            ax.set_ylim(bottom=0)
        else:
            names = list(p3[0]["modes"].keys())[1:]
            width = 0.8 / max(1, len(p3))
            for i, setting in enumerate(p3):
                vals = [setting["modes"].get(nm, {}).get("gbps") or 0.0 for nm in names]
                xs = [j + i * width for j in range(len(names))]
                bars = ax.bar(xs, vals, width, label=f"compute {setting['compute_ms']:g} ms")
                for bx, nm in zip(bars, names):
                    ov = setting["modes"].get(nm, {}).get("overlap")
                    err = "error" in setting["modes"].get(nm, {})
                    text = "err" if err else (f"{ov:.2f}" if ov else "")
                    if text:
                        ax.annotate(
                            text,
                            (bx.get_x() + bx.get_width() / 2, bx.get_height()),
                            ha="center",
                            va="bottom",
                            fontsize=7,
                        )
            ax.set_xticks([j + width * (len(p3) - 1) / 2 for j in range(len(names))])
            ax.set_xticklabels(
                [nm.split(" ", 1)[1] if " " in nm else nm for nm in names], rotation=20, ha="right", fontsize=8
            )
            ax.set_ylabel("effective GB/s (labels: overlap)")
            ax.set_title(f"loop: {fmt_size(results['part3_loop']['batch_bytes'])} batches")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"torch_fastload pin-memory study - {gpu} - torch {torch.__version__}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def summary(results: dict) -> str:
    lines = ["", "=" * 100, "SUMMARY  torch_fastload pin-memory study"]
    m = results.get("machine", {})
    gpu = (m.get("gpu") or {}).get("name", "no GPU")
    lines.append(
        f"  {gpu}; torch {m.get('torch')}; {m.get('cpu_affinity') or m.get('cpu_count')} CPUs "
        f"({m.get('cpu_model')}); {m.get('date')}"
    )
    lines.append(f"  ParallelCopier backend: {results.get('copier_choice')}")
    if results.get("native_copier_problem"):
        lines.append(f"  WARNING: {results['native_copier_problem']} (numpy fallback used)")
    for part, err in (results.get("errors") or {}).items():
        lines.append(f"  ERROR in {part}: {err['error'] if isinstance(err, dict) else err}")
    p1 = results.get("part1_h2d")
    p2 = results.get("part2_staging")
    p3 = results.get("part3_loop")
    if p1 and p1.get("alloc"):
        for r in p1["alloc"]:
            lines.append(
                f"  pinning {fmt_size(r['bytes'])}: fresh pinned alloc {fmt(r['fresh_pinned_gbps'])} GB/s, "
                f"pool touch+register {fmt(r['pool_construct_gbps'])} GB/s "
                f"(register alone {fmt(r['register_gbps'])} GB/s)"
            )
    pinned_ref = None
    if p1 and p1.get("sizes"):
        big = [r["pinned_gbps"] for r in p1["sizes"] if r["bytes"] >= 16 * MiB and r["pinned_gbps"]]
        pinned_ref = max(big) if big else None
    if p2:
        for entry in p2["sizes"]:
            best = max(entry["threads"], key=lambda e: e["gbps"] or 0)
            one = next((e for e in entry["threads"] if e["threads"] == 1), None)
            text = (
                f"  staging {fmt_size(entry['bytes'])}: 1 thread {fmt(one and one['gbps'])} GB/s, best "
                f"{fmt(best['gbps'])} GB/s at {best['threads']} threads "
                f"({fmt(best['threads_per_10gbps'], '.1f')} cores per 10 GB/s); torch copy_ "
                f"{fmt(best.get('torch_copy_gbps'))} GB/s at {best['threads']} threads, "
                f"{fmt(entry['torch_copy']['gbps'])} GB/s at its default {entry['torch_copy']['threads']}"
            )
            if pinned_ref:
                need = next((e["threads"] for e in entry["threads"] if (e["gbps"] or 0) >= pinned_ref), None)
                text += (
                    f"; {need} threads match pinned H2D {pinned_ref:.1f} GB/s"
                    if need
                    else f"; no thread count matched pinned H2D {pinned_ref:.1f} GB/s"
                )
            lines.append(text)
    if p3:
        for setting in p3["settings"]:
            lines.append("")
            lines.append(part3_table(setting, p3))
    if p1 and p1.get("sizes"):
        rows = []
        for r in p1["sizes"]:
            rows.append(
                [
                    fmt_size(r["bytes"]),
                    fmt(r["pageable_gbps"]),
                    fmt(r["pinned_gbps"]),
                    fmt(r["pool_gbps"]),
                    fmt(None if r["ratio"] is None else 100 * r["ratio"], ".1f"),
                    f">={int(100 * r['target'])}%",
                    r["verdict"],
                ]
            )
        lines.append("")
        lines.append(
            table(
                ["size", "pageable GB/s", "pinned GB/s", "pool GB/s", "pool/pinned %", "target", "verdict"],
                rows,
                title="H2D copy_(non_blocking=True): PinnedPool slot vs raw pinned memory",
                first_left=False,
            )
        )
        verdicts = [r["verdict"] for r in p1["sizes"]]
        overall = "PASS" if all(v == "PASS" for v in verdicts) else ("FAIL" if "FAIL" in verdicts else "ERROR")
        lines.append(
            f"pool/pinned target (>=95% for >=16 MiB, >=90% below): {overall} "
            f"({verdicts.count('PASS')}/{len(verdicts)} sizes pass)"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "out", help="directory for the JSON and PNG"
    )
    p.add_argument("--quick", action="store_true", help="short run (<= ~1 min on one H100)")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="no GPU needed: run Part 2 (staging) only, into unpinned pool slots"
    )
    p.add_argument("--parts", type=positive_int_list, default=[1, 2, 3], help="which parts to run, e.g. 1,3")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument(
        "--copier",
        choices=["auto", "numpy"],
        default="auto",
        help="ParallelCopier backend: auto (native C++ where built) or numpy threads",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    g = p.add_argument_group("part 1 (H2D)")
    g.add_argument(
        "--max-size",
        type=parse_size,
        default=None,
        help="cap on every size (e.g. 256MiB); default 1GiB, 256MiB with --quick",
    )
    g.add_argument("--sizes", type=parse_size_list, default=DEFAULT_SIZES, help="H2D copy sizes")
    g.add_argument(
        "--reps", type=int, default=None, help="timed samples per size (doubled <= 8 MiB); default 15, 5 with --quick"
    )
    g.add_argument(
        "--sample-bytes",
        type=parse_size,
        default=64 * MiB,
        help="bytes per timed sample: small sizes do several back-to-back copies (<= 64)",
    )
    g.add_argument(
        "--rotate-bytes",
        type=parse_size,
        default=256 * MiB,
        help="source buffers rotated per size cover this many bytes",
    )
    g.add_argument("--max-rotate", type=int, default=64, help="at most this many rotated buffers")
    g.add_argument(
        "--alloc-sizes", type=parse_size_list, default=[256 * MiB, GiB], help="sizes for the pinning-cost measurement"
    )
    g.add_argument("--alloc-reps", type=int, default=None, help="default 3, 1 with --quick")
    g.add_argument("--skip-alloc", action="store_true", help="skip the pinning-cost measurement")
    g = p.add_argument_group("part 2 (staging)")
    g.add_argument("--stage-sizes", type=parse_size_list, default=None, help="default 64MiB,256MiB; 64MiB with --quick")
    g.add_argument("--threads", type=positive_int_list, default=[1, 2, 4, 8, 16], help="staging thread counts")
    g.add_argument("--stage-reps", type=int, default=None, help="default 9, 3 with --quick")
    g = p.add_argument_group("part 3 (loop)")
    g.add_argument("--batch-bytes", type=parse_size, default=64 * MiB, help="bytes per batch")
    g.add_argument("--steps", type=int, default=None, help="timed steps per mode; default 200, 40 with --quick")
    g.add_argument(
        "--warmup-steps", type=int, default=None, help="untimed steps first (>= 1); default 10, 5 with --quick"
    )
    g.add_argument(
        "--compute-ms",
        type=float_list,
        default=[0.0, 5.0],
        help="simulated GPU compute per step (ms), one experiment each; 0 = input only",
    )
    g.add_argument(
        "--compute",
        choices=["sleep", "matmul"],
        default="sleep",
        help="simulated compute: calibrated torch.cuda._sleep, or bf16 4096^2 matmuls",
    )
    g.add_argument("--loader-threads", type=int, default=8, help="staging threads for modes iii and iv")
    g.add_argument("--slots", type=int, default=3, help="pinned slots for mode iii")
    g.add_argument("--sources", type=int, default=4, help="pre-touched pageable batches rotated")
    g.add_argument(
        "--max-inflight",
        type=int,
        default=2,
        help="steps the host may run ahead of the GPU (a real loop syncs eventually)",
    )
    g.add_argument(
        "--loader-kwargs",
        type=json.loads,
        default={},
        help="extra JSON kwargs for torch_fastload.DataLoader, e.g. '{\"pool_slots\": 3}'",
    )
    g.add_argument(
        "--loader-timeout", type=int, default=300, help="seconds before a hung DataLoader run dumps stacks and exits"
    )
    return p


def finish_args(args) -> None:
    q = args.quick
    if args.max_size is None:
        args.max_size = 256 * MiB if q else GiB
    args.reps = args.reps or (5 if q else 15)
    args.alloc_reps = args.alloc_reps or (1 if q else 3)
    if args.quick and args.alloc_sizes == [256 * MiB, GiB]:
        args.alloc_sizes = [256 * MiB]
    if args.stage_sizes is None:
        args.stage_sizes = [64 * MiB] if q else [64 * MiB, 256 * MiB]
    args.stage_reps = args.stage_reps or (3 if q else 9)
    args.steps = args.steps or (40 if q else 200)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (5 if q else 10)
    for name in (
        "warmup_steps",
        "reps",
        "alloc_reps",
        "stage_reps",
        "steps",
        "loader_threads",
        "slots",
        "sources",
        "max_inflight",
        "max_rotate",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not isinstance(args.loader_kwargs, dict):
        raise SystemExit(f"--loader-kwargs must be a JSON object, got {args.loader_kwargs!r}")


def parts_wanted(args) -> list[int]:
    return [2] if args.cpu_smoke else sorted(set(args.parts))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    finish_args(args)
    use_cuda = not args.cpu_smoke
    if use_cuda and not torch.cuda.is_available():
        sys.stderr.write(
            f"pin_memory.py: CUDA is not available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}): Parts 1-3 need a GPU.\n"
            f"Run with --cpu-smoke to measure the staging part (Part 2) on the CPU only.\n"
        )
        return 2
    if use_cuda:
        if args.device >= torch.cuda.device_count():
            sys.stderr.write(
                f"pin_memory.py: --device {args.device} but only {torch.cuda.device_count()} CUDA device(s)\n"
            )
            return 2
        torch.cuda.set_device(args.device)
        torch.cuda.init()

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "pin_memory_cpu_smoke" if args.cpu_smoke else "pin_memory"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    results: dict = {
        "machine": machine_info(use_cuda),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "design_reference": {
            "pinned_h2d_gbps": [53.5, 55.3],
            "pageable_h2d_gbps": [6, 13],
            "fresh_pin_gbps": [1.1, 1.5],
            "register_gbps": 37,
            "staging_gbps_per_thread": [5, 11],
            "staging_gbps_8_16_threads": [33, 50],
        },
        "errors": {},
    }
    started = time.perf_counter()

    def save():
        results["elapsed_s"] = time.perf_counter() - started
        write_json(json_path, results)

    m = results["machine"]
    log(
        f"torch_fastload pin-memory study: {(m.get('gpu') or {}).get('name', 'CPU smoke (no GPU)')}, "
        f"torch {m['torch']}, {m['cpu_affinity'] or m['cpu_count']} CPUs, {m['date']}"
    )
    log(f"command: {m['command_line']}")
    save()

    if args.copier == "auto" and (2 in parts_wanted(args) or 3 in parts_wanted(args)):
        problem = probe_native_copier()
        if problem:
            results["native_copier_problem"] = problem
            log(f"WARNING: {problem}; falling back to the numpy thread pool for this run")
            args.copier = "numpy"
    results["copier_choice"] = choose_copier(args.copier)
    log(f"ParallelCopier backend: {results['copier_choice']}")
    sleeper = Sleeper()
    parts = parts_wanted(args)
    if use_cuda and (1 in parts or 3 in parts):
        results["sleep_calibration"] = sleeper.calibrate()
        cal = results["sleep_calibration"]
        log(
            "torch.cuda._sleep calibration: "
            + (
                f"{cal['cycles_per_ms']:.0f} cycles/ms (~{cal['implied_sm_clock_mhz']:.0f} MHz SM clock)"
                if cal.get("available")
                else f"unavailable ({cal.get('error')})"
            )
        )

    for part, fn in (
        (1, lambda: part1_h2d(args, sleeper, results, save)),
        (2, lambda: part2_staging(args, use_cuda, results, save)),
        (3, lambda: part3_loop(args, sleeper, results, save)),
    ):
        if part not in parts:
            continue
        try:
            fn()
        except KeyboardInterrupt:
            results["errors"][f"part{part}"] = "interrupted"
            save()
            raise
        except Exception as exc:
            results["errors"][f"part{part}"] = {"error": error_text(exc), "traceback": traceback.format_exc()}
            log(f"\nPart {part} failed: {error_text(exc)}")
            traceback.print_exc()
        save()

    if args.plot:
        problem = make_plot(results, png_path)
        results["plot"] = problem or str(png_path)
    save()
    log()
    log(
        f"wrote {json_path}"
        + (
            f" and {png_path}"
            if args.plot and results.get("plot") == str(png_path)
            else (f" ({results.get('plot')})" if args.plot else "")
        )
    )
    log(f"total time {time.perf_counter() - started:.1f} s")
    log(summary(results))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
