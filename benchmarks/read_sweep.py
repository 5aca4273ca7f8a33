#!/usr/bin/env python3
"""File -> GPU GB/s by threads x task size, hot and cold, for the C++ engine and for kvikio (in the
manner of cuDF's GDS parameter sweep).

One data file of --size random bytes (written once, reused while its size matches) is read
--read-bytes at a time, consecutive reads rotating through its windows.
  engine   torch_fastload.engine.DeviceStager, the loader's device path for files it does not
           map: each task preads into a chunk of a pinned ring and its H2D copy is enqueued on a
           stream; timed to the last copy's completion (on the CPU: engine.read_ranges into
           host memory, in chunks of max(--chunk-bytes, task))
  kvikio   kvikio.CuFile.pread into GPU memory (GDS where present, else compat mode), with
           kvikio.defaults.set("num_threads", threads) per cell
  hot            the file was read once first and sits in the page cache
  cold-buffered  the window dropped from the page cache before each read; the engine preads
  cold-odirect   the same, the engine reads with O_DIRECT
  cold           kvikio after the same drop
Baselines in the same run: the link, the disk (parallel O_DIRECT, no engine code) and one
thread of buffered os.preadv over hot windows. The first cell of each series is checked
against the file (sampled 4 KiB pieces). '*': more threads than tasks a call (some idle);
'!': a cold cell with more than 5% of its window resident before the read.

    python benchmarks/read_sweep.py            # full grid, ~2-4 min on one H100 (+ writing 4 GiB once)
    python benchmarks/read_sweep.py --quick    # threads 1,4,16,64 x tasks 1,4,16 MiB, 512 MiB reads
    python benchmarks/read_sweep.py --backends engine --threads 8,16 --task-sizes 4MiB --no-cold
"""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from torch_fastload import engine
from torch_fastload import io as fio
from torch_fastload._benchutil import (
    PAGE,
    GiB,
    KiB,
    MiB,
    Progress,
    Study,
    aligned_empty,
    disk_baseline,
    drop_page_cache,
    error_text,
    fmt,
    fmt_size,
    gbps,
    link_baseline,
    log,
    parse_study,
    positive_int_list,
    ratio,
    residency,
    size_arg,
    size_list,
    study_parser,
    sync,
    table,
    write_random,
)

NOT_COLD = 0.05
SERIES = [
    ("engine", "hot"),
    ("kvikio", "hot"),
    ("engine", "cold-buffered"),
    ("engine", "cold-odirect"),
    ("kvikio", "cold"),
]


