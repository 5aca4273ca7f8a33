#!/usr/bin/env python3
"""An ImageNet-style input pipeline alone: images/s and CPU cores, torch vs torch_fastload.

Data: a generated folder of real-photo JPEGs (vision.sample_data: ~100 KB, ImageNet-like sizes,
with a CMYK, a grayscale, a PNG-named-.JPEG, a progressive and a 4000x3000 file), --classes x
--per-class under --dir, or --data for a real ImageFolder. The page cache is hot: every run
reads the set once untimed before its timed epochs.
Runs (batch --batch, shuffled, RandomResizedCrop 224 + flip + normalize, batches on the GPU):
  torch                    torchvision ImageFolder + PIL + DataLoader(--workers, pin_memory)
  fastload-folder          torch_fastload ImageFolder (engine reads, decode, one transform kernel)
  fastload-packed          the same from a pack of the folder
  fastload-folder-bf16-cl  bf16 channels_last output (what the training example feeds)
  nvjpeg-decode            the ceiling: decode_jpeg(device='cuda') of batches from pinned memory
CPU cores = (process + worker) CPU seconds / wall seconds. Target: fastload >= 3x torch.

    python benchmarks/imagenet_loader.py            # ~2 min on the H100 machine
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

import torch_fastload
from torch_fastload._benchutil import Study, cpu_seconds, fmt, log, parse_study, study_parser, sync, table
from torch_fastload.sources import ImageFolder, PackedImageFolder
from torch_fastload.vision import TrainTransform
from torch_fastload.vision.sample_data import make_image_folder


def timed_epochs(loader, epochs: int, device: torch.device, limit: int = 0) -> dict:
    """One untimed epoch (page cache, decoders, kernels warm), then ``epochs`` timed; best kept."""
    results = []
    for epoch in range(epochs + 1):
        sync(device)
        cpu0, t0, images = cpu_seconds(), time.perf_counter(), 0
        for i, (x, y) in enumerate(loader):
            x.to(device, non_blocking=True)
            images += len(y)
            if limit and i + 1 >= limit:
                break
        sync(device)
        wall = time.perf_counter() - t0
        if epoch:
            results.append(
                {
                    "images": images,
                    "seconds": wall,
                    "cores": (cpu_seconds() - cpu0) / wall,
                    "images_per_s": images / wall,
                }
            )
    best = max(results, key=lambda r: r["images_per_s"])
    return {
        "epochs": results,
        **{k: best[k] for k in ("images_per_s", "cores")},
        "cores_per_1000": best["cores"] / (best["images_per_s"] / 1000),
    }


def torch_loader(train_dir, args):
    import torchvision
    import torchvision.transforms as T

    steps = [
        T.RandomResizedCrop(224),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ]
    dataset = torchvision.datasets.ImageFolder(train_dir, T.Compose(steps))
    cuda, workers = args.device.type == "cuda", args.workers
    return torch.utils.data.DataLoader(
        dataset,
        args.batch,
        shuffle=True,
        num_workers=workers,
        pin_memory=cuda,
        drop_last=True,
        persistent_workers=workers > 0,
    )


def nvjpeg_ceiling(train_dir, args) -> dict:
    """decode_jpegs_cuda alone on batches of the folder's JPEGs that nvJPEG takes (a CMYK file in a
    batch would fail the whole batch), from pinned memory."""
    from torch_fastload.vision import decode

    blobs = []
    for path in ImageFolder(train_dir, transform=None).paths:
        data = Path(path).read_bytes()
        if (
            decode.route(decode.probe(np.frombuffer(data, np.uint8), np.array([0, len(data)])), args.device, 1 << 22)[0]
            == "nvjpeg"
        ):
            blobs.append(data)
        if len(blobs) >= args.batch * 8:
            break
    slab = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).pin_memory()
    bounds = np.cumsum([0] + [len(b) for b in blobs])
    images = [slab[bounds[i] : bounds[i + 1]] for i in range(len(blobs))]
    batches = [images[k : k + args.batch] for k in range(0, len(images), args.batch)]
    ops = torchvision_ops()
    for batch in batches[:2]:
        ops.decode_jpegs_cuda(batch, decode.RGB, args.device)
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(3):
        for batch in batches:
            ops.decode_jpegs_cuda(batch, decode.RGB, args.device)
    sync(args.device)
    return {"images_per_s": 3 * len(images) / (time.perf_counter() - t0), "images": 3 * len(images)}


def plot(data: dict, plt):
    runs = data["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.barh(
        [r["name"] for r in runs],
        [r["images_per_s"] for r in runs],
        color=["#999" if r["name"] == "torch" else "#2a7" for r in runs],
    )
    ax1.set(xlabel="images/s (higher is better)", title="input pipeline, RandomResizedCrop 224")
    cores = [r for r in runs if r.get("cores_per_1000") is not None]
    ax2.barh([r["name"] for r in cores], [r["cores_per_1000"] for r in cores], color="#c63")
    ax2.set(xlabel="CPU cores per 1000 images/s (lower is better)")
    fig.tight_layout()
    return fig


def prepare(args) -> tuple[str, Path]:
    """The train folder (generated unless --data) and its pack, each made once."""
    cuda = args.device.type == "cuda"
    args.dir = args.dir or args.out / "imagenet-sample"
    train_dir = args.data
    if not train_dir:
        edge = True if cuda else ("gray", "cmyk", "png", "progressive")
        train_dir, _ = make_image_folder(
            str(args.dir), args.classes, args.per_class, 10 if cuda else 1, edge_cases=edge, progress=args.progress
        )
    pack_dir = Path(str(args.dir) + "-pack") if not args.data else args.out / "imagenet-pack"
    if not (pack_dir / "meta.json").exists():
        torch_fastload.pack_image_folder(train_dir, pack_dir, progress=args.progress, overwrite=True)
    return train_dir, pack_dir


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--data", help="an ImageFolder train directory instead of the generated one")
    p.add_argument("--dir", type=Path, help="the generated folder [OUT/imagenet-sample]")
    p.add_argument("--classes", type=int, help="[100; cpu 4]")
    p.add_argument("--per-class", type=int, help="[100; cpu 6]")
    p.add_argument("--batch", type=int, help="[256; cpu 8]")
    p.add_argument("--epochs", type=int, help="timed epochs a run, after one untimed [2; cpu 1]")
    p.add_argument("--workers", type=int, help="torch DataLoader worker processes [16; cpu 2]")
    p.add_argument("--torch-batches", type=int, default=0, help="stop torch's epochs after N batches (0: all)")
    args = parse_study(
        p,
        argv,
        classes=(100, 100, 4),
        per_class=(100, 100, 6),
        batch=(256, 256, 8),
        epochs=(2, 2, 1),
        workers=(16, 16, 2),
    )
    cuda = args.device.type == "cuda"
    train_dir, pack_dir = prepare(args)
    study = Study("imagenet_loader", args, "ImageNet-style input pipeline: torch vs torch_fastload")
    folder = ImageFolder(train_dir, transform=None)
    study["dataset"] = {
        "train_dir": str(train_dir),
        "images": len(folder),
        "bytes": int(folder.sizes.sum()),
        "page_cache": "hot",
    }
    log(f"dataset: {len(folder)} images, {folder.sizes.sum() / 1e9:.2f} GB, mean {folder.sizes.mean() / 1e3:.0f} KB")
    fastload = lambda ds: torch_fastload.DataLoader(ds, args.batch, shuffle=True, drop_last=True, device=args.device)  # noqa: E731
    bf16 = TrainTransform(dtype=torch.bfloat16, channels_last=True)
    runs = {
        "torch": lambda: torch_loader(train_dir, args),
        "fastload-folder": lambda: fastload(ImageFolder(train_dir, TrainTransform(), seed=0)),
        "fastload-packed": lambda: fastload(PackedImageFolder(pack_dir, TrainTransform(), seed=0)),
        "fastload-folder-bf16-cl": lambda: fastload(ImageFolder(train_dir, bf16, seed=0)),
    }
    study["runs"] = []
    for name, make in runs.items():
        log(f"-- {name}")
        loader = study.attempt(name, make)
        result = (
            None
            if loader is None
            else study.attempt(
                name, timed_epochs, loader, args.epochs, args.device, args.torch_batches if name == "torch" else 0
            )
        )
        if result:
            if hasattr(loader, "stats"):
                result.update(decoded=loader.stats().decoded, io=loader.stats().io)
                loader.close()
            study["runs"].append({"name": name, **result})
            log(
                f"   {result['images_per_s']:,.0f} images/s, {result['cores']:.1f} CPU cores, "
                f"decoded {result.get('decoded', '-')}"
            )
    if cuda and (ceiling := study.attempt("nvjpeg-decode", nvjpeg_ceiling, train_dir, args)):
        study["runs"].append({"name": "nvjpeg-decode", **ceiling})
    base = next((r["images_per_s"] for r in study["runs"] if r["name"] == "torch"), None)
    rows = []
    for r in study["runs"]:
        r["vs_torch"] = r["images_per_s"] / base if base else None
        study.figure(f"images_per_s_{r['name']}", r["images_per_s"])
        study.figure(f"vs_torch_{r['name']}", r["vs_torch"])
        rows.append(
            [
                r["name"],
                fmt(r["images_per_s"], ",.0f"),
                fmt(r.get("cores"), ".1f"),
                fmt(r.get("cores_per_1000")),
                fmt(r["vs_torch"]) + "x",
            ]
        )
    best = max((r["images_per_s"] for r in study["runs"] if r["name"].startswith("fastload")), default=None)
    if base and best:
        study.verdict("fastload >= 3x torch's images/s", best / base >= 3, f"{best / base:.2f}x")
    title = f"ImageNet-style input pipeline on {args.device} ({len(folder)} images, page cache hot)"
    return study.finish(
        table(["run", "images/s", "CPU cores", "cores/1000 img/s", "vs torch"], rows, title),
        plot=plot if study["runs"] else None,
    )


if __name__ == "__main__":
    sys.exit(main())
