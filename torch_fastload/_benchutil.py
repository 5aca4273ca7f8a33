"""Helpers shared by the benchmark scripts (``python -m torch_fastload.bench``,
``benchmarks/overlap.py``, ``benchmarks/pin_memory.py``). Private: no API promise."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import torch

try:  # progress bars are optional
    from tqdm import tqdm as _tqdm
except Exception:  # pragma: no cover - tqdm missing
    _tqdm = None

__all__ = [
    "log",
    "error_text",
    "fmt",
    "table",
    "Progress",
    "write_json",
    "int_list",
    "positive_int_list",
    "float_list",
    "size_arg",
    "size_list",
    "run_quiet",
    "cpu_affinity",
    "machine_basics",
    "git_state",
    "machine_info",
    "cpu_seconds",
    "sync",
    "h2d_copy_seconds",
    "drop_page_cache",
    "InflightWindow",
]

GiB = 1 << 30


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def log(msg: str = "") -> None:
    """Print and flush (progress bars share the terminal)."""
    print(msg, flush=True)


def error_text(exc: BaseException) -> str:
    """``"TypeName: message"``."""
    return f"{type(exc).__name__}: {exc}"


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    """``format(value, spec)``; ``missing`` for None, NaN and infinities."""
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return missing
    return format(value, spec)


def table(headers: list, rows: list, title: str | None = None, first_left: bool = True) -> str:
    """A right-aligned plain-text table (the first column left-aligned if ``first_left``)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(str(h)) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(items):
        return "  ".join(
            str(c).ljust(w) if (i == 0 and first_left) else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(items, widths))
        )

    out = [title] if title else []
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


class Progress:
    """A tqdm bar on stderr when tqdm is importable and wanted; otherwise nothing."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.bar = (
            _tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True, mininterval=0.25)
            if (enabled and _tqdm is not None)
            else None
        )

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Advance by ``n``; ``note`` replaces the bar's postfix text."""
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON, written to a temporary file and renamed: never half a file."""
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# argparse types: comma-separated lists
# --------------------------------------------------------------------------------------------
def _number_list(text: str, cast, noun: str, minimum, bound: str) -> list:
    try:
        values = [cast(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(f"expected {bound}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """'0,4,8': integers >= 0."""
    return _number_list(text, int, "integers", 0, "integers >= 0")


def positive_int_list(text: str) -> list[int]:
    """'1,2,4': integers >= 1."""
    return _number_list(text, int, "integers", 1, "positive integers")


def float_list(text: str) -> list[float]:
    """'0,1.5,2': numbers >= 0."""
    return _number_list(text, float, "numbers", 0, "numbers >= 0")


def size_arg(text: str) -> int:
    """'4194304', '4M', '4MiB', '256KiB': a positive byte count (torch_fastload.config.parse_size)."""
    from .config import parse_size

    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 512M, 4MiB or 1GiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """'1MiB,4MiB,16MiB': positive byte counts."""
    values = [size_arg(v) for v in str(text).split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated byte counts, got {text!r}")
    return values


# --------------------------------------------------------------------------------------------
# where and when a benchmark ran
# --------------------------------------------------------------------------------------------
def run_quiet(cmd: list, timeout: float = 10.0) -> str | None:
    """The command's stripped stdout, or None if it fails or cannot run."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return res.stdout.strip() if res.returncode == 0 else None
    except Exception:
        return None


def cpu_affinity() -> int | None:
    """CPUs this process may run on (None where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def machine_basics() -> dict:
    """Date, command line, host, platform, and the Python and torch versions."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command_line": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda_build": getattr(torch.version, "cuda", None),
    }


def git_state(repo: Path) -> dict:
    """``git_commit`` (short hash) and ``git_dirty`` of the checkout at ``repo`` (None: no git)."""
    commit = run_quiet(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = run_quiet(["git", "-C", str(repo), "status", "--porcelain"])
    return {"git_commit": commit, "git_dirty": None if dirty is None else bool(dirty)}


def machine_info(use_cuda: bool) -> dict:
    """Where and when this ran: enough to compare two JSON files later."""
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
            mem_gib = round(kb * 1024 / GiB, 1)
    except (OSError, StopIteration, ValueError):
        pass
    info = {
        **machine_basics(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": cpu_affinity(),
        "torch_num_threads": torch.get_num_threads(),
        "mem_total_gib": mem_gib,
        "cuda_available": torch.cuda.is_available(),
        "torch_fastload_path": str(Path(__file__).resolve().parent),
        **git_state(Path(__file__).resolve().parents[1]),
    }
    try:
        import torch_fastload.staging as staging

        info["stage_copier"] = "native C++ copy_ranges" if staging._native_copy is not None else "numpy threads"
    except Exception as exc:  # pragma: no cover - diagnostics only
        info["stage_copier"] = f"unknown ({type(exc).__name__})"
    if use_cuda:
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        info["gpu"] = {
            "index": dev,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_memory_gib": round(props.total_memory / GiB, 1),
            "multiprocessors": getattr(props, "multi_processor_count", None),
        }
        info["nvidia_smi"] = run_quiet(
            [
                "nvidia-smi",
                f"--id={dev}",
                "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.max.sm",
                "--format=csv,noheader",
            ]
        )
    return info


# --------------------------------------------------------------------------------------------
# measuring a loop
# --------------------------------------------------------------------------------------------
def _proc_children_cpu(pid: int) -> float:
    """CPU seconds of the live descendants of ``pid``, read from /proc (psutil's fallback)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        try:
            parents[int(name)] = int(fields[1])
            times[int(name)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (IndexError, ValueError):
            continue
    total, frontier = 0.0, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                total += times.get(child, 0.0)
                frontier.append(child)
    return total


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads, ns resolution) and of its live
    descendants (torch worker processes; clock-tick resolution, via psutil or /proc)."""
    total = time.process_time()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
    except ImportError:
        total += _proc_children_cpu(os.getpid())
    return total


def h2d_copy_seconds(src: torch.Tensor, dst: torch.Tensor, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``reps`` ``dst.copy_(src, non_blocking=True)`` host -> device copies,
    timed with CUDA events after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def gemm_seconds(a: torch.Tensor, b: torch.Tensor, warmup: int, reps: int = 20) -> float:
    """Seconds per ``a @ b`` on the GPU, timed with CUDA events after ``warmup`` untimed calls
    (cuBLAS heuristics and clocks settle): how benchmarks calibrate a stand-in training step."""
    for _ in range(warmup):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def drop_page_cache(path, offset: int = 0, length: int = 0) -> None:
    """Evict a file's pages (``length`` 0: to its end) from the page cache, so the next read
    comes from storage. fsync first: posix_fadvise(DONTNEED) drops clean pages only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class InflightWindow:
    """Lets the host run at most ``depth`` steps ahead of the GPU, as a real loop does when it
    reads a loss a few steps late. Waits by polling (a spinning ``Event.synchronize()`` would
    burn a core and pollute CPU-time measurements)."""

    def __init__(self, device: torch.device, depth: int):
        self.cuda = device.type == "cuda"
        self.depth = max(1, depth)
        self.events: deque = deque()

    def step_done(self) -> None:
        if not self.cuda:
            return
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)
        while len(self.events) > self.depth:
            oldest = self.events.popleft()
            while not oldest.query():
                time.sleep(2e-5)

    def drain(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.events.clear()


def warm_page_cache(paths) -> None:
    """Read files once so the page cache holds them (benchmarks that start hot say so)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("  (matplotlib missing: no plot)")
        return None
    return plt


def fsync_file(path) -> None:
    """Flush a written file to storage (before its pages are dropped or timed cold)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
