"""Where the time went: input-wait in ``next()``, per-stage times, bytes and GB/s per path."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

__all__ = ["CopyTimer", "LoaderStats", "StatsSnapshot", "STAGES"]

#: Pipeline stages timed per batch: per-sample Python / worker hand-over, file reads (into the
#: slot, or into device memory on the GDS path), pageable -> slot memcpy, the slot -> device
#: copy (timed with CUDA events on the GPU path), and a source's finishing step (image decode
#: and augmentation; host wall time of the stage thread).
STAGES = ("fetch", "read", "stage", "copy", "decode")


@dataclass(frozen=True)
class StatsSnapshot:
    path: str
    batches: int
    samples: int
    bytes: int
    wall_s: float
    wait_s: float
    stage_s: dict = field(default_factory=dict)
    stage_bytes: dict = field(default_factory=dict)
    pool_slots: int = 0
    pool_slot_bytes: int = 0
    pool_regrows: int = 0
    errors: int = 0
    io: str = ""  # the file-read path in effect (io.IoPath), empty until a source reads a file
    io_bytes: dict = field(default_factory=dict)  # bytes read by each path (mapped, engine-posix, ...)
    decoded: dict = field(default_factory=dict)  # images per decode route (nvjpeg, cpu:cmyk, ...), skipped

    @property
    def wait_fraction(self) -> float:
        """Share of the loop's wall time spent blocked in ``next()``."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def gbps(self) -> float:
        """Bytes delivered per wall second (decimal GB/s)."""
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def pool_bytes(self) -> int:
        return self.pool_slots * self.pool_slot_bytes

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def stage_gbps(self, stage: str) -> float:
        seconds = self.stage_s.get(stage, 0.0)
        return self.stage_bytes.get(stage, 0) / seconds / 1e9 if seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            pool_bytes=self.pool_bytes,
            wait_fraction=self.wait_fraction,
            gbps=self.gbps,
            samples_per_s=self.samples_per_s,
            stage_gbps={stage: self.stage_gbps(stage) for stage in STAGES},
        )
        return out

    def __str__(self) -> str:
        lines = [
            f"torch_fastload stats  path={self.path}"
            + (f"\n  file reads: {self.io}" if self.io else "")
            + ("".join(f"\n    {kind}: {n / 1e9:.3f} GB" for kind, n in self.io_bytes.items())),
            f"  batches {self.batches}  samples {self.samples}  bytes {self.bytes / 1e9:.3f} GB"
            f"  wall {self.wall_s:.3f} s  ->  {self.samples_per_s:,.0f} samples/s, {self.gbps:.2f} GB/s",
            f"  input wait {self.wait_s:.3f} s = {100 * self.wait_fraction:.1f}% of wall time",
            f"  {'stage':<6} {'busy s':>9} {'ms/batch':>9} {'GB/s':>8}",
        ]
        for stage in STAGES:
            seconds = self.stage_s.get(stage, 0.0)
            per_batch = 1e3 * seconds / self.batches if self.batches else 0.0
            lines.append(f"  {stage:<6} {seconds:>9.3f} {per_batch:>9.2f} {self.stage_gbps(stage):>8.2f}")
        if self.decoded:
            lines.append("  images: " + ", ".join(f"{route} {n}" for route, n in sorted(self.decoded.items())))
        lines.append(
            f"  pool: {self.pool_slots} slots x {self.pool_slot_bytes / 2**20:.2f} MiB"
            f" = {self.pool_bytes / 2**20:.1f} MiB, regrows {self.pool_regrows}, batch errors {self.errors}"
        )
        return "\n".join(lines)


