"""The main job's workload (``python -m torch_fastload.bench``): a generated image-like dataset,
a small conv net and its training step, the device-resident reference loader, and the clock
of the measured loop."""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from .machine import cpu_seconds
from .output import Progress
from .timing import CudaSleeper, InflightWindow, sync


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


class ResidentLoader:
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


class StepClock:
    """Input wait, steps, samples and bytes from the end of the warm-up on. The clock starts
    after ``warmup_steps`` steps and a device synchronize (worker start-up, pool allocation and
    cuDNN autotuning stay out); the loader's stats are reset at the same moment."""

    def __init__(self, args, device: torch.device, fastload):
        self.warmup_steps, self.fastload = args.warmup_steps, fastload
        self.window = InflightWindow(device, args.max_inflight)
        self.timed = False
        self.started = self.cpu0 = self.wait = 0.0
        self.steps = self.samples = self.nbytes = self.step_index = 0

    def waited(self, seconds: float) -> None:
        if self.timed:
            self.wait += seconds

    def count(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.timed:
            self.steps += 1
            self.samples += x.shape[0]
            self.nbytes += x.nbytes + y.nbytes

    def step_done(self) -> None:
        self.window.step_done()
        self.step_index += 1
        if self.step_index == self.warmup_steps:
            self.window.drain()
            if self.fastload is not None:
                self.fastload.stats(reset=True)
            self.timed = True
            self.cpu0 = cpu_seconds()
            self.started = time.perf_counter()

    def stop(self, name: str) -> dict:
        self.window.drain()
        wall = time.perf_counter() - self.started
        cpu = cpu_seconds() - self.cpu0
        return {
            "name": name,
            "steps": self.steps,
            "samples": self.samples,
            "bytes": self.nbytes,
            "wall_s": wall,
            "wait_s": self.wait,
            "wait_fraction": self.wait / wall if wall > 0 else None,
            "samples_per_s": self.samples / wall if wall > 0 else None,
            "gbps": self.nbytes / wall / 1e9 if wall > 0 else None,
            "step_ms": 1e3 * wall / self.steps if self.steps else None,
            "cpu_s": cpu,
            "cpu_cores": cpu / wall if wall > 0 else None,
        }
