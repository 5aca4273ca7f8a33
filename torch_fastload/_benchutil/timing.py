"""Timing on the GPU: copies and GEMMs under CUDA events, a calibrated busy kernel, a bounded
launch queue."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque

import torch


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_copy_seconds(src: torch.Tensor, dst: torch.Tensor, reps: int, warmup: int = 2, inner: int = 1) -> list[float]:
    """Seconds of each of ``reps`` samples of ``inner`` back-to-back ``dst.copy_(src,
    non_blocking=True)`` copies, timed with CUDA events after ``warmup`` untimed samples."""
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
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


class CudaSleeper:
    """A GPU busy kernel of a chosen length: ``torch.cuda._sleep(cycles)``, calibrated by timing
    with CUDA events (the SM clock moves, so cycles per ms is measured, not looked up)."""

    def __init__(self):
        self.available = hasattr(torch.cuda, "_sleep")
        self.cycles_per_ms: float | None = None
        self.offset_ms = 0.0
        self.error = None if self.available else "torch.cuda._sleep is missing in this torch"

    def _time(self, cycles: int, reps: int = 5) -> float:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(int(cycles))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))  # ms
        return statistics.median(times)

    def calibrate(self) -> dict:
        if not self.available:
            return {"available": False, "error": self.error}
        deadline = time.perf_counter() + 0.2  # let the SM clock leave its idle state
        while time.perf_counter() < deadline:
            torch.cuda._sleep(1_000_000)
            torch.cuda.synchronize()
        c1, c2 = 1_000_000, 5_000_000
        t1, t2 = self._time(c1), self._time(c2)
        if t2 <= t1:
            self.available = False
            self.error = f"torch.cuda._sleep did not scale ({c1}: {t1:.3f} ms, {c2}: {t2:.3f} ms)"
            return {"available": False, "error": self.error}
        self.cycles_per_ms = (c2 - c1) / (t2 - t1)
        self.offset_ms = max(0.0, t1 - c1 / self.cycles_per_ms)
        return {"available": True, "cycles_per_ms": self.cycles_per_ms, "offset_ms": self.offset_ms}

    def cycles(self, ms: float) -> int:
        """Cycles that keep the GPU busy for ``ms`` (0 where uncalibrated or ``ms`` <= 0)."""
        if not self.cycles_per_ms or ms <= 0:
            return 0
        return max(0, int((ms - self.offset_ms) * self.cycles_per_ms))

    def sleep_ms(self, ms: float) -> None:
        cycles = self.cycles(ms)
        if cycles > 0:
            torch.cuda._sleep(cycles)

    def measure_ms(self, ms: float) -> float | None:
        """What a sleep of ``ms`` takes now (the SM clock can move during a run)."""
        cycles = self.cycles(ms)
        return self._time(cycles) if cycles > 0 else None


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


class ThreadCpu:
    """CPU seconds and involuntary context switches of this process's threads between two
    ``snapshot()`` calls, grouped by the Python thread name without its ``_N`` suffix; the
    process's other CPU time (pyarrow's and the C++ engine's pools, CUDA's threads) is
    ``native``. Says where a pipeline's cores go and which threads are preempted while they
    hold the GIL. Context switches come from ``/proc`` (Linux; ``None`` where unreadable)."""

    def __init__(self):
        self.before: dict = {}
        self.process_before = 0.0

    @staticmethod
    def _read() -> dict:
        import re
        import threading

        out = {}
        for t in threading.enumerate():
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (AttributeError, OSError, TypeError):  # ended, or not on this platform
                continue
            preempted = None
            try:
                with open(f"/proc/self/task/{t.native_id}/status") as f:
                    for line in f:
                        if line.startswith("nonvoluntary_ctxt_switches:"):
                            preempted = int(line.split(":", 1)[1])
            except (OSError, ValueError):
                pass
            out[t.native_id] = (re.sub(r"_\d+$", "", t.name), cpu, preempted)
        return out

    def snapshot(self) -> None:
        self.before = self._read()
        self.process_before = time.process_time()

    def since(self) -> dict:
        """``{group: {"cpu_s", "preempted", "threads"}}`` since ``snapshot()``."""
        groups: dict = {}
        python = 0.0
        for tid, (name, cpu, preempted) in self._read().items():
            _, cpu0, preempted0 = self.before.get(tid, (name, 0.0, 0))
            group = groups.setdefault(name, {"cpu_s": 0.0, "preempted": 0, "threads": 0})
            group["cpu_s"] += cpu - cpu0
            python += cpu - cpu0
            if preempted is None or group["preempted"] is None:
                group["preempted"] = None
            else:
                group["preempted"] += preempted - (preempted0 or 0)
            group["threads"] += 1
        native = time.process_time() - self.process_before - python
        groups["native"] = {"cpu_s": max(0.0, native), "preempted": None, "threads": None}
        return groups
