"""The C++ engine's threads x task size over the page-cached test file (``sweep``), the
recommended setting (``recommend``), and recording it where ``config`` looks (``save_tuning``)."""

from __future__ import annotations

import datetime
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from torch_fastload import config, engine
from torch_fastload._benchutil import Progress, machine_basics, write_json

from .common import CHUNK, NEAR_BEST, gbps, size_text

__all__ = ["sweep", "recommend", "save_tuning"]


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
        from torch_fastload.io import ring_chunks

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
                    rates.append(gbps(size, seconds))
                rate = statistics.median(rates)
                grid[r][c] = rate
                cells.append({"threads": t, "task_size": task, "gbps": rate, "passes": len(rates)})
                bar.update(1, note=f"{t} x {size_text(task)}: {rate:.2f} GB/s")
    finally:
        bar.close()
        runner.close()
        del runner
        if cuda:
            torch.cuda.empty_cache()
    chunk = size_text(min(CHUNK, size))
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


def save_tuning(recommended: dict, measured: dict) -> dict:
    """Record the recommended setting where ``config`` looks for it, and say what is now in effect."""
    path = Path(config.tuning_file())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(
        path,
        {
            "settings": {"io_threads": recommended["threads"], "io_task_size": recommended["task_size"]},
            "measured": measured,
            "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
            "machine": machine_basics(),
        },
    )
    return {
        "path": str(path),
        "in_effect": {
            name: {"value": config.get(name), "source": config.source(name)} for name in ("io_threads", "io_task_size")
        },
    }
