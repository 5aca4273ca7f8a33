"""``python -m torch_fastload doctor``: what this machine's input path can do, measured.

    python -m torch_fastload doctor                    # ~1 min: GPU, H2D, GDS, storage, sweep
    python -m torch_fastload doctor --quick            # smaller file and sweep
    python -m torch_fastload doctor --dir /data --save # measure the data disk; record the best
                                                       # io_threads / io_task_size for the loader

Sections, each measured by one function returning a dict and printed by ``render``:

    gpu       name, memory, driver, PCIe link (current / max) via pynvml or nvidia-smi
    h2d       pinned and pageable host -> device copies (CUDA events, median of 5)
    gds       kvikio / cuFile status and the read path io_mode='auto' picks here
    storage   a test file in --dir: write + fsync, cold O_DIRECT, cold buffered, hot reads;
              the filesystem and block device under it
    sweep     the C++ engine's threads x task size on the page-cached test file (file -> GPU
              through the engine's pinned ring where CUDA is available), and the
              recommended setting

Every section fails soft: an exception prints ``<section>: failed: <Type: message>`` and the
report goes on. ``--save`` writes the recommended setting to ``config.tuning_file()``, which
``config.get('io_threads')`` / ``config.get('io_task_size')`` then use unless an override or
TORCH_FASTLOAD_NUM_THREADS / TORCH_FASTLOAD_TASK_SIZE says otherwise. Exit code: 0, or 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from torch_fastload import config, engine, io
from torch_fastload._benchutil import (
    Progress,
    drop_page_cache,
    error_text,
    fmt,
    h2d_copy_seconds,
    log,
    machine_info,
    positive_int_list,
    run_quiet,
    size_arg,
    size_list,
    table,
    write_json,
)

__all__ = [
    "main",
    "build_parser",
    "gpu_info",
    "measure_h2d",
    "gds_info",
    "measure_storage",
    "sweep",
    "recommend",
    "save_tuning",
    "render",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CHUNK = 64 * MiB  # bytes per read call in the sweep (a large batch) and per write of the test file
NEAR_BEST = 0.95  # cells within 5% of the fastest count as equally fast
STORAGE_THREADS, STORAGE_TASK = 16, 4 * MiB

# PCIe payload GB/s per lane and direction after line encoding (8b/10b to Gen2, 128b/130b from
# Gen3, FLIT from Gen6): the spec's ceiling, to judge the measured H2D rate against.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

SECTIONS = {
    "gpu": "GPU",
    "h2d": "Host -> device copies (H2D)",
    "gds": "GDS / kvikio",
    "storage": "Storage",
    "sweep": "Sweep: engine threads x task size (page cache)",
}


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def _size_text(n: int) -> str:
    """4194304 -> '4 MiB' (exact binary units where they divide, else bytes)."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n} B"


def _gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, as storage and PCIe are quoted."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _kv(rows: list[tuple[str, Any]], indent: str = "  ") -> str:
    """``key   value`` lines with the values aligned."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{indent}{k:<{width}}  {v}" for k, v in rows)


def _read_file(path: str, size: int, dst, threads: int, task_size: int, o_direct: bool = False) -> float:
    """Seconds to read the whole file into ``dst`` with one engine call."""
    start = time.perf_counter()
    got = engine.read_ranges(path, None, [0], [size], dst, num_threads=threads, task_size=task_size, o_direct=o_direct)
    seconds = time.perf_counter() - start
    if got != size:
        raise RuntimeError(f"read {got} bytes of {path}, expected {size}")
    return seconds


# --------------------------------------------------------------------------------------------
# 1. GPU
# --------------------------------------------------------------------------------------------
def _gpus_pynvml() -> list[dict] | None:
    """The GPUs as NVML sees them, or None where pynvml (nvidia-ml-py) is missing or fails."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append(
                {
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // MiB,
                    "driver": driver.decode() if isinstance(driver, bytes) else driver,
                    "pcie_gen_current": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                    "pcie_gen_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                    "pcie_width_current": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                    "pcie_width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
                }
            )
        return gpus
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def _gpus_nvidia_smi() -> list[dict] | None:
    """The GPUs as ``nvidia-smi`` reports them, or None where it is missing or fails."""
    out = run_quiet(
        [
            "nvidia-smi",
            "--query-gpu=name,pcie.link.gen.current,pcie.link.gen.max,"
            "pcie.link.width.current,pcie.link.width.max,memory.total,driver_version",
            "--format=csv,noheader",
        ]
    )
    if not out:
        return None

    def number(text: str):
        match = re.match(r"\s*(\d+)", text)
        return int(match.group(1)) if match else None  # "[N/A]" -> None

    gpus = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.rsplit(",", 6)]  # the name may hold a comma; the rest do not
        if len(fields) != 7:
            continue
        name, gen_cur, gen_max, width_cur, width_max, memory, driver = fields
        gpus.append(
            {
                "name": name,
                "memory_mib": number(memory),
                "driver": driver,
                "pcie_gen_current": number(gen_cur),
                "pcie_gen_max": number(gen_max),
                "pcie_width_current": number(width_cur),
                "pcie_width_max": number(width_max),
            }
        )
    return gpus or None


