"""A training script in the style of the PyTorch ImageNet example, with only the loader swapped.

    python benchmarks/example_style.py --arch resnet50       # H100: ~2 min a model
    python benchmarks/example_style.py --device cpu --quick  # a CPU smoke test (tiny)

The loop is the example's: ``data_time`` is the time spent in ``next()``, then
``images.cuda(non_blocking=True)``, forward, loss, ``loss.item()`` (the example's meters read it
every step), backward, SGD; ``batch_time`` is the whole iteration. Four loaders feed it:

- ``torch``: ``torch.utils.data.DataLoader(torchvision ImageFolder + PIL transforms,
  num_workers=16, pin_memory=True)``, the example's own;
- ``fastload, same dataset``: ``torch_fastload.DataLoader`` with the same arguments;
- ``fastload ImageFolder, workers=16`` / ``workers=0``: torch_fastload's own ``ImageFolder``
  with ``TrainTransform`` (C++ reads, batched decode), as a user of the example would write it.

Reported per loader: median and longest data_time, median batch_time, images/s over the timed
steps, the time to the first batch and the epoch's wall time from the loader's creation to its
last step, each against torch's in the same run (targets: data_time and batch_time <= torch's;
the native folder with 16 workers as fast as with 0). The image files are read once and the
model runs a few steps on random images before the first loader, so no loader pays a cold page
cache or the process's first steps: the first loader (torch) did, and its slow start let its
workers build a backlog that hid their pace for the rest of a short epoch.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from torch_fastload._benchutil import Study, log, parse_study, study_parser, table, warm_page_cache

OUT = Path(__file__).resolve().parent / "out"


def parse_args(argv=None):
    p = study_parser(__doc__, OUT)
    p.add_argument("--arch", default=None, help="torchvision model [resnet50 | resnet18 on a CPU]")
    p.add_argument("--data", default=None, help="an ImageFolder train/ directory (default: generated sample set)")
    p.add_argument("--batch-size", type=int, default=None, help="[256 | 8 on a CPU]")
    p.add_argument("--workers", type=int, default=None, help="torch's num_workers [16 | 2 on a CPU]")
    p.add_argument("--steps", type=int, default=None, help="timed steps per loader, after --warmup [40 | 20 | 3]")
    p.add_argument("--warmup", type=int, default=None, help="[8 | 6 | 1]")
    p.add_argument("--only", default="", help="comma-separated loader names to run")
    p.add_argument(
        "--trace", action="store_true", help="record torch_fastload's per-batch timeline (TORCH_FASTLOAD_TRACE)"
    )
    args = parse_study(
        p,
        argv,
        arch=("resnet50", "resnet50", "resnet18"),
        batch_size=(256, 256, 8),
        workers=(16, 16, 2),
        steps=(40, 20, 3),
        warmup=(8, 6, 1),
    )
    args.tiny = args.scale == "cpu"
    return args


def sample_train_dir(tiny: bool) -> str:
    from torch_fastload.vision.sample_data import make_image_folder

    root = Path(os.environ.get("TORCH_FASTLOAD_BENCH_DATA", "/tmp/torch_fastload-bench")) / (
        "example-quick" if tiny else "example"
    )
    # one epoch holds every timed step (ImageNet's epochs are 5,000 steps: no restarts in view)
    train, _ = make_image_folder(
        str(root), classes=4 if tiny else 80, train_per_class=4 if tiny else 110, val_per_class=1, progress=False
    )
    return train


def loaders(train: str, args, device):
    import torchvision
    import torchvision.transforms as T

    import torch_fastload
    from torch_fastload.sources import ImageFolder
    from torch_fastload.vision import TrainTransform

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    pil = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)

    def torchvision_folder():
        return torchvision.datasets.ImageFolder(train, pil)

    return {
        "torch": lambda: torch.utils.data.DataLoader(torchvision_folder(), **common),
        "fastload, same dataset": lambda: torch_fastload.DataLoader(torchvision_folder(), **common),
        # the stage's copies and device copy as torch calls, each queueing for the GIL again (the
        # route before the one-call stage: transfer.ONE_CALL_STAGE)
        "fastload, same dataset, Python stage": lambda: torch_fastload.DataLoader(torchvision_folder(), **common),
        "fastload, same dataset, 1 stage thread": lambda: torch_fastload.DataLoader(
            torchvision_folder(), stage_threads=1, **common
        ),
        f"fastload ImageFolder, workers={args.workers}": lambda: torch_fastload.DataLoader(
            ImageFolder(train, TrainTransform()), **common
        ),
        "fastload ImageFolder, workers=0": lambda: torch_fastload.DataLoader(
            ImageFolder(train, TrainTransform()), **{**common, "num_workers": 0}
        ),
    }


def warm_up_model(model, args, device, steps: int = 3) -> None:
    """A few steps of the model on random images before any loader runs: the process's first
    steps load kernels and pick convolution algorithms (seconds on the GPU), which would land in
    the first loader's epoch time and let its workers build a backlog the others never get."""
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    images = torch.randn(args.batch_size, 3, 224, 224, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    for _ in range(steps):
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    loss.item()


def train_run(make, model, args, device) -> dict:
    """The example's loop; per-step data_time (next()) and batch_time (the whole iteration)."""
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    started = time.perf_counter()
    loader = make()
    data_times, batch_times, first = [], [], None
    steps = args.warmup + args.steps
    end = time.perf_counter()
    for images, target in loader:  # one epoch at most: restarts are not the steady state
        data_times.append(time.perf_counter() - end)
        if first is None:
            first = time.perf_counter() - started
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        loss.item()  # the example's meters read the loss every step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_times.append(time.perf_counter() - end)
        end = time.perf_counter()
        if len(batch_times) >= steps:
            break
    stats = getattr(loader, "stats", None)
    trace = getattr(getattr(getattr(loader, "resources", None), "stats", None), "trace", None)
    epoch_s = time.perf_counter() - started
    data, batch = data_times[args.warmup :], batch_times[args.warmup :]
    return {
        "epoch_s": epoch_s,
        "data_ms_max": max(data) * 1e3,
        "data_ms": statistics.median(data) * 1e3,
        "batch_ms": statistics.median(batch) * 1e3,
        "images_per_s": args.batch_size * len(batch) / sum(batch),
        "first_batch_s": first,
        "stats": str(stats()) if stats is not None else None,
        "data_ms_each": [t * 1e3 for t in data],
        "trace": [(k, n, a - started, b - started) for k, n, a, b in trace] if trace else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trace:
        os.environ["TORCH_FASTLOAD_TRACE"] = "1"
    import torchvision

    from torch_fastload import transfer

    device = args.device
    train = args.data or sample_train_dir(args.tiny)
    warm_page_cache(sorted(p for p in Path(train).rglob("*") if p.is_file()))
    warm_up_model(torchvision.models.__dict__[args.arch]().to(device), args, device)
    study = Study(f"example_style-{args.arch}", args, f"PyTorch-example loop, {args.arch}")
    study["runs"] = runs = {}
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    for name, make in loaders(train, args, device).items():
        if names and not any(n in name for n in names):
            continue
        torch.manual_seed(0)
        model = torchvision.models.__dict__[args.arch]().to(device)
        transfer.ONE_CALL_STAGE = "Python stage" not in name
        run = study.attempt(name, train_run, make, model, args, device)
        transfer.ONE_CALL_STAGE = True
        if run is None:
            continue
        runs[name] = run
        log(
            f"{name}: data {run['data_ms']:.1f} ms, batch {run['batch_ms']:.1f} ms, "
            f"{run['images_per_s']:.0f} img/s, first batch after {run['first_batch_s']:.1f} s,"
            f" epoch {run['epoch_s']:.1f} s"
        )
    base = runs.get("torch")
    rows = []
    for name, run in runs.items():
        data_vs, batch_vs, rate_vs, epoch_vs = (
            f"{run[k] / base[k]:.2f}x" if base else "-" for k in ("data_ms", "batch_ms", "images_per_s", "epoch_s")
        )
        rows.append(
            [
                name,
                f"{run['data_ms']:.1f}",
                data_vs,
                f"{run['data_ms_max']:.1f}",
                f"{run['batch_ms']:.1f}",
                batch_vs,
                f"{run['images_per_s']:.0f}",
                rate_vs,
                f"{run['first_batch_s']:.1f}",
                f"{run['epoch_s']:.2f}",
                epoch_vs,
            ]
        )
        if base and name != "torch":
            study.figure(f"images_per_s_vs_torch:{name}", run["images_per_s"] / base["images_per_s"])
            study.figure(f"epoch_s_vs_torch:{name}", run["epoch_s"] / base["epoch_s"])
            study.verdict(f"{name}: batch time <= torch's", run["batch_ms"] <= base["batch_ms"], batch_vs)
            study.verdict(
                f"{name}: time in next() <= torch's",
                run["data_ms"] <= max(base["data_ms"], 1.0),
                f"{run['data_ms']:.1f} vs {base['data_ms']:.1f} ms",
            )
    headers = ["loader", "data ms", "vs torch", "data ms max", "batch ms", "vs torch", "img/s", "vs torch"]
    headers += ["first batch s", "epoch s", "vs torch"]
    title = f"{args.arch}, batch {args.batch_size}, {args.workers} workers, PyTorch-example loop (medians)"
    return study.finish(table(headers, rows, title=title), plot=plot)


def plot(data: dict, plt):
    """Per loader: images/s, and where each step's time went (in next() vs the rest)."""
    runs = data["runs"]
    if not runs:
        return None
    names = list(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.6 * len(names) + 2))
    left.barh(names, [runs[n]["images_per_s"] for n in names], color="tab:blue")
    left.set_xlabel("images/s")
    data_ms = [runs[n]["data_ms"] for n in names]
    rest_ms = [max(0.0, runs[n]["batch_ms"] - runs[n]["data_ms"]) for n in names]
    right.barh(names, data_ms, color="tab:red", label="in next()")
    right.barh(names, rest_ms, left=data_ms, color="tab:gray", label="the rest of the step")
    right.set_xlabel("ms per step (medians)")
    right.set_yticklabels([])
    right.legend()
    fig.suptitle(f"{data['args']['arch']}: the PyTorch ImageNet example's loop, loaders swapped")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
