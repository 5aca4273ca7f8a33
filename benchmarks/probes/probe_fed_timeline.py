"""Where does a fed ResNet-50 step lose its time: GPU idle between steps, GPU idle inside a
step (the host launching late), or slower kernels? CUDA events on the training stream and host
timestamps, put on one clock, per step; no profiler (it slows the host 2x).

    python benchmarks/probes/probe_fed_timeline.py [resnet50] [OUT.json]

Modes: synthetic (one device batch), fed:SHARE:PREFETCH[:STAGE_WORKERS[:CPU_THREADS]]
(cpu_decode_share or auto, prefetch depth, stage threads, CPU decode threads), and
beside:SHARE[:CPU_THREADS]: the synthetic step while a thread drains the loader flat out (its batches per
second next to training are the loader's ceiling there). Per mode it prints the step, the GPU
time from the step's first to last kernel, the gap between steps, and how far the GPU trailed
the host at the end of each step (near 0: the GPU had run out of work).
"""

import json
import os
import statistics
import sys
import threading
import time

import torch
import torchvision

sys.path.insert(0, os.getcwd())
from torch_fastload import DataLoader  # noqa: E402
from torch_fastload.sources import ImageFolder  # noqa: E402
from torch_fastload.vision import TrainTransform, decode  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402

arch = sys.argv[1] if len(sys.argv) > 1 else "resnet50"
out_path = sys.argv[2] if len(sys.argv) > 2 else None
modes = (sys.argv[3] if len(sys.argv) > 3 else "synthetic,fed:0:2,fed:0.15:2,fed:0:4,fed:0.15:4,beside:0").split(",")
STEPS, WARMUP, BATCH = int(os.environ.get("PROBE_STEPS", 50)), 8, 256
train, _ = make_image_folder("/tmp/probe-imgs-160", classes=100, train_per_class=160, val_per_class=1, progress=False)
dev = torch.device("cuda", 0)
model = getattr(torchvision.models, arch)(num_classes=100).to(dev).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x0 = torch.randn(BATCH, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
y0 = torch.randint(0, 100, (BATCH,), device=dev)


def step(x, y):
    with torch.autocast("cuda", torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


for _ in range(15):
    step(x0, y0)
torch.cuda.synchronize()


def batches(source):
    """Endless batches: the synthetic one, or a loader's epochs one after another."""
    if source is None:
        while True:
            yield x0, y0
    while True:
        yield from source


def host_launch_ms(x, y, repeats=5):
    """Host time to launch one step onto an idle GPU (the queue never fills: the host's own
    cost of a step, which the GPU's 64 ms must stay above for the host to keep ahead)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(x, y)
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def timeline(source, steps=STEPS):
    it = batches(source)
    for _ in range(WARMUP):
        step(*next(it))
    launch_alone = host_launch_ms(x0, y0)
    torch.cuda.synchronize()
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    begin = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    asked, got, launched = [], [], []
    counters = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    started = time.perf_counter()
    for k in range(steps):
        asked.append(time.perf_counter())
        x, y = next(it)
        got.append(time.perf_counter())
        begin[k].record()
        step(x, y)
        end[k].record()
        launched.append(time.perf_counter())
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps * 1e3
    after = torch.cuda.memory_stats()
    allocator = {c: after.get(c, 0) - before.get(c, 0) for c in counters}  # cudaMalloc/cudaFree in the window
    gb = [origin.elapsed_time(e) for e in begin]  # ms after t0 (the GPU clock)
    ge = [origin.elapsed_time(e) for e in end]
    host = lambda ts: [(t - t0) * 1e3 for t in ts]  # noqa: E731
    asked, got, launched = host(asked), host(got), host(launched)
    gpu_step = [e - b for b, e in zip(gb, ge)]
    gap = [gb[k + 1] - ge[k] for k in range(steps - 1)]
    # the next batch's host arrival after the GPU finished the step: the GPU idled for the host
    host_late = [max(0.0, min(gap[k], got[k + 1] - ge[k])) for k in range(steps - 1)]
    trail = [ge[k] - launched[k] for k in range(steps)]  # GPU end after the host's last launch
    med = statistics.median
    return {
        "step_ms": wall,
        "host_launch_ms_idle_gpu": launch_alone,
        "gpu_step_ms_median": med(gpu_step),
        "gpu_step_ms_mean": sum(gpu_step) / steps,
        "gap_ms_mean": sum(gap) / len(gap),
        "host_late_ms_mean": sum(host_late) / len(gap),
        "wait_ms_mean": sum(g - a for a, g in zip(asked, got)) / steps,
        "launch_ms_mean": sum(l - g for g, l in zip(got, launched)) / steps,
        "trail_ms_median": med(trail),
        "trail_ms_min": min(trail),
        "steps_gpu_trailing_under_1ms": sum(t < 1.0 for t in trail),
        "gpu_step_ms_p90": sorted(gpu_step)[int(0.9 * steps)],
        "gpu_step_ms_max": max(gpu_step),
        "allocator": allocator,
    }


def make_loader(share, prefetch, workers=2, cpu_threads=8):
    import torch_fastload.loader as loader_module

    loader_module.STAGE_WORKERS = workers
    ds = ImageFolder(train, TrainTransform(dtype=torch.bfloat16, channels_last=True), seed=0)
    decoder = ds.decoder(dev)
    if share == "auto":  # work stealing with the C++ decoder
        decoder.work_stealing, decoder.cpu_share = decode._native_jpeg(), 0.0
    else:
        decoder.work_stealing, decoder.cpu_share = False, float(share)
    decoder.cpu_threads = cpu_threads
    return DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True, device=dev, prefetch=prefetch), ds


results = {"arch": arch, "device": torch.cuda.get_device_name(), "steps": STEPS}
for mode in modes:
    parts = mode.split(":")
    if parts[0] == "synthetic":
        r = timeline(None)
    elif parts[0] == "fed":
        loader, ds = make_loader(parts[1], int(parts[2]), *(int(p) for p in parts[3:]))
        r = timeline(loader)
        r["loader_wait_fraction"] = loader.stats().wait_fraction
        r["decoded"] = dict(loader.stats().decoded)
        ds.close()
    elif parts[0] == "beside":
        loader, ds = make_loader(parts[1], 2, 2, *(int(p) for p in parts[2:]))
        running, delivered = True, [0]

        def drain():
            while running:
                for _ in loader:
                    delivered[0] += 1
                    if not running:
                        break

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        time.sleep(3.0)
        n0, t = delivered[0], time.perf_counter()
        r = timeline(None)
        r["loader_ms_per_batch_beside"] = (time.perf_counter() - t) * 1e3 / max(1, delivered[0] - n0)
        running = False
        thread.join(60)
        ds.close()
    else:
        raise SystemExit(f"unknown mode {mode}")
    results[mode] = r
    print(mode, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
if out_path:
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
