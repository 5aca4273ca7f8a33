"""Issue 17: the training thread's CPU share between its next() calls (its CPU seconds over wall
seconds), in the main job and in beside_step's launch-bound loop.

Design input for where a loader's group turns should run: a turn thread can only use the time the
training thread spends waiting (backward() in autograd's device thread, a synchronize); beside a
thread that never waits it only competes for the GIL, which torch lets go of at every op, so the
turn thread gets it within microseconds mid-step (JOURNAL.md, thirty-fifth session). A spinning
synchronize counts as CPU time too, so a share near 1 does not tell a launch-bound step from one
that waits for its GPU in a spin. Prints, per workload, the median share and the quartiles over
the steps, with turns on the thread and in next().

    python3 benchmarks/gpu/step_cpu_share.py       # JSON on stdout's last line
"""

from __future__ import annotations

import json
import runpy
import statistics
import sys
import threading
import time

import torch

import torch_fastload
from torch_fastload import native

_shares: list = []
_last: dict = {}
_real_next = native.NativePipeline.next


def _timed_next(self):
    me = threading.get_ident()
    cpu, wall = time.thread_time(), time.perf_counter()
    if me in _last and wall > _last[me][1]:
        _shares.append((cpu - _last[me][0]) / (wall - _last[me][1]))
    try:
        return _real_next(self)
    finally:
        _last[me] = (time.thread_time(), time.perf_counter())


def taken() -> dict:
    shares = sorted(_shares)
    _shares.clear()
    _last.clear()
    q = statistics.quantiles(shares, n=4) if len(shares) > 4 else [float("nan")] * 3
    return {"steps": len(shares), "median": statistics.median(shares), "q1": q[0], "q3": q[2]}


def main_job() -> None:
    argv = sys.argv
    sys.argv = ["bench", "--no-progress", "--repeats", "1", "--torch-workers", "0", "--json", "/tmp/share-bench.json"]
    try:
        runpy.run_module("torch_fastload.bench", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        sys.argv = argv


def launch_bound(kernels: int = 150, steps: int = 400) -> None:
    rows = torch.randint(0, 255, (8192, 192 * 1024), dtype=torch.uint8)
    loader = torch_fastload.DataLoader(
        torch.utils.data.TensorDataset(rows), batch_size=256, shuffle=True, drop_last=True, device="cuda"
    )
    x = torch.zeros(1, device="cuda")
    done = 0
    while done < steps:
        for _ in loader:
            for _ in range(kernels):
                x.add_(1)
            done += 1
            if done >= steps:
                break
    torch.cuda.synchronize()


def main() -> None:
    native.NativePipeline.next = _timed_next
    out = {}
    for name, run in (("main job", main_job), ("launch-bound loop", launch_bound)):
        for mode in ("turn thread", "turns in next()"):
            with torch_fastload.config.override(turn_thread="auto" if mode == "turn thread" else False):
                run()
            out[f"{name}, {mode}"] = r = taken()
            print(
                f"{name}, {mode}: CPU share between next() calls median {r['median']:.3f} "
                f"(quartiles {r['q1']:.3f}-{r['q3']:.3f}) over {r['steps']} steps",
                flush=True,
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