class EngineBackend:
    """The engine's device path as the loader runs it (host memory on the CPU)."""

    RING_BYTES_CAP = 1 << 30  # 64 threads x 64 MiB tasks would otherwise pin 5 GiB

    def __init__(self, device: torch.device, min_chunk: int):
        self.device, self.min_chunk, self.cuda = device, min_chunk, device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.stager, self.key = None, None

    def call_bytes(self, task: int, nbytes: int) -> int:
        return nbytes if self.cuda else min(nbytes, max(self.min_chunk, task))

    def __call__(self, path: str, offset: int, nbytes: int, dst, threads: int, task: int, cold: str | None) -> float:
        o_direct = cold == "odirect"
        if not self.cuda:
            chunk = self.call_bytes(task, nbytes)
            t0 = time.perf_counter()
            for start in range(0, nbytes, chunk):
                n = min(chunk, nbytes - start)
                engine.read_ranges(
                    path,
                    None,
                    [offset + start],
                    [n],
                    dst[start : start + n],
                    num_threads=threads,
                    task_size=task,
                    o_direct=o_direct,
                )
            return time.perf_counter() - t0
        chunks = max(2, min(fio.ring_chunks(threads), self.RING_BYTES_CAP // task))
        if self.key != (task, chunks):
            if self.stager is not None:
                self.stager.close()
            self.stager, self.key = engine.DeviceStager(task, chunks), (task, chunks)
        sync(self.device)
        t0 = time.perf_counter()
        self.stager.read(
            path,
            None,
            [offset],
            [nbytes],
            dst,
            stream=self.stream.cuda_stream,
            num_threads=threads,
            task_size=task,
            o_direct=o_direct,
        )
        self.stream.synchronize()
        return time.perf_counter() - t0


class KvikioBackend:
    """kvikio.CuFile.pread into the device buffer, kvikio's thread pool resized per cell."""

    def __init__(self, path: str, dst):
        import kvikio
        import kvikio.defaults

        self.kvikio, self.info = kvikio, {"version": kvikio.__version__, "gds_status": str(fio.gds_status())}
        for key in ("compat_mode", "task_size", "bounce_buffer_size"):
            value = kvikio.defaults.get(key)
            self.info[key] = getattr(value, "name", value)
        expect = np.fromfile(path, dtype=np.uint8, count=PAGE)  # one page first: the backend works here
        with kvikio.CuFile(path, "r") as f:
            if f.pread(dst[:PAGE], PAGE, 0).get() != PAGE or not np.array_equal(dst[:PAGE].cpu().numpy(), expect):
                raise ValueError("kvikio's probe read returned wrong bytes")

    def __call__(self, path: str, offset: int, nbytes: int, dst, threads: int, task: int, cold: str | None) -> float:
        self.kvikio.defaults.set("num_threads", threads)
        with self.kvikio.CuFile(path, "r") as f:
            sync(dst.device)
            t0 = time.perf_counter()
            got = f.pread(dst[:nbytes], nbytes, offset, task_size=task).get()
            sync(dst.device)
            seconds = time.perf_counter() - t0
        if got != nbytes:
            raise EOFError(f"kvikio pread returned {got} of {nbytes} bytes at offset {offset}")
        return seconds


def verify(dst, fd: int, offset: int, nbytes: int, rng: np.random.Generator) -> str | None:
    """None when sampled 4 KiB pieces of the window (first, last, one per 64 MiB) match the file."""
    starts = {0, max(0, nbytes - PAGE)}
    for base in range(0, nbytes, 64 * MiB):
        span = min(64 * MiB, nbytes - base) - PAGE
        starts.add(base + (int(rng.integers(0, span // PAGE + 1)) * PAGE if span > 0 else 0))
    for s in sorted(starts):
        n = min(PAGE, nbytes - s)
        got = dst[s : s + n].cpu().numpy() if isinstance(dst, torch.Tensor) else dst[s : s + n]
        want = np.frombuffer(os.pread(fd, n, offset + s), dtype=np.uint8)
        if not np.array_equal(got, want):
            return f"wrong bytes in the window's 4 KiB piece at {s} (file offset {offset + s})"
    return None


class Sweep:
    def __init__(self, study: Study, args, fd: int, dst, backends: dict, skip: dict):
        self.study, self.args, self.fd, self.dst, self.backends, self.skip = study, args, fd, dst, backends, skip
        self.windows = [i * args.read_bytes for i in range(args.size // args.read_bytes)]
        self.next_window, self.verified, self.failures = 0, set(), {}
        self.rng = np.random.default_rng(1)

    def cell(self, backend: str, mode: str, threads: int, task: int, reps: int) -> dict:
        nbytes, path = self.args.read_bytes, self.args.path
        call = (
            self.backends["engine"].call_bytes(task, nbytes)
            if backend == "engine" and "engine" in self.backends
            else nbytes
        )
        entry = {"backend": backend, "mode": mode, "threads": threads, "task_size": task, "status": "ok", "gbps": None}
        entry.update(idle_threads=threads > math.ceil(call / task), reps=[])
        reason = self.skip.get((backend, mode))
        if reason is None and self.failures.get((backend, mode), 0) >= 2:
            reason = "stopped after 2 failed cells"
        if reason is not None:
            return {**entry, "status": "skipped", "reason": reason}
        cold = None if mode == "hot" else {"cold-buffered": "buffered", "cold-odirect": "odirect"}.get(mode, "default")
        check = (backend, mode) not in self.verified
        try:
            for rep in range(reps):
                offset = self.windows[self.next_window % len(self.windows)]
                self.next_window += 1
                if cold is not None:
                    drop_page_cache(path, offset, nbytes)
                if check and rep == 0:
                    self.dst[:] = 0xAB
                    sync(self.args.device)
                resident = residency(path, offset, nbytes)
                c0 = time.process_time()  # every thread of this process: the engine's and kvikio's too
                seconds = self.backends[backend](path, offset, nbytes, self.dst, threads, task, cold)
                cores = (time.process_time() - c0) / seconds
                entry["reps"].append(
                    {"offset": offset, "gbps": gbps(nbytes, seconds), "resident_before": resident, "cpu_cores": cores}
                )
                if check and rep == 0:
                    problem = verify(self.dst, self.fd, offset, nbytes, self.rng)
                    entry["verified"] = problem is None
                    self.verified.add((backend, mode))
                    if problem:
                        raise AssertionError(problem)
        except Exception as exc:
            self.failures[(backend, mode)] = self.failures.get((backend, mode), 0) + 1
            self.study["failures"].append(
                {"what": f"{backend} {mode} T{threads} x {fmt_size(task)}", "error": error_text(exc)}
            )
            log(f"{backend} {mode} T{threads} x {fmt_size(task)}: FAILED {error_text(exc)}")
            return {**entry, "status": "error", "reason": error_text(exc)}
        residents = [r["resident_before"] for r in entry["reps"] if r["resident_before"] is not None]
        entry.update(
            gbps=statistics.median(r["gbps"] for r in entry["reps"]),
            cpu_cores=statistics.median(r["cpu_cores"] for r in entry["reps"]),
            not_cold=bool(cold and residents and max(residents) > NOT_COLD),
        )
        return entry

    def run(self, series: list, threads: list, tasks: list, reps: int) -> None:
        bar = Progress(len(threads) * len(tasks) * len(series), "cells", self.args.progress)
        for t in threads:  # backends interleaved per cell, so drift hits them alike
            for s in tasks:
                for backend, mode in series:
                    entry = self.cell(backend, mode, t, s, reps)
                    self.study["cells"].append(entry)
                    bar.update(1, f"{backend} {mode} T{t} x {fmt_size(s)}: {fmt(entry['gbps'])}")
                self.study.save()
        bar.close()


def hot_one_thread(path: str, offsets: list, nbytes: int, block: int = 64 * MiB) -> dict:
    """One thread of os.preadv into a reused bytearray over hot windows."""
    block = min(block, nbytes)
    view, samples = memoryview(bytearray(block)), []
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in offsets:
            t0 = time.perf_counter()
            for off in range(offset, offset + nbytes, block):
                if os.preadv(fd, [view[: min(block, offset + nbytes - off)]], off) <= 0:
                    raise EOFError(f"preadv at {off} read nothing")
            samples.append(gbps(nbytes, time.perf_counter() - t0))
    finally:
        os.close(fd)
    return {"what": f"1 thread, os.preadv of {fmt_size(block)}, page cache hot", "gbps": statistics.median(samples)}


def warm(path: str, size: int) -> dict:
    """The whole file read once (engine, 16 threads x 4 MiB) so every window is hot."""
    buf = np.empty(min(256 * MiB, size), dtype=np.uint8)
    t0 = time.perf_counter()
    for off in range(0, size, buf.size):
        n = min(buf.size, size - off)
        engine.read_ranges(path, None, [off], [n], buf[:n], num_threads=16, task_size=4 * MiB)
    return {"gbps": gbps(size, time.perf_counter() - t0), "resident_after": residency(path)}


def best_cell(cells: list, backend: str, mode: str) -> dict | None:
    ok = [c for c in cells if c["backend"] == backend and c["mode"] == mode and c["gbps"] is not None]
    return max(ok, key=lambda c: c["gbps"]) if ok else None


def cell_text(c: dict | None) -> str:
    if c is None or c["status"] != "ok":
        return "" if c is None else {"skipped": "skip", "error": "err"}[c["status"]]
    return f"{c['gbps']:.2f}" + ("*" if c["idle_threads"] else "") + ("!" if c.get("not_cold") else "")


def grid(cells: list, backend: str, mode: str) -> tuple[list, list, dict]:
    mine = [c for c in cells if c["backend"] == backend and c["mode"] == mode]
    threads, tasks = sorted({c["threads"] for c in mine}), sorted({c["task_size"] for c in mine})
    return threads, tasks, {(c["threads"], c["task_size"]): c for c in mine}


def summarize(study: Study) -> list[str]:
    cells, base, out = study["cells"], study["baselines"], []
    link, disk, hot1 = ((base.get(k) or {}).get("gbps") for k in ("link", "disk", "hot_1_thread"))
    rows = []
    for backend, mode in study["series"]:
        threads, tasks, by = grid(cells, backend, mode)
        if not by:
            continue
        title = f"{backend} {mode}: GB/s file -> {study.args.device.type}, {fmt_size(study.args.read_bytes)} a read"
        out.append(
            table(
                ["threads \\ task"] + [fmt_size(k) for k in tasks],
                [[t] + [cell_text(by.get((t, k))) for k in tasks] for t in threads],
                title,
            )
        )
        reasons = sorted({c["reason"] for c in by.values() if c["status"] != "ok"})
        out[-1] += "".join(f"\n  not measured: {r}" for r in reasons)
        b = best_cell(cells, backend, mode)
        study.figure(f"best_gbps_{backend}_{mode}", b and b["gbps"])
        if b:
            over = ratio(b["gbps"], disk) if mode != "hot" else ratio(b["gbps"], hot1)
            rows.append(
                [
                    f"{backend} {mode}",
                    fmt(b["gbps"]),
                    b["threads"],
                    fmt_size(b["task_size"]),
                    fmt(100 * (ratio(b["gbps"], link) or 0), ".0f"),
                ]
            )
            rows[-1] += [f"{fmt(over)}x {'disk' if mode != 'hot' else 'hot-1T'}", fmt(b["cpu_cores"])]
        else:
            rows.append([f"{backend} {mode}", "-", "", "", "", "", reasons[0] if reasons else "no cell ran"])
        for (t, k), c in by.items():
            study.figure(f"gbps_{backend}_{mode}_{t}x{fmt_size(k).replace(' ', '')}", c["gbps"])
    g = {f"{b} {m}": (best_cell(cells, b, m) or {}).get("gbps") for b, m in study["series"]}
    cold_engine = max((v for v in (g.get("engine cold-buffered"), g.get("engine cold-odirect")) if v), default=None)
    study["ratios"] = {
        "engine_over_kvikio_hot": ratio(g.get("engine hot"), g.get("kvikio hot")),
        "engine_over_kvikio_cold": ratio(cold_engine, g.get("kvikio cold")),
    }
    for key, value in study["ratios"].items():
        study.figure(key, value)
    for key in ("link", "disk", "hot_1_thread"):
        study.figure(f"{key}_gbps", (base.get(key) or {}).get("gbps"))
    lines = [
        f"  {k:<14} {fmt((base.get(k) or {}).get('gbps'))} GB/s  {(base.get(k) or {}).get('what', '')}"
        for k in ("link", "disk", "hot_1_thread", "warm")
    ]
    out.append("baselines (same run):\n" + "\n".join(lines))
    out.append(
        table(
            ["backend mode", "best GB/s", "threads", "task", "% link", "over", "CPU cores"],
            rows,
            "best cell of each series",
        )
    )
    r = study["ratios"]
    out.append(
        f"engine best / kvikio best: hot {fmt(r['engine_over_kvikio_hot'])}x, cold {fmt(r['engine_over_kvikio_cold'])}x"
    )
    return out


def plot(data: dict, plt):
    from matplotlib.colors import LogNorm

    series = [
        s for s in data["series"] if any(c["gbps"] for c in data["cells"] if (c["backend"], c["mode"]) == tuple(s))
    ]
    values = [c["gbps"] for c in data["cells"] if c["gbps"]]
    norm = LogNorm(vmin=min(values) / 1.05, vmax=max(values) * 1.05)
    fig, axes = plt.subplots(1, len(series), figsize=(4.6 * len(series), 4.2), squeeze=False, layout="constrained")
    for ax, (backend, mode) in zip(axes[0], series):
        threads, tasks, by = grid(data["cells"], backend, mode)
        values = np.array([[(by.get((t, k)) or {}).get("gbps") or np.nan for k in tasks] for t in threads])
        image = ax.imshow(np.ma.masked_invalid(values), norm=norm, cmap="viridis", aspect="auto")
        for i, t in enumerate(threads):
            for j, k in enumerate(tasks):
                shade = norm(values[i, j]) if not np.isnan(values[i, j]) else 1.0
                ax.text(
                    j,
                    i,
                    cell_text(by.get((t, k))),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if shade < 0.55 else "black",
                )
        ax.set_xticks(range(len(tasks)), [fmt_size(k).replace(" ", "") for k in tasks], fontsize=8)
        ax.set_yticks(range(len(threads)), threads, fontsize=8)
        ax.set(xlabel="task size", ylabel="threads", title=f"{backend} {mode}")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.85, label="GB/s (log scale)")
    base = data["baselines"]
    link, disk = (fmt((base.get(k) or {}).get("gbps")) for k in ("link", "disk"))
    fig.suptitle(f"read sweep: link {link} GB/s, disk O_DIRECT {disk} GB/s", fontsize=10)
    return fig


def backends_for(study: Study, args, dst) -> tuple[dict, dict]:
    """The backends that can run here, and why each series that cannot is skipped."""
    backends, skip = {}, {}
    if "engine" in args.backends:
        backends["engine"] = EngineBackend(args.device, args.chunk_bytes)
        try:  # O_DIRECT probe: one aligned page
            engine.read_ranges(
                args.path, None, [0], [PAGE], aligned_empty(PAGE), num_threads=1, task_size=PAGE, o_direct=True
            )
        except OSError as exc:
            skip[("engine", "cold-odirect")] = f"the filesystem refuses O_DIRECT ({error_text(exc)})"
    if "kvikio" in args.backends:
        why = "no GPU: kvikio reads into GPU memory" if args.device.type != "cuda" else None
        try:
            backends["kvikio"] = None if why else KvikioBackend(args.path, dst)
            study["kvikio"] = backends["kvikio"] and backends["kvikio"].info
        except Exception as exc:
            why = f"kvikio unusable here: {error_text(exc)}"
        if why:
            backends.pop("kvikio", None)
            log(f"kvikio skipped: {why}")
            skip.update({s: why for s in SERIES if s[0] == "kvikio"})
    return backends, skip


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--dir", type=Path, help="directory of the data file, not a tmpfs [OUT/data]")
    p.add_argument("--size", type=size_arg, help="data file size [4GiB; cpu 16MiB]")
    p.add_argument("--read-bytes", type=size_arg, help="bytes a read [1GiB; quick 512MiB; cpu 4MiB]")
    p.add_argument("--threads", type=positive_int_list, help="hot thread counts [1,2,4,8,16,32,64; quick 1,4,16,64]")
    p.add_argument("--task-sizes", type=size_list, help="hot task sizes [256KiB..64MiB; quick 1,4,16MiB]")
    p.add_argument("--cold-threads", type=positive_int_list, help="cold thread counts [1,4,16,64]")
    p.add_argument("--cold-task-sizes", type=size_list, help="cold task sizes [1MiB,4MiB,16MiB]")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="hot cells only")
    p.add_argument("--backends", default="engine,kvikio", help="comma-separated subset of engine,kvikio")
    p.add_argument("--chunk-bytes", type=size_arg, help="CPU runs: bytes a read_ranges call [1MiB]")
    p.add_argument("--reps", type=int, help="reads per hot cell, median [3; quick 2]")
    p.add_argument("--cold-reps", type=int, default=1, help="reads per cold cell (each dropped first)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before a hung run dumps every stack and exits")
    args = parse_study(
        p,
        argv,
        size=(4 * GiB, 4 * GiB, 16 * MiB),
        read_bytes=(GiB, 512 * MiB, 4 * MiB),
        threads=([1, 2, 4, 8, 16, 32, 64], [1, 4, 16, 64], [1, 2]),
        task_sizes=([256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB], [MiB, 4 * MiB, 16 * MiB], [MiB]),
        cold_threads=([1, 4, 16, 64], [1, 4, 16, 64], [1, 2]),
        cold_task_sizes=([MiB, 4 * MiB, 16 * MiB], [MiB, 4 * MiB, 16 * MiB], [MiB]),
        chunk_bytes=(MiB, MiB, MiB),
        reps=(3, 2, 2),
    )
    args.backends = [b for b in args.backends.split(",") if b in ("engine", "kvikio")]
    if args.read_bytes > args.size or args.size % PAGE or args.read_bytes % PAGE:
        raise SystemExit("--size and --read-bytes must be multiples of 4096 (O_DIRECT), --read-bytes <= --size")
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    study = Study("read_sweep", args, "file -> GPU read sweep, engine vs kvikio")
    directory = args.dir or args.out / "data"
    directory.mkdir(parents=True, exist_ok=True)
    args.path = str(directory / f"read_sweep_{fmt_size(args.size).replace(' ', '')}.bin")
    write_random(Path(args.path), args.size, seed=0, progress=args.progress)
    cuda = args.device.type == "cuda"
    dst = (
        torch.empty(args.read_bytes, dtype=torch.uint8, device=args.device) if cuda else aligned_empty(args.read_bytes)
    )
    backends, skip = backends_for(study, args, dst)
    study["series"] = [s for s in SERIES if s[0] in args.backends and (args.cold or s[1] == "hot")]
    windows = [i * args.read_bytes for i in range(args.size // args.read_bytes)]
    base = study["baselines"] = {}
    base["link"] = study.attempt("link", link_baseline, args.device, min(256 * MiB, args.size))
    base["disk"] = study.attempt("disk", disk_baseline, args.path, windows[-1], args.read_bytes)
    base["warm"] = study.attempt("warm", warm, args.path, args.size)
    base["hot_1_thread"] = study.attempt("hot 1 thread", hot_one_thread, args.path, windows[:3], args.read_bytes)
    log("baselines: " + ", ".join(f"{k} {fmt((v or {}).get('gbps'))} GB/s" for k, v in base.items()))
    fd = os.open(args.path, os.O_RDONLY)
    try:
        study["cells"] = []
        sweep = Sweep(study, args, fd, dst, backends, skip)
        sweep.run([s for s in study["series"] if s[1] == "hot"], args.threads, args.task_sizes, args.reps)
        if args.cold:
            sweep.run(
                [s for s in study["series"] if s[1] != "hot"], args.cold_threads, args.cold_task_sizes, args.cold_reps
            )
    finally:
        os.close(fd)
    faulthandler.cancel_dump_traceback_later()
    return study.finish(*summarize(study), plot=plot if any(c["gbps"] for c in study["cells"]) else None)


if __name__ == "__main__":
    sys.exit(main())
