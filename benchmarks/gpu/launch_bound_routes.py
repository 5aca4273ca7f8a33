"""Issue 17: what slows a launch-bound training thread beside the C++ loop, route by route.

A TensorDataset of ROW_KIB rows (argv[1], default 192), batch 128. For each route the thread
launches K small kernels a batch, K such that they take as long as the loader needs per batch at
its full rate alone; its launch rate is timed over the launch loops only (next() left out) and
divided by the rate with ready device-resident batches (alternated, 3 repeats, medians):
  beside          as benchmarks/beside_step.py times it;
  side stream     next() called under a side stream: the batch's wait lands there, the kernels on
                  the default stream never wait for a copy (if this recovers the rate, the loss
                  was the stream waiting for copies, not the launches);
  idle            the loader alive, its queue full, next() not called during the launches;
and the loader's batches/s alone and beside the thread. With small rows (argv[1] = 4) the copy
engines' work per batch is negligible and the driver calls per batch are the same.

    python3 benchmarks/gpu/launch_bound_routes.py [ROW_KIB]
    env ROUTES="copy engines, shuffled;gather kernel, shuffled" (names separated by ";")
"""

import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
import beside_step as bs  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload import DataLoader  # noqa: E402

device = torch.device("cuda")
row_bytes, batch = int(sys.argv[1] if len(sys.argv) > 1 else 192) * 1024, 128
data = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (8192, row_bytes), dtype=np.uint8))
tensors = torch.utils.data.TensorDataset(data)
resident = [data[i * batch : (i + 1) * batch].to(device) for i in range(4)]
side = torch.cuda.Stream(device)


def make(shuffle=True, **options):
    def build():
        with torch_fastload.config.override(**options):
            return DataLoader(tensors, batch_size=batch, shuffle=shuffle, drop_last=True, device=device)

    return build


def ready():
    return (resident[i % 4] for i in range(10**9))


def under_side_stream(batches):
    for _ in range(10**9):
        with torch.cuda.stream(side):
            got = next(batches)
        yield got


def idle_beside(build, kernels):
    it = iter(build())
    for _ in range(3):
        next(it)
    time.sleep(0.05)  # the loop fills its queue and waits
    return bs.launches_per_second(kernels, 100, device, ready())[0]


ROUTES = {
    "copy engines, shuffled": make(memory_rows="dma"),
    "copy engines, in order": make(shuffle=False, memory_rows="dma"),
    "gather kernel, shuffled": make(memory_rows="kernel"),
    "CPU gather, shuffled": make(memory_rows="gather"),
    "auto, shuffled": make(),
}
only = [r.strip() for r in os.environ.get("ROUTES", "").split(";") if r.strip()]
print(f"rows of {row_bytes // 1024} KiB, batch {batch}", flush=True)
for name, build in ROUTES.items():
    if only and name not in only:
        continue
    rate = bs.loader_rate(build, 40)
    kernels = max(1, round(bs.launches_per_second(2000, 10, device)[0] / rate))
    alone, beside, on_side, idle, rates = [], [], [], [], []
    for _ in range(3):
        alone.append(bs.launches_per_second(kernels, 100, device, ready())[0])
        batches = bs.endless(build)
        started = time.perf_counter()
        beside.append(bs.launches_per_second(kernels, 100, device, batches)[0])
        rates.append((100 + bs.WARMUP_STEPS) / (time.perf_counter() - started))
        del batches
        on_side.append(bs.launches_per_second(kernels, 100, device, under_side_stream(bs.endless(build)))[0])
        idle.append(idle_beside(build, kernels))
    base = statistics.median(alone)
    print(
        f"{name:24s} loader {rate:5.0f} batches/s alone, {statistics.median(rates):5.0f} beside; K {kernels:4d}; "
        f"launch rate beside {statistics.median(beside) / base:.3f}, side stream "
        f"{statistics.median(on_side) / base:.3f}, loader idle {statistics.median(idle) / base:.3f}",
        flush=True,
    )