def gpu_info() -> dict:
    """Which GPUs there are and how they are attached: the PCIe link bounds every H2D copy."""
    cuda = torch.cuda.is_available()
    source, gpus = "pynvml", _gpus_pynvml()
    if gpus is None:
        source, gpus = "nvidia-smi", _gpus_nvidia_smi()
    if gpus is None:
        source, gpus = None, []
    for gpu in gpus:
        lane = PCIE_LANE_GBPS.get(gpu["pcie_gen_max"] or 0)
        gpu["pcie_max_gbps"] = round(lane * gpu["pcie_width_max"], 1) if lane and gpu["pcie_width_max"] else None
    info: dict = {"cuda": cuda, "source": source, "gpus": gpus}
    if cuda:
        dev = torch.cuda.current_device()
        info["device"] = {"index": dev, "name": torch.cuda.get_device_name(dev)}
    else:
        build = getattr(torch.version, "cuda", None)
        info["reason"] = (
            "torch.cuda.is_available() is False (torch "
            + torch.__version__
            + (f", built for CUDA {build}" if build else ", built without CUDA")
            + ")"
        )
    return info


def _link_for(gpu: dict) -> dict | None:
    """The NVML / nvidia-smi entry of the device the copies ran on (by name; index order may differ)."""
    name = (gpu.get("device") or {}).get("name")
    matches = [g for g in gpu.get("gpus", []) if g["name"] == name] or gpu.get("gpus", [])
    return matches[0] if matches else None


