"""What the doctor's sections share: units, the sweep's constants, small formatting helpers."""

from __future__ import annotations

import time
from typing import Any

from torch_fastload import engine

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CHUNK = 64 * MiB  # bytes per read call in the sweep (a large batch) and per write of the test file
NEAR_BEST = 0.95  # cells within 5% of the fastest count as equally fast
STORAGE_THREADS, STORAGE_TASK = 16, 4 * MiB


def size_text(n: int) -> str:
    """4194304 -> '4 MiB' (exact binary units where they divide, else bytes)."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n} B"


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, as storage and PCIe are quoted."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def key_values(rows: list[tuple[str, Any]], indent: str = "  ") -> str:
    """``key   value`` lines with the values aligned."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{indent}{k:<{width}}  {v}" for k, v in rows)


def error_text(exc: BaseException) -> str:
    """'Type: message', as a failed section reports it."""
    return f"{type(exc).__name__}: {exc}"


def read_file(path: str, size: int, dst, threads: int, task_size: int, o_direct: bool = False) -> float:
    """Seconds to read the whole file into ``dst`` with one engine call."""
    start = time.perf_counter()
    got = engine.read_ranges(path, None, [0], [size], dst, num_threads=threads, task_size=task_size, o_direct=o_direct)
    seconds = time.perf_counter() - start
    if got != size:
        raise RuntimeError(f"read {got} bytes of {path}, expected {size}")
    return seconds
