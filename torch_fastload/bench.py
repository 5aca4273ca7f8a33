"""torch DataLoader vs torch_fastload.DataLoader on a generated image dataset, side by side.

    python -m torch_fastload.bench                  # GPU: 8192 images 3x128x128 (1.6 GB), ~30-60 s
    python -m torch_fastload bench --epochs 8       # the same, through the package entry point
    python -m torch_fastload.bench --compute-ms 2   # a calibrated busy kernel instead of the model
    python -m torch_fastload.bench --json out.json  # also write every number as JSON

A seeded, image-like dataset (float32 3 x H x W images + int64 labels, a ``TensorDataset``)
is generated in host memory; a small conv net is trained on it for a few epochs, fed once by
``torch.utils.data.DataLoader(pin_memory=True, num_workers=W)`` with ``.to(device,
non_blocking=True)`` in the loop (for each W asked for), and once by
``torch_fastload.DataLoader`` (``num_workers=0``: a background thread fetches samples and
stacks them straight into the pinned pool). Both see the same batches in the same order and
train an identically initialised model, so their final losses should agree.

Reported per loader: samples/s, the input-wait fraction (time the loop spent blocked in
``next()`` plus the ``.to()`` call, over wall time), GB/s of input delivered and the speedup
over the best torch configuration; then ``loader.stats()`` of torch_fastload. A
"device-resident" row (the dataset already on the device) shows what the model alone can do.

Without CUDA everything runs on the CPU with smaller defaults (torch gets pin_memory=False),
which exercises the code paths; the numbers only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from torch_fastload._benchutil import (
    InflightWindow,
    Progress,
    cpu_seconds,
    fmt,
    h2d_copy_seconds,
    int_list,
    log,
    machine_info,
    sync,
    table,
)

__all__ = ["main", "build_parser", "make_dataset", "SmallConvNet", "CudaSleeper"]

MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# a calibrated GPU busy kernel
# --------------------------------------------------------------------------------------------
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

    def sleep_ms(self, ms: float) -> None:
        if self.cycles_per_ms and ms > 0:
            cycles = int((ms - self.offset_ms) * self.cycles_per_ms)
            if cycles > 0:
                torch.cuda._sleep(cycles)


# --------------------------------------------------------------------------------------------
# dataset and model
# --------------------------------------------------------------------------------------------
def make_dataset(
    samples: int, channels: int, size: int, classes: int, seed: int, progress: bool = True
) -> torch.utils.data.TensorDataset:
    """Image-like float32 samples (smooth class patterns + low-frequency noise + pixel noise,
    roughly zero mean, unit variance) and int64 labels; seeded, so every run sees the same data."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (samples,), generator=g, dtype=torch.int64)
    templates = torch.nn.functional.interpolate(
        torch.randn(classes, channels, 4, 4, generator=g), size=(size, size), mode="bilinear", align_corners=False
    )
    images = torch.empty(samples, channels, size, size, dtype=torch.float32)
    chunk = 256
    bar = Progress(samples, "generating dataset", progress)
    for start in range(0, samples, chunk):
        end = min(samples, start + chunk)
        n = end - start
        low = max(2, size // 8)
        blobs = torch.nn.functional.interpolate(
            torch.randn(n, channels, low, low, generator=g), size=(size, size), mode="bilinear", align_corners=False
        )
        block = images[start:end]
        torch.mul(templates[labels[start:end]], 0.8, out=block)
        block.add_(blobs, alpha=0.6)
        block.add_(torch.randn(n, channels, size, size, generator=g), alpha=0.3)
        bar.update(n)
    bar.close()
    return torch.utils.data.TensorDataset(images, labels)


class SmallConvNet(nn.Module):
    """A lean conv net (few kernels, so a step is not all Python launch overhead): a 4x4 stride-4
    patchify stem, two 3x3 stride-2 convs, ReLUs, global average pooling and a linear head."""

    def __init__(self, in_channels: int, width: int, classes: int):
        super().__init__()
        c = width
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, c, 4, stride=4),
            nn.ReLU(inplace=True),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(2 * c, 4 * c, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * c, classes),
        )

    def forward(self, x):
        return self.net(x)


