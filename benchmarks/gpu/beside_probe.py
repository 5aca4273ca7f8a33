"""Where an image batch's time goes beside a training step (issue 20's ResNet-18 row).

Alone on an H100 the loader decodes a batch of 256 in 11-17 ms; beside a ResNet-18 step (21.4 ms
on a resident batch) its batches take 26-31 ms and the loop waits 16-38%. This times each stage
phase of a batch (``split_probe.Phases``: wall and the stage thread's CPU a call) with the
loader alone and then feeding the step, at one CPU share, so the two can be read side by side:
a Python phase whose wall grows beside the step while its CPU does not waited for the GIL;
nvJPEG's call growing in wall alone waited for the GPU (torchvision synchronizes its stream at
each call's start) or for its lock.

    python3 benchmarks/gpu/beside_probe.py OUT.json [--arch resnet18] [--share 0.25] [--steps 120]
        [--busy-gpu X]   # the route trial's tie rule for this run (benchmarks/gpu/tie_ab.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from split_probe import instrument, loader_rate, log, print_loader_row, trial_described  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload.sources.images import ImageFolder  # noqa: E402
from torch_fastload.vision import TrainTransform  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402


class Step:
    """examples/imagenet.py's step: SGD, bf16 autocast on a GPU, channels_last."""

    def __init__(self, arch: str, classes: int, device: torch.device):
        self.device = device
        self.model = getattr(torchvision.models, arch)(num_classes=classes).to(device)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        self.criterion = torch.nn.CrossEntropyLoss()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.criterion(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_ms(step: Step, batch: int, size: int, classes: int, steps: int) -> float:
    """The step on one batch kept on the device: the time with no input at all."""
    x = torch.randn(batch, 3, size, size, device=step.device)
    y = torch.randint(0, classes, (batch,), device=step.device)
    for _ in range(5):
        step(x, y)
    sync(step.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(step.device)
    return 1e3 * (time.perf_counter() - t0) / steps


def fed(train_dir: str, step: Step, share, batch: int, warmup: int, steps: int) -> dict:
    """The step fed by the loader: ``warmup`` steps untimed (past a route trial's ~70 batches
    for share 'auto'), then ``steps`` timed with the stage phases recorded."""
    with torch_fastload.config.override(cpu_decode_share=share):
        loader = torch_fastload.DataLoader(
            ImageFolder(train_dir, TrainTransform(), seed=0), batch, shuffle=True, drop_last=True, device=step.device
        )
        phases = instrument()
        done, waited, started = 0, 0.0, None
        while done < warmup + steps:
            it = iter(loader)
            while done < warmup + steps:
                t0 = time.perf_counter()
                try:
                    images, labels = next(it)
                except StopIteration:
                    break
                if done == warmup:
                    sync(step.device)
                    started = t0 = time.perf_counter()
                if done >= warmup:
                    waited += time.perf_counter() - t0
                step(images, labels)
                done += 1
        sync(step.device)
        wall = time.perf_counter() - started
        phases.restore()
        chosen = [str(d.trial.choice) for d in loader.dataset._decoders.values() if d.trial is not None]
        trial = trial_described(loader)
    return {
        "share": share,
        "chosen": chosen,
        "trial": trial,
        "step_ms": 1e3 * wall / steps,
        "wait_fraction": waited / wall,
        "phases": phases.summary(started),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dir", default="/tmp/beside-probe")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--share", default="0.25", help="cpu_decode_share: a number or 'auto'")
    p.add_argument("--warmup", type=int, default=40, help="untimed fed steps (use ~100 with --share auto)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--backend", default="auto", help="decode_backend")
    p.add_argument(
        "--nvjpeg-priority", default="normal", choices=["high", "normal"], help="the direct decoder's streams' priority"
    )
    p.add_argument(
        "--busy-gpu",
        type=float,
        default=None,
        help="the trial's TRIAL_BUSY_GPU for this run (default: the library's): inf gives every tie between "
        "nvJPEG alone and a split to nvJPEG alone (the rule before 2026-11-28), 0 every tie to the split",
    )
    args = p.parse_args()
    if args.busy_gpu is not None:
        from torch_fastload.vision import route_trial

        route_trial.TRIAL_BUSY_GPU = args.busy_gpu
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    share = args.share if args.share == "auto" else float(args.share)
    train, _ = make_image_folder(args.dir, args.classes, args.per_class, 1, edge_cases=False, progress=False)
    step = Step(args.arch, args.classes, device)
    result = {"device": str(device), "arch": args.arch, "batch": args.batch, "share": share}
    result["busy_gpu"] = args.busy_gpu
    result["synthetic_ms"] = synthetic_ms(step, args.batch, 224, args.classes, min(args.steps, 50))
    log(f"{args.arch} on a resident batch: {result['synthetic_ms']:.1f} ms a step")
    torch_fastload.config.set(decode_backend=args.backend)
    result["decode_backend"] = args.backend
    if args.backend == "nvjpeg" and args.nvjpeg_priority != "normal":
        from torch_fastload.vision import gpu_backend
        from torch_fastload.vision.nvjpeg_direct import DirectNvjpeg

        index = torch.device("cuda", torch.cuda.current_device())
        gpu_backend._chosen[("nvjpeg", index)] = DirectNvjpeg(index, priority=args.nvjpeg_priority)
    result["nvjpeg_priority"] = args.nvjpeg_priority
    alone = loader_rate(train, share, batch=args.batch, device=str(device))
    alone["ms_a_batch"] = 1e3 * args.batch / alone["images_per_s"]
    result["alone"] = alone
    print_loader_row(alone)
    beside = fed(train, step, share, args.batch, args.warmup, args.steps)
    result["beside"] = beside
    log(
        f"beside the {args.arch} step: {beside['step_ms']:.1f} ms a step (resident {result['synthetic_ms']:.1f}), "
        f"loop waited {100 * beside['wait_fraction']:.0f}%, route {beside['chosen']}"
    )
    for label, run in (("alone", alone), ("beside", beside)):
        for described in run.get("trial") or ():
            log(f"route trial {label}: {described}")
    log(f"{'phase':28s} {'alone wall / cpu ms':>22s} {'beside wall / cpu ms':>22s}")
    for label in sorted(beside["phases"], key=lambda k: -beside["phases"][k]["wall_ms_a_call"]):
        a, b = alone["phases"].get(label), beside["phases"][label]
        was = f"{a['wall_ms_a_call']:7.2f} / {a['cpu_ms_a_call']:6.2f}" if a else "-"
        log(f"{label:28s} {was:>22s} {b['wall_ms_a_call']:7.2f} / {b['cpu_ms_a_call']:6.2f}")
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