class LoaderStats:
    """Thread-safe accumulators written by the pipeline threads and the consumer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.path = "idle"
        # TORCH_FASTLOAD_TRACE=1: (stage, batch number, start, end) of every fetch, stage and
        # next(), perf_counter seconds, for a timeline of where a batch waited (trace()).
        self.trace: list | None = [] if os.environ.get("TORCH_FASTLOAD_TRACE", "") not in ("", "0") else None
        self.pool_slots = 0
        self.pool_slot_bytes = 0
        self.pool_regrows = 0
        self.io = ""
        self.reset()

    def reset(self) -> None:
        """Zero the counters; the path in effect and the pool's size stay (they describe state)."""
        with self._lock:
            self.batches = 0
            self.samples = 0
            self.bytes = 0
            self.wait_s = 0.0
            self.errors = 0
            self.stage_s = {stage: 0.0 for stage in STAGES}
            self.stage_bytes = {stage: 0 for stage in STAGES}
            self.io_bytes = {}
            self.decoded = {}
            self._first_request: float | None = None
            self._last_return: float | None = None

    def add_stage(self, stage: str, seconds: float, nbytes: int = 0, number: int | None = None) -> None:
        with self._lock:
            self.stage_s[stage] += seconds
            self.stage_bytes[stage] += nbytes
            if self.trace is not None and number is not None:
                end = time.perf_counter()
                self.trace.append((stage, number, end - seconds, end))

    def mark(self, stage: str, number: int, started: float) -> None:
        """Trace a span from ``started`` to now (only with TORCH_FASTLOAD_TRACE set)."""
        if self.trace is not None:
            with self._lock:
                self.trace.append((stage, number, started, time.perf_counter()))

    def add_error(self) -> None:
        with self._lock:
            self.errors += 1

    def set_pool(self, slots: int, slot_bytes: int, regrew: bool = False) -> None:
        with self._lock:
            self.pool_slots = slots
            self.pool_slot_bytes = slot_bytes
            self.pool_regrows += int(regrew)

    def set_io(self, description: str) -> None:
        with self._lock:
            self.io = description

    def add_io(self, moved: dict) -> None:
        with self._lock:
            for kind, nbytes in moved.items():
                self.io_bytes[kind] = self.io_bytes.get(kind, 0) + nbytes

    def add_decoded(self, counts: dict) -> None:
        with self._lock:
            for route, n in counts.items():
                self.decoded[route] = self.decoded.get(route, 0) + n

    def request_started(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self._first_request is None:
                self._first_request = now
        return now

    def delivered(self, started: float, samples: int, nbytes: int, number: int | None = None) -> None:
        """The consumer got a batch: count the time it waited for it."""
        now = time.perf_counter()
        with self._lock:
            if self.trace is not None:
                self.trace.append(("next", number, started, now))
            self.wait_s += now - started
            self.batches += 1
            self.samples += samples
            self.bytes += nbytes
            self._last_return = now

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            wall = 0.0
            if self._first_request is not None and self._last_return is not None:
                wall = self._last_return - self._first_request
            return StatsSnapshot(
                path=self.path,
                batches=self.batches,
                samples=self.samples,
                bytes=self.bytes,
                wall_s=wall,
                wait_s=self.wait_s,
                stage_s=dict(self.stage_s),
                stage_bytes=dict(self.stage_bytes),
                pool_slots=self.pool_slots,
                pool_slot_bytes=self.pool_slot_bytes,
                pool_regrows=self.pool_regrows,
                errors=self.errors,
                io=self.io,
                io_bytes=dict(self.io_bytes),
                decoded=dict(self.decoded),
            )


class CopyTimer:
    """Copy durations, counted once their CUDA events have completed and never waited for:
    an epoch ends without a host synchronize, and its last copies are counted later (by the
    next epoch's stage threads or ``DataLoader.stats()``)."""

    def __init__(self, stats: LoaderStats) -> None:
        self._stats = stats
        self._pending: deque = deque()  # (InFlightCopy, bytes), in issue order
        self._lock = threading.Lock()

    def add(self, copy, nbytes: int) -> None:
        with self._lock:
            self._pending.append((copy, nbytes))
        self.count()

    def count(self) -> None:
        with self._lock:
            while self._pending:
                copy, nbytes = self._pending[0]
                seconds = copy.copy_seconds()
                if seconds is None:
                    return
                self._pending.popleft()
                self._stats.add_stage("copy", seconds, nbytes)
