#!/usr/bin/env python3
"""ImageNet-style input pipeline alone: images/s and CPU cores, torch vs torch_fastload, one run.

Data: a generated ImageNet-like folder of real-photo JPEGs (``vision.sample_data``: ~110 KB,
500x375, with a CMYK, a grayscale, a PNG-named-.JPEG, a progressive and a 4000x3000 file),
--classes x --per-class images under --dir, or --data for a real ImageFolder. The page cache
is hot: every run reads the whole set once untimed before its timed epochs (stated in the
JSON), so storage is not what is measured.

Runs (batch --batch, shuffled, RandomResizedCrop 224 + flip + normalize, batches on the GPU):
  torch            torchvision ImageFolder + PIL transforms + torch DataLoader(num_workers=
                   --workers, pin_memory=True, persistent_workers), ``.cuda(non_blocking)``
  fastload-folder  torch_fastload ImageFolder: engine reads -> nvJPEG -> one transform kernel
  fastload-packed  the same from a pack of the folder (python -m torch_fastload pack)
  fastload-folder-bf16-cl  bf16 channels_last output (what the training example feeds)
Baseline/ceiling in the same run:
  nvjpeg-decode    torchvision.io.decode_jpeg(device='cuda') of batches of the same JPEGs
                   from pinned memory: decode alone, no read, no transform

CPU cores = (process + worker-process CPU seconds) / wall seconds over the timed epochs;
reported per 1000 images/s. Target (issue 4): fastload >= 3x torch's images/s.

    python benchmarks/imagenet_loader.py             # ~2 min on the H100 machine
    python benchmarks/imagenet_loader.py --cpu-smoke # no GPU: tiny data, code paths only

Writes imagenet_loader.json and imagenet_loader.png to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload._benchutil import cpu_seconds, error_text, fmt, log, machine_info, table, write_json  # noqa: E402
from torch_fastload.sources import ImageFolder, PackedImageFolder  # noqa: E402
from torch_fastload.vision import TrainTransform  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402


def timed_epochs(loader, epochs: int, device: torch.device, limit: int = 0) -> dict:
    """One untimed epoch (page cache, decoders, kernels warm), then ``epochs`` timed ones."""
    results = []
    for epoch in range(epochs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        images = 0
        for i, (x, y) in enumerate(loader):
            x = x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
            images += len(y)
            if limit and i + 1 >= limit:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        if epoch:
            results.append({"images": images, "seconds": wall, "cores": cpu / wall, "images_per_s": images / wall})
    best = max(results, key=lambda r: r["images_per_s"])
    return {
        "epochs": results,
        "images_per_s": best["images_per_s"],
        "cores": best["cores"],
        "cores_per_1000": best["cores"] / (best["images_per_s"] / 1000),
    }


def torch_loader(train_dir, args, device):
    import torchvision
    import torchvision.transforms as T

    ds = torchvision.datasets.ImageFolder(
        train_dir,
        T.Compose(
            [
                T.RandomResizedCrop(224),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ]
        ),
    )
    return torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
        persistent_workers=args.workers > 0,
    )


def nvjpeg_ceiling(train_dir, args, device) -> dict:
    """decode_jpeg(device='cuda') alone on batches of the folder's JPEGs that nvJPEG takes
    (the probe's routing: a CMYK file in a batch fails the whole batch)."""
    from torch_fastload.vision import decode

    ds = ImageFolder(train_dir, transform=None)
    blobs = []
    for path in ds.paths:
        with open(path, "rb") as f:
            data = f.read()
        info = decode.probe(np.frombuffer(data, dtype=np.uint8), np.array([0, len(data)]))
        if decode.route(info, device, 1 << 22)[0] == "nvjpeg":
            blobs.append(data)
        if len(blobs) >= args.batch * 8:
            break
    slab = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).pin_memory()
    bounds = np.cumsum([0] + [len(b) for b in blobs])
    batches = [
        [slab[bounds[i] : bounds[i + 1]] for i in range(k, min(k + args.batch, len(blobs)))]
        for k in range(0, len(blobs), args.batch)
    ]
    ops = decode._ops()
    for batch in batches[:2]:
        ops.decode_jpegs_cuda(batch, decode.RGB, device)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    n = 0
    for _ in range(3):
        for batch in batches:
            ops.decode_jpegs_cuda(batch, decode.RGB, device)
            n += len(batch)
    torch.cuda.synchronize(device)
    return {"images_per_s": n / (time.perf_counter() - t0), "images": n}


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [r for r in report["runs"] if "images_per_s" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in runs]
    ax1.barh(names, [r["images_per_s"] for r in runs], color=["#999" if r["name"] == "torch" else "#2a7" for r in runs])
    ax1.set_xlabel("images/s (higher is better)")
    ax1.set_title("input pipeline, RandomResizedCrop 224")
    with_cores = [r for r in runs if r.get("cores_per_1000") is not None]
    ax2.barh([r["name"] for r in with_cores], [r["cores_per_1000"] for r in with_cores], color="#c63")
    ax2.set_xlabel("CPU cores per 1000 images/s (lower is better)")
    fig.suptitle(
        f"{report['machine'].get('gpu', {}).get('name', 'cpu')}: {report['dataset']['images']} images, page cache hot"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", help="an ImageFolder train directory to use instead of the generated one")
    p.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "imagenet-sample")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run (after one untimed)")
    p.add_argument("--workers", type=int, default=16, help="torch DataLoader worker processes")
    p.add_argument("--torch-batches", type=int, default=0, help="stop torch's epochs after N batches (0: all)")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny data on the CPU, code paths only")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.classes, args.per_class, args.batch, args.epochs, args.workers = 4, 6, 8, 1, 2
    device = torch.device("cuda") if torch.cuda.is_available() and not args.cpu_smoke else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.data:
        train_dir = args.data
    else:
        edge = ("gray", "cmyk", "png", "progressive") if args.cpu_smoke else True
        train_dir, _ = make_image_folder(
            str(args.dir), args.classes, args.per_class, 1, edge_cases=edge, progress=not args.no_progress
        )
    pack_dir = Path(str(args.dir) + "-pack") if not args.data else args.out / "imagenet-pack"
    if not (pack_dir / "meta.json").exists():
        t0 = time.perf_counter()
        torch_fastload.pack_image_folder(train_dir, pack_dir, progress=not args.no_progress, overwrite=True)
        log(f"packed {train_dir} -> {pack_dir} in {time.perf_counter() - t0:.1f} s")
    folder = ImageFolder(train_dir, transform=None)
    dataset = {
        "train_dir": str(train_dir),
        "images": len(folder),
        "classes": len(folder.classes),
        "bytes": int(folder.sizes.sum()),
        "mean_kb": float(folder.sizes.mean() / 1e3),
        "page_cache": "hot (one untimed epoch before the timed ones; the set fits in RAM)",
    }
    log(f"dataset: {dataset['images']} images, {dataset['bytes'] / 1e9:.2f} GB, mean {dataset['mean_kb']:.0f} KB")
    report = {
        "machine": machine_info(device.type == "cuda"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "dataset": dataset,
        "device": str(device),
        "runs": [],
        "failures": [],
    }

    def run(name, make, **extra):
        log(f"-- {name}")
        try:
            loader = make()
            limit = args.torch_batches if name == "torch" else 0
            result = timed_epochs(loader, args.epochs, device, limit)
            if hasattr(loader, "stats"):
                stats = loader.stats()
                result["decoded"] = stats.decoded
                result["io"] = stats.io
                loader.close()
            result.update(name=name, **extra)
            report["runs"].append(result)
            log(
                f"   {result['images_per_s']:,.0f} images/s, {result['cores']:.1f} CPU cores "
                f"({result['cores_per_1000']:.2f} per 1000 images/s)"
                + (f", decoded {result['decoded']}" if result.get("decoded") else "")
            )
        except Exception as exc:
            report["failures"].append({"name": name, "error": error_text(exc)})
            log(f"   FAILED: {error_text(exc)}")

    run("torch", lambda: torch_loader(train_dir, args, device), workers=args.workers)
    train = TrainTransform()
    run(
        "fastload-folder",
        lambda: torch_fastload.DataLoader(
            ImageFolder(train_dir, train, seed=0), batch_size=args.batch, shuffle=True, drop_last=True, device=device
        ),
    )
    run(
        "fastload-packed",
        lambda: torch_fastload.DataLoader(
            PackedImageFolder(pack_dir, train, seed=0),
            batch_size=args.batch,
            shuffle=True,
            drop_last=True,
            device=device,
        ),
    )
    bf16 = TrainTransform(dtype=torch.bfloat16, channels_last=True)
    run(
        "fastload-folder-bf16-cl",
        lambda: torch_fastload.DataLoader(
            ImageFolder(train_dir, bf16, seed=0), batch_size=args.batch, shuffle=True, drop_last=True, device=device
        ),
    )
    if device.type == "cuda":
        log("-- nvjpeg-decode (ceiling: decode only)")
        try:
            ceiling = nvjpeg_ceiling(train_dir, args, device)
            ceiling["name"] = "nvjpeg-decode"
            report["runs"].append(ceiling)
            log(f"   {ceiling['images_per_s']:,.0f} images/s")
        except Exception as exc:
            report["failures"].append({"name": "nvjpeg-decode", "error": error_text(exc)})
            log(f"   FAILED: {error_text(exc)[:400]}")
    by = {r["name"]: r for r in report["runs"]}
    base = by.get("torch", {}).get("images_per_s")
    rows = []
    for r in report["runs"]:
        ratio = r["images_per_s"] / base if base else None
        r["vs_torch"] = ratio
        rows.append(
            [
                r["name"],
                fmt(r["images_per_s"], ",.0f"),
                fmt(r.get("cores"), ".1f"),
                fmt(r.get("cores_per_1000"), ".2f"),
                fmt(ratio, ".2f") + "x",
            ]
        )
    log("")
    log(
        table(
            ["run", "images/s", "CPU cores", "cores/1000 img/s", "vs torch"],
            rows,
            title=f"ImageNet-style input pipeline on {device} ({dataset['images']} images, page cache hot)",
        )
    )
    best = max((r["images_per_s"] for r in report["runs"] if r["name"].startswith("fastload")), default=None)
    if base and best and device.type == "cuda":
        verdict = "PASS" if best / base >= 3 else "FAIL"
        report["verdicts"] = [{"target": "fastload >= 3x torch images/s", "value": best / base, "verdict": verdict}]
        log(f"\n{verdict}: fastload {best / base:.2f}x torch's images/s (target >= 3x)")
    write_json(args.out / "imagenet_loader.json", report)
    plot(report, args.out / "imagenet_loader.png")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
