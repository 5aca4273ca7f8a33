"""The GPU side of the input path: which GPUs and links (``gpu_info``), host -> device copy
rates (``measure_h2d``), and whether GPUDirect Storage can run here (``gds_info``)."""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from typing import Any, Callable

import torch

from torch_fastload import io
from torch_fastload._benchutil import run_quiet

from .common import MiB, error_text, gbps

__all__ = ["gpu_info", "link_for", "measure_h2d", "gds_info", "PCIE_LANE_GBPS"]

# PCIe payload GB/s per lane and direction after line encoding (8b/10b to Gen2, 128b/130b from
# Gen3, FLIT from Gen6): the spec's ceiling, to judge the measured H2D rate against.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


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


def link_for(gpu: dict) -> dict | None:
    """The NVML / nvidia-smi entry of the device the copies ran on (by name; index order may differ)."""
    name = (gpu.get("device") or {}).get("name")
    matches = [g for g in gpu.get("gpus", []) if g["name"] == name] or gpu.get("gpus", [])
    return matches[0] if matches else None


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
            rates = [gbps(nbytes, seconds) for seconds in _copy_seconds(src, dst, reps)]
            result[kind] = {"gbps": statistics.median(rates), "samples_gbps": rates}
    finally:
        del dst, sources
        torch.cuda.empty_cache()
    return result


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


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``reps`` ``dst.copy_(src, non_blocking=True)`` copies, timed with CUDA
    events after ``warmup`` untimed ones."""
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
