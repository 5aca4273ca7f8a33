"""Where and when a benchmark ran, and how much CPU it used."""

from __future__ import annotations

import datetime
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from .output import GiB

_PACKAGE = Path(__file__).resolve().parents[1]


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


def _first_field(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(prefix)), None)
    except OSError:
        return None


def machine_info(use_cuda: bool) -> dict:
    """Where and when this ran: enough to compare two JSON files later."""
    mem = _first_field("/proc/meminfo", "MemTotal")
    info = {
        **machine_basics(),
        "numpy": _numpy_version(),
        "cpu_model": _first_field("/proc/cpuinfo", "model name"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": cpu_affinity(),
        "torch_num_threads": torch.get_num_threads(),
        "mem_total_gib": round(int(mem.split()[0]) * 1024 / GiB, 1) if mem else None,
        "cuda_available": torch.cuda.is_available(),
        "torch_fastload_path": str(_PACKAGE),
        **git_state(_PACKAGE.parent),
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
            "device_count": torch.cuda.device_count(),
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


def _numpy_version() -> str | None:
    try:
        import numpy

        return numpy.__version__
    except ImportError:  # pragma: no cover
        return None


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


def cpu_seconds(reaped: bool = False) -> float:
    """User + system CPU seconds of this process (all threads, ns resolution) and of its live
    descendants (torch worker processes; clock-tick resolution, via psutil or /proc). With
    ``reaped``, also of its reaped children: workers that exit at an epoch's end take their
    time out of a /proc walk but add it to RUSAGE_CHILDREN."""
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
    if reaped:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += children.ru_utime + children.ru_stime
    return total
