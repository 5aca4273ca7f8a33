"""``doctor --url URL``: the remote reader's concurrency x request size on one object, timed,
and the setting to use (``remote_concurrency`` / ``remote_request_size``).

Each cell reads the object's first ``span`` bytes as one batch (as a loader would), again
until ``min_seconds`` have passed, with a fresh reader (its connections opened in a warm-up
read). Among the cells within 5% of the fastest the fewest requests in flight win, then the
smallest request (fewer connections and less memory for the same rate).
"""

from __future__ import annotations

import datetime
import json
import os
import time

import numpy as np
import torch

from .. import config, fileio
from .objects import open_object
from .reader import RemoteReader

__all__ = ["sweep", "recommend", "render", "save", "run"]

MiB = 1 << 20
NEAR_BEST = 0.95
FULL = {"concurrency": [4, 16, 64, 128], "request_sizes": [MiB, 4 * MiB, 16 * MiB, 64 * MiB], "span": 1 << 30}
QUICK = {"concurrency": [4, 16, 64], "request_sizes": [MiB, 4 * MiB, 16 * MiB], "span": 128 * MiB}


def _time_cell(url: str, span: int, concurrency: int, request_size: int, min_seconds: float) -> float:
    buffer = torch.empty(span, dtype=torch.uint8)
    zero = np.zeros(1, dtype=np.int64)
    warm = np.array([min(span, concurrency * request_size)], dtype=np.int64)  # opens the connections
    whole = np.array([span], dtype=np.int64)
    with RemoteReader(concurrency=concurrency, request_size=request_size, backend="http") as reader:
        reader.read(buffer, [url], zero, zero, warm, zero)
        moved, started = 0, time.perf_counter()
        while True:
            reader.read(buffer, [url], zero, zero, whole, zero)
            moved += span
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                return moved / elapsed / 1e9


def recommend(cells: list[dict]) -> dict:
    best = max(cells, key=lambda c: c["gbps"])
    pick = min(
        (c for c in cells if c["gbps"] >= NEAR_BEST * best["gbps"]), key=lambda c: (c["concurrency"], c["request_size"])
    )
    return {**pick, "best": best}


def sweep(url: str, concurrency=None, request_sizes=None, span=None, min_seconds: float = 1.0, quick=False) -> dict:
    """GB/s of every concurrency x request size reading ``url`` (its first ``span`` bytes)."""
    grid = QUICK if quick else FULL
    concurrency = list(concurrency or grid["concurrency"])
    request_sizes = list(request_sizes or grid["request_sizes"])
    obj = open_object(url)
    span = min(obj.size, span or grid["span"])
    if span <= 0:
        raise ValueError(f"{obj.display} is empty: nothing to time")
    cells, gbps = [], []
    for c in concurrency:
        row = []
        for s in request_sizes:
            rate = _time_cell(url, span, c, s, min_seconds)
            cells.append({"concurrency": c, "request_size": s, "gbps": rate})
            row.append(rate)
        gbps.append(row)
    return {
        "url": obj.display,
        "size": obj.size,
        "span": span,
        "concurrency": concurrency,
        "request_sizes": request_sizes,
        "gbps": gbps,
        "recommended": recommend(cells),
    }


def render(result: dict) -> str:
    """The sweep as a table (``*``: the recommended cell) and the setting to use."""
    rec = result["recommended"]
    sizes = [f"{s / MiB:g} MiB" for s in result["request_sizes"]]
    lines = [
        f"{result['url']}: first {result['span'] / MiB:g} MiB of {result['size'] / MiB:g} MiB read as one batch; "
        "GB/s, columns: request size",
        "  ".join([f"{'in flight':>9}"] + [f"{s:>10}" for s in sizes]),
    ]
    for c, row in zip(result["concurrency"], result["gbps"]):
        cells = [
            f"{v:>9.3f}" + ("*" if (c, s) == (rec["concurrency"], rec["request_size"]) else " ")
            for s, v in zip(result["request_sizes"], row)
        ]
        lines.append("  ".join([f"{c:>9}"] + cells))
    best = rec["best"]
    lines.append(
        f"recommended: remote_concurrency={rec['concurrency']}, remote_request_size={rec['request_size'] // MiB}MiB "
        f"({rec['gbps']:.3f} GB/s; fastest {best['gbps']:.3f} GB/s at {best['concurrency']} x "
        f"{best['request_size'] / MiB:g} MiB). Set TORCH_FASTLOAD_REMOTE_CONCURRENCY / "
        "TORCH_FASTLOAD_REMOTE_REQUEST_SIZE, or --save"
    )
    return "\n".join(lines)


def save(recommended: dict) -> str:
    """Merge the recommended setting into the tuning file (other settings kept); its path."""
    path = config.tuning_file()
    try:
        record = json.loads(fileio.read_file(path))  # regular files only: a FIFO never blocks
    except (OSError, ValueError, RecursionError):
        record = {}  # unreadable: replaced by a fresh one
    if not isinstance(record, dict):
        record = {}
    settings = record.setdefault("settings", {})
    settings.update(remote_concurrency=recommended["concurrency"], remote_request_size=recommended["request_size"])
    record["remote_date"] = datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fileio.write_atomic(path, lambda f: json.dump(record, f, indent=2))
    return path


def run(url: str, quick: bool = False, json_path=None, do_save: bool = False) -> int:
    """What ``doctor --url`` does: sweep, print, optionally save and write JSON. Exit code."""
    try:
        result = sweep(url, quick=quick, min_seconds=0.3 if quick else 1.0)
    except Exception as exc:  # typed remote errors name the object, never a credential
        print(f"remote sweep: failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print("\n== remote reads (--url) ==\n" + render(result), flush=True)
    if do_save:
        print(f"wrote {save(result['recommended'])}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0