class Trainer:
    """One training step on a batch: forward, cross-entropy, backward, SGD (bf16 autocast on
    CUDA), or with ``compute_ms`` a calibrated busy kernel that also reads the batch."""

    def __init__(self, args, device: torch.device, width: int, sleeper: CudaSleeper | None):
        self.device = device
        self.compute_ms = args.compute_ms
        self.sleeper = sleeper
        self.amp = device.type == "cuda" and args.amp == "bf16"
        self.channels_last = device.type == "cuda"
        torch.manual_seed(args.seed)  # identical initial weights for every run
        self.model = SmallConvNet(args.channels, width, args.classes).to(device)
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        try:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9, fused=device.type == "cuda")
        except (RuntimeError, TypeError, ValueError):  # torch without fused SGD
            self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.compute_ms is not None:
            touched = x.view(-1)[:: max(1, x.numel() // 4096)].float().mean()
            if self.device.type == "cuda":
                self.sleeper.sleep_ms(self.compute_ms)
            else:
                time.sleep(self.compute_ms / 1e3)  # the host is free while a device computes
            return touched
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def time_transfer_ms(nbytes: int, device: torch.device, reps: int = 10) -> float | None:
    """Median time of one pinned -> device copy of ``nbytes`` (the link at its best)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = h2d_copy_seconds(src, dst, reps)
    del src, dst
    return statistics.median(times) * 1e3


def time_compute_ms(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, steps: int = 20) -> float:
    """Mean time of one training step on a batch already on the device."""
    for _ in range(5):
        trainer.step(x, y)
    sync(trainer.device)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.step(x, y)
    sync(trainer.device)
    return (time.perf_counter() - started) / steps * 1e3


def pick_width(args, device, dataset, sleeper) -> tuple[int, dict]:
    """``--width auto``: the narrowest conv net whose step takes >= ``--compute-ratio`` times the
    pinned copy of one batch (so input and compute matter about equally). Fixed on the CPU."""
    x = dataset.tensors[0][: args.batch_size].to(device)
    y = dataset.tensors[1][: args.batch_size].to(device)
    batch_bytes = x.nbytes + y.nbytes
    transfer = time_transfer_ms(batch_bytes, device)
    info = {"batch_bytes": batch_bytes, "pinned_transfer_ms": transfer, "candidates": []}
    if args.compute_ms is not None:
        info["mode"] = f"busy kernel {args.compute_ms} ms"
        trainer = Trainer(args, device, 16, sleeper)
        info["compute_ms"] = time_compute_ms(trainer, x, y, steps=10)
        return 16, info
    if args.width != "auto":
        widths = [int(args.width)]
    elif device.type != "cuda":
        widths = [16]
    else:
        widths = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    chosen = widths[-1]
    for width in widths:
        trainer = Trainer(args, device, width, sleeper)
        ms = time_compute_ms(trainer, x, y, steps=10 if device.type == "cpu" else 20)
        info["candidates"].append({"width": width, "compute_ms": ms})
        del trainer
        if transfer is None or ms >= args.compute_ratio * transfer:
            chosen = width
            break
    info["width"] = chosen
    info["compute_ms"] = info["candidates"][-1]["compute_ms"]
    info["mode"] = "model"
    return chosen, info


# --------------------------------------------------------------------------------------------
# the measured loop
# --------------------------------------------------------------------------------------------
def train_run(name: str, loader, trainer: Trainer, args, device: torch.device, fastload=None) -> dict:
    """``args.epochs`` epochs of the training loop over ``loader``.

    The first ``args.warmup_steps`` steps are not timed (worker start-up, pool allocation, cuDNN
    autotuning); the clock starts after a device synchronize and stops after another. Input
    wait = time in ``iter()``/``next()`` plus the ``.to(device, non_blocking=True)`` calls.
    """
    steps_per_epoch = len(loader)
    total = steps_per_epoch * args.epochs
    if total <= args.warmup_steps:
        raise SystemExit(
            f"{name}: {total} steps in {args.epochs} epoch(s) is not more than "
            f"--warmup-steps {args.warmup_steps}; use more --samples or --epochs"
        )
    window = InflightWindow(device, args.max_inflight)
    bar = Progress(total, name, args.progress)
    timed = False
    started = cpu0 = 0.0
    wait = 0.0
    steps = samples = nbytes = 0
    step_index = 0
    first_loss = last_loss = None
    try:
        for _epoch in range(args.epochs):
            t0 = time.perf_counter()
            iterator = iter(loader)
            if timed:
                wait += time.perf_counter() - t0
            while True:
                t0 = time.perf_counter()
                try:
                    x, y = next(iterator)
                except StopIteration:
                    if timed:
                        wait += time.perf_counter() - t0
                    break
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                if timed:
                    wait += time.perf_counter() - t0
                    steps += 1
                    samples += x.shape[0]
                    nbytes += x.nbytes + y.nbytes
                loss = trainer.step(x, y)
                if trainer.compute_ms is None:  # a busy kernel has no loss
                    if first_loss is None:
                        first_loss = loss
                    last_loss = loss
                window.step_done()
                step_index += 1
                bar.update()
                if step_index == args.warmup_steps:
                    window.drain()
                    if fastload is not None:
                        fastload.stats(reset=True)
                    timed = True
                    cpu0 = cpu_seconds()
                    started = time.perf_counter()
            del iterator
        window.drain()
        wall = time.perf_counter() - started
        cpu = cpu_seconds() - cpu0
    finally:
        bar.close()
    result = {
        "name": name,
        "steps": steps,
        "samples": samples,
        "bytes": nbytes,
        "wall_s": wall,
        "wait_s": wait,
        "wait_fraction": wait / wall if wall > 0 else None,
        "samples_per_s": samples / wall if wall > 0 else None,
        "gbps": nbytes / wall / 1e9 if wall > 0 else None,
        "step_ms": 1e3 * wall / steps if steps else None,
        "cpu_s": cpu,
        "cpu_cores": cpu / wall if wall > 0 else None,
        "first_loss": float(first_loss) if first_loss is not None else None,
        "last_loss": float(last_loss) if last_loss is not None else None,
    }
    if fastload is not None:
        snapshot = fastload.stats()
        result["fastload_stats"] = snapshot.as_dict()
        result["_snapshot"] = snapshot
    return result


class _ResidentLoader:
    """The dataset already on the device, shuffled batches gathered there: the ceiling."""

    def __init__(self, dataset, batch_size: int, device: torch.device, seed: int):
        self.x = dataset.tensors[0].to(device)
        self.y = dataset.tensors[1].to(device)
        self.batch_size = batch_size
        self.device = device
        self.g = (
            torch.Generator(device=device).manual_seed(seed)
            if device.type == "cuda"
            else torch.Generator().manual_seed(seed)
        )

    def __len__(self):
        return self.x.shape[0] // self.batch_size

    def __iter__(self):
        order = torch.randperm(self.x.shape[0], device=self.device, generator=self.g)
        for i in range(len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "python -m torch_fastload.bench",
        description="Train a small conv net on a generated in-memory image dataset, fed by torch's "
        "DataLoader(pin_memory=True) and by torch_fastload.DataLoader; print samples/s, "
        "input-wait fraction, GB/s and the speedup. Defaults in [brackets] are for a GPU "
        "/ the CPU.",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cuda | cuda:N | cpu")
    g = p.add_argument_group("dataset (generated in memory, seeded)")
    g.add_argument("--samples", type=int, default=None, help="number of images [8192 / 1024]")
    g.add_argument("--image-size", type=int, default=None, help="images are C x S x S float32 [128 / 64]")
    g.add_argument("--channels", type=int, default=3)
    g.add_argument("--classes", type=int, default=10)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("training loop")
    g.add_argument("--batch-size", type=int, default=None, help="[128 / 32]")
    g.add_argument("--epochs", type=int, default=None, help="[6 / 3]")
    g.add_argument("--warmup-steps", type=int, default=5, help="untimed steps at the start of each run")
    g.add_argument(
        "--width",
        default="auto",
        help="conv net base width; 'auto' (GPU) picks the narrowest whose step takes >= "
        "--compute-ratio x the pinned copy of a batch [auto / 16]",
    )
    g.add_argument("--compute-ratio", type=float, default=1.0, help="for --width auto")
    g.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="instead of the model, a calibrated busy kernel of this many ms per step "
        "(time.sleep on the CPU); the batch is still read",
    )
    g.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast on CUDA")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument(
        "--max-inflight", type=int, default=2, help="steps the host may queue ahead of the GPU before waiting"
    )
    g = p.add_argument_group("loaders")
    g.add_argument(
        "--torch-workers",
        type=int_list,
        default=None,
        help="torch DataLoader num_workers, comma-separated; each is run and the best is the baseline [0,4 / 0,2]",
    )
    g.add_argument("--fastload-workers", type=int, default=0, help="torch_fastload num_workers")
    g.add_argument("--stage-threads", type=int, default=None, help="torch_fastload stage_threads [configured]")
    g.add_argument("--fetch-threads", type=int, default=None, help="torch_fastload fetch_threads [configured]")
    g.add_argument("--prefetch", type=int, default=None, help="torch_fastload prefetch [configured]")
    g.add_argument("--pool-slots", type=int, default=None, help="torch_fastload pool_slots [configured]")
    g.add_argument(
        "--no-resident",
        dest="resident",
        action="store_false",
        help="skip the device-resident (model only) reference run",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, default=None, help="write every number here")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    return p


def _finish_args(args, device: torch.device) -> None:
    gpu = device.type == "cuda"
    defaults = {
        "samples": 8192 if gpu else 1024,
        "image_size": 128 if gpu else 64,
        "batch_size": 128 if gpu else 32,
        "epochs": 6 if gpu else 3,
        "torch_workers": [0, 4] if gpu else [0, 2],
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("samples", "image_size", "channels", "classes", "batch_size", "epochs", "max_inflight"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup_steps < 1:
        raise SystemExit(f"--warmup-steps must be >= 1, got {args.warmup_steps}")
    if args.samples < args.batch_size:
        raise SystemExit(f"--samples {args.samples} is smaller than --batch-size {args.batch_size}")
    if args.width != "auto" and not (args.width.isdigit() and int(args.width) >= 1):
        raise SystemExit(f"--width must be 'auto' or a positive integer, got {args.width!r}")
    if args.compute_ms is not None and args.compute_ms < 0:
        raise SystemExit(f"--compute-ms must be >= 0, got {args.compute_ms}")


def _resolve_device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {text}: CUDA is not available here (use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise SystemExit(f"--device must be cuda[:N] or cpu, got {text!r}")
    return device


def _print_table(runs: list[dict], baseline: dict | None) -> None:
    rows = []
    for r in runs:
        if r.get("error"):
            rows.append([r["name"], "error", "", "", "", "", ""])
            continue
        speedup = (
            r["samples_per_s"] / baseline["samples_per_s"]
            if baseline and baseline.get("samples_per_s") and r.get("samples_per_s")
            else None
        )
        rows.append(
            [
                r["name"],
                fmt(r["samples_per_s"], ",.0f"),
                fmt(r["step_ms"], ".2f"),
                fmt(100 * r["wait_fraction"] if r["wait_fraction"] is not None else None, ".1f"),
                fmt(r["gbps"], ".2f"),
                fmt(speedup, ".2f") + ("x" if speedup else ""),
                fmt(r["last_loss"], ".4f"),
            ]
        )
    log(table(["loader", "samples/s", "step ms", "input wait %", "GB/s", "speedup", "final loss"], rows))


def main(argv=None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    device = _resolve_device(args.device)
    _finish_args(args, device)
    import torch_fastload

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    began = time.perf_counter()
    machine = machine_info(device.type == "cuda")
    where = (machine.get("gpu") or {}).get(
        "name"
    ) or f"CPU only ({machine['cpu_affinity'] or machine['cpu_count']} cores)"
    log(f"torch_fastload.bench on {where}: torch {torch.__version__}, python {machine['python']}, device {device}")

    dataset = make_dataset(args.samples, args.channels, args.image_size, args.classes, args.seed, args.progress)
    sample_bytes = dataset[0][0].nbytes + dataset[0][1].nbytes
    log(
        f"dataset: {args.samples} samples of float32 {args.channels}x{args.image_size}x{args.image_size} "
        f"+ int64 label = {sample_bytes / 1e3:.1f} KB/sample, {args.samples * sample_bytes / 1e9:.2f} GB; "
        f"batch {args.batch_size} = {args.batch_size * sample_bytes / MiB:.1f} MiB; {args.epochs} epochs, "
        f"{args.warmup_steps} warm-up steps untimed"
    )

    sleeper = None
    sleep_cal = None
    if device.type == "cuda" and args.compute_ms is not None:
        sleeper = CudaSleeper()
        sleep_cal = sleeper.calibrate()
        if not sleep_cal.get("available"):
            raise SystemExit(f"--compute-ms needs torch.cuda._sleep: {sleep_cal.get('error')}")
    width, calibration = pick_width(args, device, dataset, sleeper)
    transfer = calibration.get("pinned_transfer_ms")
    if args.compute_ms is not None:
        log(
            f"compute: busy kernel, {calibration['compute_ms']:.2f} ms per step measured"
            + (f"; pinned copy of a batch {transfer:.2f} ms" if transfer else "")
        )
    else:
        params = sum(p.numel() for p in SmallConvNet(args.channels, width, args.classes).parameters())
        log(
            f"model: conv net width {width} ({params / 1e6:.2f} M params"
            + (", bf16 autocast, channels_last" if device.type == "cuda" and args.amp == "bf16" else "")
            + f"), step on a resident batch {calibration['compute_ms']:.2f} ms"
            + (
                f"; pinned copy of a batch {transfer:.2f} ms (ratio {calibration['compute_ms'] / transfer:.2f})"
                if transfer
                else ""
            )
        )

    pin = device.type == "cuda"
    runs: list[dict] = []
    snapshot = None

    def attempt(name, make_loader, fastload=False):
        nonlocal snapshot
        loader = None
        try:
            loader = make_loader()
            trainer = Trainer(args, device, width, sleeper)
            result = train_run(name, loader, trainer, args, device, fastload=loader if fastload else None)
            if fastload:
                snapshot = result.pop("_snapshot")
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            import traceback

            log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            result = {"name": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            if loader is not None and hasattr(loader, "close"):
                loader.close()
            del loader
        runs.append(result)
        return result

    for workers in args.torch_workers:
        attempt(
            f"torch DataLoader (workers={workers}{', pinned' if pin else ''})",
            lambda w=workers: torch.utils.data.DataLoader(
                dataset,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=w,
                pin_memory=pin,
                drop_last=True,
                generator=torch.Generator().manual_seed(args.seed),
            ),
        )
    fl_threads = args.stage_threads if args.stage_threads is not None else torch_fastload.config.get("stage_threads")
    attempt(
        f"torch_fastload (workers={args.fastload_workers}, stage_threads={fl_threads})",
        lambda: torch_fastload.DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.fastload_workers,
            drop_last=True,
            generator=torch.Generator().manual_seed(args.seed),
            device=device,
            stage_threads=args.stage_threads,
            fetch_threads=args.fetch_threads,
            prefetch=args.prefetch,
            pool_slots=args.pool_slots,
        ),
        fastload=True,
    )
    if args.resident:
        attempt("device-resident (model alone)", lambda: _ResidentLoader(dataset, args.batch_size, device, args.seed))

    torch_runs = [r for r in runs if r["name"].startswith("torch DataLoader") and not r.get("error")]
    baseline = max(torch_runs, key=lambda r: r["samples_per_s"] or 0) if torch_runs else None
    fast = next((r for r in runs if r["name"].startswith("torch_fastload") and not r.get("error")), None)
    speedup = (
        fast["samples_per_s"] / baseline["samples_per_s"] if fast and baseline and baseline["samples_per_s"] else None
    )

    log()
    log(
        f"results ({device}; timed: {runs[0].get('steps', '?')} steps per loader after warm-up; "
        f"speedup vs {baseline['name'] if baseline else 'n/a'})"
    )
    _print_table(runs, baseline)
    if fast and baseline:
        log(
            f"torch_fastload: {speedup:.2f}x the samples/s of the best torch DataLoader; input wait "
            f"{100 * fast['wait_fraction']:.1f}% vs {100 * baseline['wait_fraction']:.1f}% of wall time"
        )
    losses = [r["last_loss"] for r in runs if r.get("last_loss") is not None and not r["name"].startswith("device")]
    if args.compute_ms is None and len(losses) > 1:
        log(
            f"final losses of the loader runs (same batches, same initial weights): "
            f"{', '.join(f'{v:.4f}' for v in losses)}"
        )
    if device.type == "cpu":
        log(
            f"note: CPU run: no pinning and no host-to-device copy, and the loaders' threads and worker "
            f"processes compete with the model's {torch.get_num_threads()} intra-op threads for "
            f"{machine['cpu_affinity'] or machine['cpu_count']} cores; the numbers exercise the code, "
            f"they are not the GPU result"
        )
    if snapshot is not None:
        log()
        log(str(snapshot))

    elapsed = time.perf_counter() - began
    log(f"\ntotal time {elapsed:.1f} s")
    if args.json is not None:
        payload = {
            "benchmark": "torch_fastload.bench",
            "machine": machine,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "device": str(device),
            "dataset": {
                "samples": args.samples,
                "sample_bytes": sample_bytes,
                "shape": [args.channels, args.image_size, args.image_size],
                "dtype": "float32",
                "label_dtype": "int64",
                "total_bytes": args.samples * sample_bytes,
            },
            "model": {"width": width, "calibration": calibration, "sleep_calibration": sleep_cal},
            "runs": runs,
            "baseline": baseline["name"] if baseline else None,
            "speedup": speedup,
            "elapsed_s": elapsed,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        log(f"wrote {args.json}")
    return 1 if any(r.get("error") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
