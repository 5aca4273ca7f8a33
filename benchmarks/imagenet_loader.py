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
  fastload-folder-BACKEND  (--decode-backends) fastload-folder with every JPEG the GPU takes on
                           that GPU decode backend (cpu_decode_share=0): torchvision, nvimgcodec,
                           hardware (the GPU's JPEG engines alone; progressive JPEGs on the CPU);
                           'cpu' for every JPEG on the C++ decoder (cpu_decode_share=1); 'steal'
                           for nvJPEG and the C++ decoder splitting each batch (as DALI's mixed
                           decoder splits it between the hardware decoder and its CPU threads);
                           'threeway' for the CPU, the JPEG engines and nvJPEG at once (0.31,
                           0.29, 0.40 of each batch);
                           the output --route-output (fp32 NCHW, or bf16 channels_last beside
                           DALI's fp16 NHWC)
  gpu-decode-BACKEND       the ceiling: that backend alone on batches from pinned memory
Peers (optional; "not installed" where the package is absent; _benchutil/peers.py builds them):
  dali                     DALI's ResNet-50 example pipeline: readers.file, image_random_crop on
                           "mixed" (nvJPEG + hardware decoder), resize, crop_mirror_normalize;
                           num_threads = --workers; fp32 NCHW
  dali-fp16-nhwc           the same, fp16 NHWC (DALI has no bf16: beside our bf16 channels_last)
  spdl-cpu                 SPDL's image-classification pipeline, FFmpeg decode on --workers
                           threads, resize 256 + crop 224 (its example: no random crop, no flip)
  spdl-nvjpeg              the same with load_image_batch_nvjpeg (nvJPEG, resize 224), over the
                           JPEGs nvJPEG takes
  both normalized to fp32 NCHW on the GPU, in the timed loop.
CPU cores = (process + worker) CPU seconds / wall seconds. Targets: fastload >= 3x torch,
>= 1.0x DALI, >= 1.5x SPDL.

    python benchmarks/imagenet_loader.py            # ~2 min on the H100 machine
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import torch_fastload
from torch_fastload._benchutil import Study, cpu_seconds, fmt, log, parse_study, peers, study_parser, sync, table
from torch_fastload.sources import ImageFolder, PackedImageFolder
from torch_fastload.vision import TrainTransform
from torch_fastload.vision.sample_data import make_image_folder


def route_trials(loader) -> list:
    """The route trials of a fastload image loader's decoders (none for the other loaders)."""
    trials = getattr(getattr(loader, "dataset", None), "route_trials", None)
    return list(trials().values()) if trials is not None else []


def past_route_trial(loader, device: torch.device, max_epochs: int = 8) -> dict | None:
    """Untimed epochs until every route trial of the loader chose (its windows time the CPU route
    first, then the JPEG engines and nvJPEG, then their splits: ~85 batches, not the steady state
    a timed epoch measures); None without a trial."""
    extra = 0
    while route_trials(loader) and any(t.choice is None for t in route_trials(loader)) and extra < max_epochs:
        for _ in loader:
            pass
        extra += 1
    sync(device)
    return trial_seen(loader, untimed_epochs_after_the_first=extra)


def trial_seen(loader, **extra) -> dict | None:
    """What the loader's route trials chose and saw (None without a trial)."""
    trials = route_trials(loader)
    if not trials:
        return None
    return {**extra, "chosen": [t.choice for t in trials], "seen": [t.describe() for t in trials]}


def timed_epochs(loader, epochs: int, device: torch.device, limit: int = 0, past_trial: bool = True) -> dict:
    """One untimed epoch (page cache, decoders, kernels warm), more until the route trial chose
    (``past_trial``), then ``epochs`` timed; best kept."""
    results = []
    trial = None
    for epoch in range(epochs + 1):
        if epoch == 1 and past_trial:
            trial = past_route_trial(loader, device)
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
        "route_trial": trial if trial is not None else trial_seen(loader, timed_inside=True),
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


def nvjpeg_takes(data: bytes, device: torch.device) -> bool:
    """Whether our router sends this file to nvJPEG (not a CMYK, PNG, ... that fails a batch)."""
    from torch_fastload.vision import decode

    return decode.route(decode.probe(np.frombuffer(data, np.uint8), np.array([0, len(data)])), device, 1 << 22)[0] == (
        "nvjpeg"
    )


def gpu_decode_ceiling(train_dir, args, backend_name: str) -> dict:
    """One GPU decode backend (vision/gpu_backend.py: torchvision's nvJPEG or nvImageCodec) alone
    on batches of the folder's JPEGs that nvJPEG takes (a CMYK file in a batch would fail the whole
    batch), from pinned memory."""
    from torch_fastload.vision.gpu_backend import gpu_backend
    from torch_fastload.vision.jpeg_engines import ENGINES, jpeg_engines

    blobs = []
    for path in ImageFolder(train_dir, transform=None).paths:
        data = Path(path).read_bytes()
        if nvjpeg_takes(data, args.device):
            blobs.append(data)
        if len(blobs) >= args.batch * 8:
            break
    slab = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).pin_memory()
    bounds = np.cumsum([0] + [len(b) for b in blobs])
    images = [slab[bounds[i] : bounds[i + 1]] for i in range(len(blobs))]
    batches = [images[k : k + args.batch] for k in range(0, len(images), args.batch)]
    backend = (
        jpeg_engines(args.device, args.batch) if backend_name == ENGINES else gpu_backend(args.device, backend_name)
    )
    for batch in batches[:2]:
        backend.decode(batch)
    sync(args.device)
    t0 = time.perf_counter()
    refused = 0
    for _ in range(3):
        for batch in batches:
            refused += sum(image is None for image in backend.decode(batch))
    sync(args.device)
    return {
        "images_per_s": 3 * len(images) / (time.perf_counter() - t0),
        "images": 3 * len(images),
        "refused": refused,
        "backend": backend.name,
    }


def peer_runs(train_dir, args) -> dict:
    """The peers' rows that can run here (name -> (maker, output)); the others are logged and
    recorded as "not installed" / "needs CUDA" rows, never dropped silently."""
    threads, out, samples = args.workers, {}, peers.image_samples(train_dir)
    makers = {
        "dali": ("dali", "fp32 NCHW", lambda: peers.dali_image_loader(train_dir, args.batch, threads, args.device)),
        "dali-fp16-nhwc": (
            "dali",
            "fp16 NHWC (channels_last view)",
            lambda: peers.dali_image_loader(train_dir, args.batch, threads, args.device, half_nhwc=True),
        ),
        "spdl-cpu": (
            "spdl",
            "fp32 NCHW (resize 256 + crop 224)",
            lambda: peers.spdl_image_loader(samples, args.batch, threads, args.device, nvjpeg=False),
        ),
        "spdl-nvjpeg": (
            "spdl",
            "fp32 NCHW (nvJPEG resize 224, nvJPEG-able JPEGs)",
            lambda: peers.spdl_image_loader(
                [s for s in samples if nvjpeg_takes(Path(s[0]).read_bytes(), args.device)],
                args.batch,
                threads,
                args.device,
                nvjpeg=True,
            ),
        ),
    }
    for name, (peer, output, make) in makers.items():
        try:
            peers.require(peer, args.device)
            if name == "spdl-nvjpeg" and samples:
                peers.check_spdl_nvjpeg(samples[0][0], args.device)
            out[name] = (make, output)
        except peers.PeerUnavailable as why:
            log(f"-- {name}: {why}")
            out[name] = (None, str(why))
    return out


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


def route_settings(name: str) -> dict:
    """The options of a fastload-folder-BACKEND run: every JPEG the GPU takes on that backend, or
    ('cpu') every JPEG on the C++ decoder; {} for the other runs."""
    backend = name.rsplit("-", 1)[-1] if name.startswith("fastload-folder-") else None
    if backend == "cpu":
        return {"cpu_decode_share": 1.0}
    if backend == "steal":
        return {"cpu_decode_share": "steal"}
    if backend == "threeway":  # the H200's ResNet-18 rates alone: CPU 7.1k, engines 6.8k, nvJPEG 9.2k images/s
        threads = max(1, torch_fastload.config.cpus_per_process() - 4)  # as auto's trial decodes
        return {"cpu_decode_share": 0.31, "engine_decode_share": 0.29, "cpu_decode_threads": threads}
    if backend in ("torchvision", "nvimgcodec", "hardware"):
        return {"cpu_decode_share": 0.0, "decode_backend": backend}
    return {}


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


def isolated_run(name: str, argv: list, workdir: Path) -> dict:
    """Row ``name`` timed by a fresh process of this script (its own CUDA context and decoders:
    in one process the later rows ran 8-14% faster on an H200); raises with the child's last
    lines where it failed (``Study.attempt`` records it as that row's failure)."""
    keep, skip = [], False
    for arg in argv:  # this process's own outputs and row choice are not the child's
        if skip:
            skip = False
        elif arg in ("--isolate", "--peers-first"):
            continue
        elif arg in ("--runs", "--json", "--out"):
            skip = True
        elif not arg.startswith(("--runs=", "--json=", "--out=")):
            keep.append(arg)
    out = workdir / name
    command = [sys.executable, __file__, *keep, "--runs", name, "--out", str(out), "--json", str(out / "row.json")]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rows = json.loads((out / "row.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        rows = []
    if done.returncode != 0 or not rows:
        tail = "\n".join(done.stdout.splitlines()[-8:])
        raise RuntimeError(f"its process exited {done.returncode} without a result; its last lines:\n{tail}")
    return rows[0]


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
    p.add_argument(
        "--decode-backends",
        default="",
        help="also compare these decode routes, comma-separated: torchvision, nvimgcodec, hardware (GPU decode "
        "backends; hardware: the JPEG engines alone), "
        "cpu (every JPEG on the C++ decoder), steal (nvJPEG and the C++ decoder split each batch), threeway "
        "(the CPU, the JPEG engines and nvJPEG at once)",
    )
    p.add_argument(
        "--route-output",
        choices=("fp32", "bf16-cl"),
        default="fp32",
        help="the output of the --decode-backends rows: fp32 NCHW, or bf16 channels_last [fp32]",
    )
    p.add_argument("--runs", default="", help="only these runs, comma-separated names (default: all)")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="each row in a fresh process of its own (in one process the later rows ran 8-14%% faster)",
    )
    p.add_argument(
        "--peers-first",
        action="store_true",
        help="the peers' rows before ours (all rows share one process: whichever runs later meets the GPU decoders "
        "the earlier ones left set up)",
    )
    p.add_argument(
        "--timed-trial",
        action="store_true",
        help="time right after one untimed epoch, even where the route trial (cpu_decode_share='auto') "
        "has not chosen yet (before 2026-11-26: its windows fell in short runs' timed epochs)",
    )
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
        "torch": (lambda: torch_loader(train_dir, args), "fp32 NCHW"),
        "fastload-folder": (lambda: fastload(ImageFolder(train_dir, TrainTransform(), seed=0)), "fp32 NCHW"),
        "fastload-packed": (lambda: fastload(PackedImageFolder(pack_dir, TrainTransform(), seed=0)), "fp32 NCHW"),
        "fastload-folder-bf16-cl": (lambda: fastload(ImageFolder(train_dir, bf16, seed=0)), "bf16 NCHW channels_last"),
        **peer_runs(train_dir, args),
    }
    backends = [b for b in args.decode_backends.split(",") if b]
    route_transform, route_output = (
        (bf16, "bf16 NCHW channels_last") if args.route_output == "bf16-cl" else (None, "fp32 NCHW")
    )
    for backend in backends:
        runs[f"fastload-folder-{backend}"] = (
            lambda: fastload(ImageFolder(train_dir, route_transform or TrainTransform(), seed=0)),
            route_output,
        )
    if args.peers_first:  # one process runs every row: a library's GPU decoders stay set up after its row
        peer_names = [n for n in runs if n.startswith(("dali", "spdl"))]
        runs = {**{n: runs[n] for n in ["torch", *peer_names] if n in runs}, **runs}
    wanted = set(args.runs.split(",")) if args.runs else None
    study["peers"] = peers.all_status()
    study["runs"], study["peer_rows_not_run"] = [], {}
    for name, (make, output) in runs.items():
        if wanted is not None and name not in wanted:
            continue
        if make is None:
            study["peer_rows_not_run"][name] = output
            continue
        log(f"-- {name}")
        if args.isolate:
            own_argv = list(sys.argv[1:] if argv is None else argv)
            if row := study.attempt(name, isolated_run, name, own_argv, Path(args.out) / "rows"):
                study["runs"].append(row)
                log(f"   {row['images_per_s']:,.0f} images/s, {row.get('cores', 0):.1f} CPU cores (own process)")
            continue
        settings = route_settings(name)
        with torch_fastload.config.override(**settings):
            loader = study.attempt(name, make)
            limit = args.torch_batches if name == "torch" else 0
            result = (
                None
                if loader is None
                else study.attempt(name, timed_epochs, loader, args.epochs, args.device, limit, not args.timed_trial)
            )
        if result and settings:
            result["settings"] = settings
        if result:
            if hasattr(loader, "stats"):
                result.update(decoded=loader.stats().decoded, io=loader.stats().io)
            getattr(loader, "close", lambda: None)()
            study["runs"].append({"name": name, "output": output, **result})
            log(
                f"   {result['images_per_s']:,.0f} images/s, {result['cores']:.1f} CPU cores, "
                f"decoded {result.get('decoded', '-')}"
            )
            if result.get("route_trial"):
                log(f"   route trial: {result['route_trial']}")
    for backend in [b for b in backends if b != "cpu"] or ["torchvision"]:
        name = f"gpu-decode-{backend}"
        if cuda and (wanted is None or name in wanted):
            if ceiling := study.attempt(name, gpu_decode_ceiling, train_dir, args, backend):
                study["runs"].append({"name": name, **ceiling})
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
                r.get("output", "-"),
            ]
        )
    rows += [[name, "-", "-", "-", "-", why] for name, why in study["peer_rows_not_run"].items()]
    best = max((r["images_per_s"] for r in study["runs"] if r["name"].startswith("fastload")), default=None)
    if base and best:
        study.verdict("fastload >= 3x torch's images/s", best / base >= 3, f"{best / base:.2f}x")
    for peer, floor in (("dali", 1.0), ("spdl", 1.5)):
        theirs = max((r["images_per_s"] for r in study["runs"] if r["name"].startswith(peer)), default=None)
        if theirs and best:
            study.figure(f"fastload_vs_{peer}", best / theirs)
            study.verdict(f"fastload >= {floor}x {peer}'s images/s", best / theirs >= floor, f"{best / theirs:.2f}x")
    title = f"ImageNet-style input pipeline on {args.device} ({len(folder)} images, page cache hot)"
    title += f", batch {args.batch}, CPU budget {args.workers} (torch workers, DALI/SPDL threads)"
    heads = ["run", "images/s", "CPU cores", "cores/1000 img/s", "vs torch", "output"]
    return study.finish(table(heads, rows, title), plot=plot if study["runs"] else None)


if __name__ == "__main__":
    sys.exit(main())