# --------------------------------------------------------------------------------------------
# 2. H2D
# --------------------------------------------------------------------------------------------
def measure_h2d(nbytes: int, reps: int = 5) -> dict:
    """Pinned and pageable host -> device copy rates: the ceiling of every staged batch."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    device = torch.device("cuda", torch.cuda.current_device())
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = {
        "pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(nbytes, dtype=torch.uint8).fill_(1),
    }  # touched: no page faults timed
    result: dict = {"bytes": nbytes, "reps": reps}
    try:
        for kind, src in sources.items():
            rates = [_gbps(nbytes, seconds) for seconds in h2d_copy_seconds(src, dst, reps)]
            result[kind] = {"gbps": statistics.median(rates), "samples_gbps": rates}
    finally:
        del dst, sources
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------------------------
# 3. GDS / kvikio
# --------------------------------------------------------------------------------------------
def _native_output(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``fn()`` and what native code printed to fds 1 and 2 meanwhile (kvikio prints its dlopen
    errors straight to stdout, which would land mid-report)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            value = fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        sink.seek(0)
        return value, sink.read().decode(errors="replace").strip()


def gds_info() -> dict:
    """Whether cuFile can DMA into GPU memory here, and the read path 'auto' therefore picks."""
    status, printed = _native_output(io.gds_status)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {
        "available": status.available,
        "kvikio_version": status.kvikio_version,
        "compat_mode": status.compat_mode,
        "reasons": list(status.reasons),
        "device": device,
        "kvikio_printed": printed.splitlines(),
    }
    try:
        path = io.select("auto", device)
        info.update(auto_path=str(path), auto_mode=path.mode)
    except Exception as exc:  # select raises where no path can run (e.g. a bad configured value)
        info.update(auto_path=f"none: {error_text(exc)}", auto_mode=None)
    return info


# --------------------------------------------------------------------------------------------
# 4. storage
# --------------------------------------------------------------------------------------------
def _unescape_mount(text: str) -> str:
    r"""/proc/mounts writes ' ' as \040, tab as \011, ..."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def filesystem_of(path: str) -> dict:
    """The mount holding ``path`` (longest mount-point prefix in /proc/mounts; the last of equal
    ones, which shadows the others) and the block device under it from /sys."""
    real = os.path.realpath(path)
    best = None
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            source, point, fstype = (_unescape_mount(p) for p in parts[:3])
            inside = point == "/" or real == point or real.startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) >= len(best[1])):
                best = (source, point, fstype)
    info: dict = {
        "dir": real,
        "mount_source": best and best[0],
        "mount_point": best and best[1],
        "fstype": best and best[2],
        "block_device": None,
    }
    st = os.stat(path)
    link = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if os.path.exists(link):  # absent for tmpfs, overlay, NFS, ...: no block device of their own
        node = os.path.realpath(link)
        disk = os.path.dirname(node) if os.path.exists(os.path.join(node, "partition")) else node
        info["block_device"] = "/dev/" + os.path.basename(node)

        def sysfs(rel: str) -> str | None:
            try:
                with open(os.path.join(disk, rel)) as f:
                    return f.read().strip() or None
            except OSError:
                return None

        rotational = sysfs("queue/rotational")
        info["disk"] = {
            "name": os.path.basename(disk),
            "model": sysfs("device/model"),
            "rotational": None if rotational is None else rotational == "1",
        }
    return info


def write_test_file(path: str, size: int, seed: int = 0) -> dict:
    """Random bytes (incompressible, no zero-page shortcuts), written in 64 MiB chunks and fsynced
    so every page is clean: POSIX_FADV_DONTNEED only drops clean pages."""
    rng = np.random.default_rng(seed)
    seconds = 0.0
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = rng.bytes(min(CHUNK, left))
            start = time.perf_counter()
            f.write(chunk)
            seconds += time.perf_counter() - start
            left -= len(chunk)
        start = time.perf_counter()
        f.flush()
        os.fsync(f.fileno())
        seconds += time.perf_counter() - start
    return {"gbps": _gbps(size, seconds), "seconds": seconds}


def measure_storage(path: str, size: int) -> dict:
    """Write the test file, then cold (O_DIRECT, buffered) and hot (page cache) reads of it:
    what an epoch costs the first time and when the data set fits in memory."""
    free = shutil.disk_usage(os.path.dirname(path)).free
    if free < size:
        raise OSError(
            errno.ENOSPC, f"{_size_text(size)} test file does not fit: {free / GiB:.1f} GiB free", os.path.dirname(path)
        )
    result: dict = {
        "filesystem": filesystem_of(os.path.dirname(path)),
        "size": size,
        "threads": STORAGE_THREADS,
        "task_size": STORAGE_TASK,
    }
    result["write"] = write_test_file(path, size)
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(0)  # touch every page now, so no read below times page faults
    read = lambda **kw: _read_file(path, size, dst, STORAGE_THREADS, STORAGE_TASK, **kw)  # noqa: E731

    drop_page_cache(path)
    try:
        result["cold_odirect"] = {"gbps": _gbps(size, read(o_direct=True))}
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        result["cold_odirect"] = {
            "skipped": f"the filesystem refuses O_DIRECT (EINVAL) ({result['filesystem']['fstype']})"
        }
    drop_page_cache(path)
    result["cold_buffered"] = {"gbps": _gbps(size, read())}
    read()  # the file is in the page cache now; time the next read
    result["hot"] = {"gbps": _gbps(size, read())}
    return result


# --------------------------------------------------------------------------------------------
# 5. sweep
# --------------------------------------------------------------------------------------------
class _FilePass:
    """One pass over the file as the loader reads it. On CUDA: the engine's device path
    (``engine.DeviceStager``: each task preads into a chunk of a pinned ring and enqueues its
    H2D copy; one call per 64 MiB), timed until the copies finished. Without CUDA: 64 MiB
    read calls into two alternating host buffers."""

    def __init__(self, path: str, size: int, cuda: bool):
        self.path, self.size, self.cuda = path, size, cuda
        self.chunk = min(CHUNK, size)
        self._stager, self._stager_key = None, None
        if cuda:
            self.device_buf = torch.empty(size, dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()
        else:
            self.host = [np.ones(self.chunk, dtype=np.uint8) for _ in range(2)]  # touched

    def _stager_for(self, threads: int, task_size: int):
        from .io import ring_chunks

        if self._stager_key != (threads, task_size):
            if self._stager is not None:
                self._stager.close()
            self._stager = engine.DeviceStager(task_size, ring_chunks(threads))
            self._stager_key = (threads, task_size)
        return self._stager

    def run(self, threads: int, task_size: int) -> float:
        """Seconds for one pass (file -> host, or file -> GPU with the copies finished)."""
        stager = self._stager_for(threads, task_size) if self.cuda else None
        start = time.perf_counter()
        for i, offset in enumerate(range(0, self.size, self.chunk)):
            n = min(self.chunk, self.size - offset)
            if stager is not None:
                got = stager.read(
                    self.path,
                    None,
                    [offset],
                    [n],
                    self.device_buf[offset : offset + n],
                    stream=self.stream.cuda_stream,
                    num_threads=threads,
                    task_size=task_size,
                )
            else:
                got = engine.read_ranges(
                    self.path, None, [offset], [n], self.host[i % 2], num_threads=threads, task_size=task_size
                )
            if got != n:
                raise RuntimeError(f"read {got} of {n} bytes at offset {offset} of {self.path}")
        if self.cuda:
            self.stream.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def recommend(cells: list[dict]) -> dict:
    """The fastest cell; among cells within 5% of it, the fewest threads, then the smallest task
    (fewer threads leave cores to the training process; the difference is noise)."""
    best = max(cells, key=lambda c: c["gbps"])
    near = [c for c in cells if c["gbps"] >= NEAR_BEST * best["gbps"]]
    pick = min(near, key=lambda c: (c["threads"], c["task_size"]))
    return {
        "threads": pick["threads"],
        "task_size": pick["task_size"],
        "gbps": pick["gbps"],
        "best": {"threads": best["threads"], "task_size": best["task_size"], "gbps": best["gbps"]},
    }


def sweep(
    path: str, size: int, threads: list[int], task_sizes: list[int], min_seconds: float, progress: bool = True
) -> dict:
    """Hot-cache rate of each threads x task size: the engine's own ceiling on this machine,
    which is what io_threads / io_task_size should be set to reach."""
    if not os.path.exists(path) or os.path.getsize(path) != size:
        raise RuntimeError("the test file was not written (see the storage section)")
    cuda = torch.cuda.is_available()
    runner = _FilePass(path, size, cuda)
    runner.run(max(threads), min(task_sizes))  # bring the whole file into the page cache
    cells, grid = [], [[None] * len(task_sizes) for _ in threads]
    bar = Progress(len(threads) * len(task_sizes), "sweep", enabled=progress)
    try:
        for r, t in enumerate(threads):
            for c, task in enumerate(task_sizes):
                runner.run(t, task)  # warm-up: the engine's pool grows to t threads
                rates, spent = [], 0.0
                while len(rates) < 3 or spent < min_seconds:
                    seconds = runner.run(t, task)
                    spent += seconds
                    rates.append(_gbps(size, seconds))
                gbps = statistics.median(rates)
                grid[r][c] = gbps
                cells.append({"threads": t, "task_size": task, "gbps": gbps, "passes": len(rates)})
                bar.update(1, note=f"{t} x {_size_text(task)}: {gbps:.2f} GB/s")
    finally:
        bar.close()
        runner.close()
        del runner
        if cuda:
            torch.cuda.empty_cache()
    chunk = _size_text(min(CHUNK, size))
    what = (
        f"file -> GPU: the engine's device path (pinned ring of io_threads + io_threads/4 chunks of the "
        f"task size, H2D per task), {chunk} per call"
        if cuda
        else f"file -> host memory: {chunk} reads into 2 alternating buffers"
    )
    return {
        "what": what,
        "to_gpu": cuda,
        "size": size,
        "chunk": min(CHUNK, size),
        "threads": threads,
        "task_sizes": task_sizes,
        "gbps": grid,
        "cells": cells,
        "recommended": recommend(cells),
    }


# --------------------------------------------------------------------------------------------
# 6. saving
# --------------------------------------------------------------------------------------------
def save_tuning(recommended: dict, measured: dict) -> dict:
    """Record the recommended setting where ``config`` looks for it, and say what is now in effect."""
    path = Path(config.tuning_file())
    path.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    write_json(
        path,
        {
            "settings": {"io_threads": recommended["threads"], "io_task_size": recommended["task_size"]},
            "measured": measured,
            "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
            "machine": machine_info(cuda),
        },
    )
    return {
        "path": str(path),
        "in_effect": {
            name: {"value": config.get(name), "source": config.source(name)} for name in ("io_threads", "io_task_size")
        },
    }


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def _render_gpu(r: dict) -> str:
    lines = []
    if r["gpus"]:
        rows = [
            [
                i,
                g["name"],
                fmt(g["memory_mib"] and g["memory_mib"] / 1024, ".1f") + " GiB",
                g["driver"],
                f"Gen{g['pcie_gen_current']} x{g['pcie_width_current']}",
                f"Gen{g['pcie_gen_max']} x{g['pcie_width_max']}",
                fmt(g["pcie_max_gbps"], ".1f"),
            ]
            for i, g in enumerate(r["gpus"])
        ]
        lines.append(table(["#", "name", "memory", "driver", "PCIe now", "PCIe max", "link GB/s"], rows))
        lines.append(
            f"(from {r['source']}; link GB/s: the max link's payload rate per direction. "
            "An idle GPU lowers its link generation; it rises under load.)"
        )
    if r["cuda"]:
        lines.append(f"measuring on cuda:{r['device']['index']} ({r['device']['name']})")
    else:
        lines.append(f"no CUDA device: {r['reason']}; GPU measurements skipped")
    return "\n".join(lines)


def _render_h2d(r: dict, link: dict | None) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    ceiling = link and link.get("pcie_max_gbps")
    rows = []
    for kind in ("pinned", "pageable"):
        m = r[kind]
        share = f"{100 * m['gbps'] / ceiling:.0f}%" if ceiling else "-"
        rows.append([kind, fmt(m["gbps"]), fmt(min(m["samples_gbps"])), fmt(max(m["samples_gbps"])), share])
    return (
        table(["source memory", "GB/s (median)", "min", "max", "of link"], rows)
        + f"\n({_size_text(r['bytes'])} copies, CUDA events, median of {r['reps']} after warm-up)"
    )


def _render_gds(r: dict) -> str:
    rows = [
        ("kvikio", r["kvikio_version"] or "not installed"),
        ("compat mode", r["compat_mode"] or "-"),
        ("GDS available", "yes" if r["available"] else "no"),
    ]
    rows += [("why not" if i == 0 else "", why) for i, why in enumerate(r["reasons"])]
    rows += [("kvikio printed" if i == 0 else "", text) for i, text in enumerate(r.get("kvikio_printed", []))]
    rows.append((f"io_mode='auto' on {r['device']}", r["auto_path"]))
    return _kv(rows, indent="")


def _render_storage(r: dict) -> str:
    fs = r["filesystem"]
    disk = fs.get("disk") or {}
    device = fs["block_device"] or f"none ({fs['mount_source']})"
    if disk:
        kind = {True: "rotational per sysfs", False: "non-rotational", None: None}[disk.get("rotational")]
        extra = ", ".join(x for x in (disk.get("model"), kind) if x)
        device += f" ({extra})" if extra else ""
    head = _kv(
        [
            ("directory", fs["dir"]),
            ("filesystem", f"{fs['fstype']} mounted at {fs['mount_point']}"),
            ("block device", device),
            ("test file", f"{_size_text(r['size'])}, random bytes, fsynced"),
        ],
        "",
    )
    hot = r["hot"]["gbps"]
    rows, notes = [["write + fsync", fmt(r["write"]["gbps"]), "-"]], []
    for key, label in (
        ("cold_odirect", "cold read, O_DIRECT"),
        ("cold_buffered", "cold read, buffered (after FADV_DONTNEED)"),
        ("hot", "hot read (page cache)"),
    ):
        m = r[key]
        if "skipped" in m:
            rows.append([label, "skipped", "-"])
            notes.append(f"{label}: skipped: {m['skipped']}")
        else:
            rows.append([label, fmt(m["gbps"]), f"{m['gbps'] / hot:.2f}x"])
    notes.append(
        f"reads: the C++ engine, {r['threads']} threads x {_size_text(r['task_size'])} tasks, one call "
        "for the whole file."
    )
    notes.append("A cold rate near the hot one: the cache drop did not take effect, or storage is as fast as memory.")
    return head + "\n\n" + table(["", "GB/s", "vs hot"], rows) + "\n" + "\n".join(notes)


def _render_sweep(r: dict) -> str:
    rec = r["recommended"]
    headers = ["threads"] + [_size_text(s) + " " for s in r["task_sizes"]]  # " ": room for the "*"
    rows = []
    for t, line in zip(r["threads"], r["gbps"]):
        rows.append(
            [t]
            + [
                fmt(v) + ("*" if (t, s) == (rec["threads"], rec["task_size"]) else " ")
                for s, v in zip(r["task_sizes"], line)
            ]
        )
    best = rec["best"]
    lines = [
        f"{r['what']}; {_size_text(r['size'])} file; GB/s (median of passes), columns: task size",
        table(headers, rows),
        f"recommended: io_threads={rec['threads']}, io_task_size={_size_text(rec['task_size'])} "
        f"({rec['gbps']:.2f} GB/s; fastest {best['gbps']:.2f} GB/s at {best['threads']} x "
        f"{_size_text(best['task_size'])}; within {100 * (1 - NEAR_BEST):.0f}% of it fewer threads, "
        "then smaller tasks win)",
    ]
    now = ", ".join(
        f"{n}={config.get(n) if n == 'io_threads' else _size_text(config.get(n))} ({config.source(n)})"
        for n in ("io_threads", "io_task_size")
    )
    lines.append(f"in effect now: {now}")
    return "\n".join(lines)


def _render_saved(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    lines = [f"wrote {r['path']}"]
    for name, m in r["in_effect"].items():
        value = _size_text(m["value"]) if name == "io_task_size" else m["value"]
        why = {"tuning file": "the loader now uses it"}.get(
            m["source"], f"the tuning file is shadowed by {m['source']}"
        )
        lines.append(f"  config.get({name!r}) = {value}; config.source({name!r}) = {m['source']!r}: {why}")
    return "\n".join(lines)


def render(name: str, result: dict, results: dict | None = None) -> None:
    """Print one section: its title, then its table, or ``<section>: failed: <error>``."""
    title = SECTIONS.get(name, name)
    log(f"\n== {title} ==")
    if "error" in result:
        log(f"{name}: failed: {result['error']}")
        return
    results = results or {}
    text = {
        "gpu": lambda: _render_gpu(result),
        "h2d": lambda: _render_h2d(result, _link_for(results.get("gpu", {}))),
        "gds": lambda: _render_gds(result),
        "storage": lambda: _render_storage(result),
        "sweep": lambda: _render_sweep(result),
        "save": lambda: _render_saved(result),
    }[name]
    try:
        log(text())
    except Exception as exc:  # a rendering bug must not end the report either
        log(f"{name}: failed: {error_text(exc)}")


def _section(name: str, fn: Callable[..., dict], *args, **kwargs) -> dict:
    """``fn(*args)``, or ``{"error": "Type: message"}``: one section never ends the report."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return {"error": error_text(exc)}


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "python -m torch_fastload doctor",
        description="Measure this machine's input path (GPU link, H2D copies, GDS, storage, the C++ "
        "engine's threads x task size) and recommend io_threads / io_task_size. "
        "Defaults in [brackets] are full / --quick.",
    )
    p.add_argument(
        "--dir",
        default=".",
        help="directory whose filesystem to test; a temporary file is written there and deleted [.]",
    )
    p.add_argument("--size", type=size_arg, default=None, help="test file size, e.g. 512M, 1GiB [1GiB / 256MiB]")
    p.add_argument("--h2d-size", type=size_arg, default=None, help="bytes per H2D copy [256MiB / 64MiB]")
    p.add_argument(
        "--threads",
        type=positive_int_list,
        default=None,
        help="sweep thread counts, comma-separated [1,2,4,8,16,32 / 1,4,16]",
    )
    p.add_argument(
        "--tasks", type=size_list, default=None, help="sweep task sizes, comma-separated [256K,1M,4M,16M / 1M,4M]"
    )
    p.add_argument("--quick", action="store_true", help="smaller file, copies and sweep")
    p.add_argument(
        "--save",
        action="store_true",
        help=f"write the recommended io_threads / io_task_size to the tuning file "
        f"(TORCH_FASTLOAD_TUNING_FILE, now {config.tuning_file()})",
    )
    p.add_argument(
        "--url",
        default=None,
        help="time remote reads of this s3:// or http(s):// object instead (concurrency x request size) "
        "and recommend remote_concurrency / remote_request_size",
    )
    p.add_argument("--json", type=Path, default=None, help="write every measurement here")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
        if not os.path.isdir(args.dir):
            parser.error(f"--dir {args.dir!r} is not a directory")
        if any(t > engine.MAX_THREADS for t in args.threads or []):
            parser.error(f"--threads must be at most {engine.MAX_THREADS}, got {args.threads}")
    except SystemExit as exc:  # argparse: 2 for bad arguments, 0 for --help
        return int(exc.code or 0)
    if args.url:  # the remote sweep only (torch_fastload/remote/sweep.py)
        from torch_fastload.remote import sweep as remote_sweep

        return remote_sweep.run(args.url, quick=args.quick, json_path=args.json, do_save=args.save)
    size = args.size or (256 * MiB if args.quick else GiB)
    h2d_size = args.h2d_size or (64 * MiB if args.quick else 256 * MiB)
    threads = args.threads or ([1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32])
    tasks = args.tasks or ([MiB, 4 * MiB] if args.quick else [256 * KiB, MiB, 4 * MiB, 16 * MiB])

    log(
        f"torch_fastload doctor: torch {torch.__version__}, engine "
        f"{'built' if engine.available() else 'NOT built'}, {os.cpu_count()} CPUs"
    )
    results: dict = {}
    results["gpu"] = _section("gpu", gpu_info)
    render("gpu", results["gpu"], results)
    results["h2d"] = _section("h2d", measure_h2d, h2d_size)
    render("h2d", results["h2d"], results)
    results["gds"] = _section("gds", gds_info)
    render("gds", results["gds"], results)

    fd, path = tempfile.mkstemp(prefix=".torch_fastload_doctor-", suffix=".bin", dir=args.dir)
    os.close(fd)
    try:
        results["storage"] = _section("storage", measure_storage, path, size)
        render("storage", results["storage"], results)
        min_seconds = 0.1 if args.quick else 0.3
        results["sweep"] = _section("sweep", sweep, path, size, threads, tasks, min_seconds, args.progress)
        render("sweep", results["sweep"], results)
    finally:
        os.unlink(path)

    if args.save:
        rec = results["sweep"].get("recommended")
        results["save"] = (
            _section("save", save_tuning, rec, {k: v for k, v in results.items() if k != "save"})
            if rec
            else {"skipped": "the sweep failed, so there is nothing to record"}
        )
        render("save", results["save"], results)
    if args.json:
        try:
            write_json(
                args.json,
                {
                    **results,
                    "machine": machine_info(torch.cuda.is_available()),
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                },
            )
            log(f"\nwrote {args.json}")
        except Exception as exc:
            log(f"\njson: failed: {error_text(exc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
