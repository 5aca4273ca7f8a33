#!/usr/bin/env python3
"""End-to-end ImageNet-style training (examples/imagenet.py): train images/s and input wait, fed by
torch_fastload vs torch's DataLoader vs device-resident synthetic batches.

Each configuration is a fresh examples/imagenet.py process on the same generated folder
(--classes x --per-class real-photo JPEGs, page cache hot after the first run), bf16 autocast,
channels_last, batch --batch, SGD. Throughput counts the steps after the first --warmup-steps,
epoch boundaries included, validation excluded; the warm-up covers fastload's one-time route
trial (cpu_decode_share="auto" times the C++ CPU decoder, then the JPEG engines where they work
and nvJPEG if the loop waited or its step was not at the GPU's pace, then each beside the CPU),
so 4 epochs x 39 steps leave 56 steady steps after 100 untimed ones (the trial chooses after
~23 batches where it keeps the CPU route, ~70 where it times splits, ~85 with the JPEG engines;
with balance_split ~38, the split's share then settling within the untimed steps).
  synthetic          one batch kept on the GPU: the model's step with no input pipeline
  fastload           torch_fastload ImageFolder with its defaults
  fastload-share-S   (--share-too S[:THREADS[:PREFETCH]]) the same with cpu_decode_share=S (0:
                     nvJPEG; 1: every JPEG on the C++ decoder; steal), and cpu_decode_threads /
                     prefetch for that run only
  fastload-ROUTE     (--decode-routes) fastload with every JPEG on one decode route: torchvision
                     or nvimgcodec (the GPU decode backend, cpu_decode_share=0), hardware (the
                     GPU's JPEG engines alone, no SMs: nvImageCodec's HW_GPU_ONLY), cpu (the C++
                     decoder, cpu_decode_share=1), threeway (a three-way split: 31% on the CPU, 29%
                     on the JPEG engines, 40% on nvJPEG, all at once: the shares of the H200's
                     ResNet-18 rates alone, cpu_decode_share=0.31 engine_decode_share=0.29, CPUs - 4
                     decode threads as auto's trial)
  torch              torchvision ImageFolder + PIL + DataLoader(num_workers=--workers, pin_memory)
  dali               (when nvidia-dali imports; "not installed" otherwise) DALI's ResNet-50 example
                     pipeline, num_threads=--workers, fp16 NHWC (examples/imagenet.py --loader dali)
CPU cores: the example process's (and its workers') CPU seconds over its whole wall time, start-up
and untimed steps included (a rough figure beside each row).
Targets: ResNet-50 fastload step <= 1.05x synthetic; ResNet-18 fastload >= 2.5x torch's images/s;
fastload step <= DALI-fed step (both models).

    python benchmarks/imagenet_train.py                 # ~5 min on the H100 machine
    python benchmarks/imagenet_train.py --share-too 0   # + nvJPEG alone, beside the default
    python benchmarks/imagenet_train.py --only resnet50:synthetic,resnet50:fastload
    python benchmarks/imagenet_train.py --decode-routes torchvision,nvimgcodec,cpu --only ...
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from torch_fastload._benchutil import Study, fmt, log, parse_study, peers, study_parser, table

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "imagenet.py"


def variant_settings(spec: str) -> dict:
    """``SHARE[:THREADS[:PREFETCH]]`` as the environment of the variant's run."""
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts):
        raise SystemExit(f"--share-too takes SHARE[:THREADS[:PREFETCH]], got {spec!r}")
    names = ("TORCH_FASTLOAD_CPU_DECODE_SHARE", "TORCH_FASTLOAD_CPU_DECODE_THREADS", "TORCH_FASTLOAD_PREFETCH")
    return dict(zip(names, parts))


DECODE_ROUTES = {
    "torchvision": {"TORCH_FASTLOAD_CPU_DECODE_SHARE": "0", "TORCH_FASTLOAD_DECODE_BACKEND": "torchvision"},
    "nvimgcodec": {"TORCH_FASTLOAD_CPU_DECODE_SHARE": "0", "TORCH_FASTLOAD_DECODE_BACKEND": "nvimgcodec"},
    "hardware": {"TORCH_FASTLOAD_CPU_DECODE_SHARE": "0", "TORCH_FASTLOAD_DECODE_BACKEND": "hardware"},
    "cpu": {"TORCH_FASTLOAD_CPU_DECODE_SHARE": "1"},
    # the decode threads auto's trial runs with on 16 cores (CPUs - 4), not the 8 of a fixed share
    "threeway": {
        "TORCH_FASTLOAD_CPU_DECODE_SHARE": "0.31",
        "TORCH_FASTLOAD_ENGINE_DECODE_SHARE": "0.29",
        "TORCH_FASTLOAD_CPU_DECODE_THREADS": str(max(1, (os.cpu_count() or 8) - 4)),
    },
}


def run_settings(args, name: str) -> dict:
    """The environment a fastload variant runs with ({} for the others)."""
    if name.startswith("fastload-share-"):
        return variant_settings(args.share_too)
    route = name.removeprefix("fastload-")
    return DECODE_ROUTES.get(route, {}) if name.startswith("fastload-") else {}


def dali_runs(args) -> list[str]:
    """["dali"] where DALI can run here; otherwise why not, logged (never a silent skip)."""
    try:
        peers.require("dali", args.device)
        return ["dali"]
    except peers.PeerUnavailable as why:
        log(f"-- dali: {why}")
        args.dali_not_run = str(why)
        return []


def plan(args) -> list[tuple[str, str]]:
    variant = ["fastload-share-" + args.share_too.replace(":", "-")] if args.share_too else []
    routes = [r for r in args.decode_routes.split(",") if r] if args.decode_routes else []
    unknown = set(routes) - set(DECODE_ROUTES)
    if unknown:
        raise SystemExit(f"--decode-routes: unknown {sorted(unknown)}; known: {', '.join(DECODE_ROUTES)}")
    variant += [f"fastload-{r}" for r in routes]
    names = ["synthetic", "fastload", *variant, "torch", *dali_runs(args)]
    runs = [(a, n) for a in args.archs.split(",") for n in names]
    only = {tuple(x.split(":")) for x in args.only.split(",")} if args.only else None
    return [
        r for r in runs if only is None or r in only or (r[1].startswith("fastload-") and (r[0], "fastload") in only)
    ]


def child_cpu_seconds() -> float:
    """User + system CPU seconds of the reaped child processes (the example and its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(args, arch: str, name: str) -> dict:
    cpu = args.device.type == "cpu"
    out = args.out / f"train-{arch}-{name}.json"
    out.unlink(missing_ok=True)
    settings = run_settings(args, name)
    env = dict(os.environ, **settings) if name.startswith("fastload-") else None
    cmd = [sys.executable, str(EXAMPLE), "--arch", arch, "--loader", "fastload" if env else name, "--json", str(out)]
    cmd += ["--sample-dir", str(args.dir), "--sample-classes", str(args.classes)]
    cmd += ["--sample-train-per-class", str(args.per_class), "--sample-val-per-class", "2" if cpu else "10"]
    cmd += ["--batch-size", str(args.batch), "--epochs", str(args.epochs), "--warmup-steps", str(args.warmup_steps)]
    cmd += ["--workers", str(args.workers), "--checkpoint-dir", f"{args.dir}-checkpoints", "--no-progress"]
    cmd += ["--steps-per-epoch", "3", "--no-amp"] if cpu else []
    cmd += [] if (arch, name) == ("resnet18", "fastload") else ["--no-val"]
    log(f"-- {arch} {name}: {' '.join(f'{k}={v}' for k, v in settings.items())} {' '.join(cmd[1:])}")
    t0, cpu0 = time.perf_counter(), child_cpu_seconds()
    res = subprocess.run(cmd, cwd=str(EXAMPLE.parents[1]), capture_output=True, text=True, timeout=1200, env=env)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"{arch} {name}: exit {res.returncode}\n{res.stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    result = {**json.loads(out.read_text()), "loader": name, "process_seconds": seconds}
    result["process_cpu_cores"] = (child_cpu_seconds() - cpu0) / seconds  # the whole process: start-up too
    if settings:
        result["settings"] = settings
    log(
        f"   {result['train_images_per_s']:,.0f} images/s, step {result['step_ms']:.1f} ms, input wait "
        f"{100 * result['input_wait_fraction']:.1f}%"
        + (f", last val top-1 {result['history'][-1]['top1']:.1f}%" if result["history"] else "")
        + (
            f"\n   decode route kept: {result['decode_route'].get('route')} after "
            f"{result['decode_route'].get('trial_batches')} batches ({result['decode_route']['measured']})"
            if result.get("decode_route")
            else ""
        )
    )
    return result


def plot(data: dict, plt):
    runs = data["runs"]
    archs = sorted({r["arch"] for r in runs})
    loaders = list(dict.fromkeys(r["loader"] for r in runs))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(loaders)
    for k, loader in enumerate(loaders):
        values = [
            next((r["train_images_per_s"] for r in runs if (r["arch"], r["loader"]) == (a, loader)), 0) for a in archs
        ]
        ax.bar([i + (k - (len(loaders) - 1) / 2) * width for i in range(len(archs))], values, width, label=loader)
    ax.set_xticks(range(len(archs)), archs)
    ax.set(ylabel="train images/s", title="examples/imagenet.py: device-resident vs torch_fastload vs torch")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--dir", type=Path, help="the generated folder [OUT/imagenet-sample]")
    p.add_argument("--classes", type=int, help="[100; cpu 4]")
    p.add_argument("--per-class", type=int, help="[100; cpu 4]")
    p.add_argument("--batch", type=int, help="[256; cpu 4]")
    p.add_argument("--epochs", type=int, help="[4; cpu 1]")
    p.add_argument("--warmup-steps", type=int, help="steps left out of the figures [100; cpu 1]")
    p.add_argument("--workers", type=int, help="torch DataLoader workers [16; cpu 2]")
    p.add_argument("--archs", help="[resnet50,resnet18; cpu resnet18]")
    p.add_argument("--only", help="ARCH:LOADER,... of the runs to make (a fastload-share run goes with ARCH:fastload)")
    p.add_argument(
        "--share-too", metavar="SHARE[:THREADS[:PREFETCH]]", help="also run fastload with these decode settings"
    )
    p.add_argument(
        "--decode-routes",
        default="",
        help="also run fastload with every JPEG on each of these routes, comma-separated: torchvision, "
        "nvimgcodec (GPU decode backends), hardware (the GPU's JPEG engines alone), cpu (the C++ decoder), "
        "threeway (the CPU, the JPEG engines and nvJPEG on each batch at once: 0.31, 0.29, 0.40)",
    )
    args = parse_study(
        p,
        argv,
        classes=(100, 100, 4),
        per_class=(100, 100, 4),
        batch=(256, 256, 4),
        epochs=(4, 4, 1),
        warmup_steps=(100, 100, 1),
        workers=(16, 16, 2),
        archs=("resnet50,resnet18", "resnet50,resnet18", "resnet18"),
    )
    args.dir = args.dir or args.out / "imagenet-sample"
    study = Study("imagenet_train", args, "examples/imagenet.py end to end: synthetic vs fastload vs torch")
    study["page_cache"] = "hot: the folder is generated (or read by an earlier run) first"
    study["peers"] = {"dali": peers.status("dali").as_dict()}
    study["runs"] = [
        r for arch, name in plan(args) if (r := study.attempt(f"{arch} {name}", run_one, args, arch, name))
    ]
    by = {(r["arch"], r["loader"]): r for r in study["runs"]}
    rows = []
    for (arch, loader), r in by.items():
        synthetic, torch_run = by.get((arch, "synthetic")), by.get((arch, "torch"))
        r["vs_synthetic_step"] = r["step_ms"] / synthetic["step_ms"] if synthetic else None
        r["vs_torch"] = r["train_images_per_s"] / torch_run["train_images_per_s"] if torch_run else None
        for key in ("step_ms", "train_images_per_s", "vs_synthetic_step", "vs_torch"):
            study.figure(f"{key}_{arch}_{loader}", r[key])
        rows.append([arch, loader, fmt(r["train_images_per_s"], ",.0f"), fmt(r["step_ms"], ".1f")])
        rows[-1] += [fmt(r.get("process_cpu_cores"), ".1f")]
        rows[-1] += [
            fmt(100 * r["input_wait_fraction"], ".1f") + "%",
            fmt(r["vs_synthetic_step"], ".3f") + "x",
            fmt(r["vs_torch"]) + "x",
        ]
        if loader.startswith("fastload") and arch == "resnet50" and r["vs_synthetic_step"]:
            study.verdict(
                f"ResNet-50 {loader} step <= 1.05x device-resident",
                r["vs_synthetic_step"] <= 1.05,
                f"{r['vs_synthetic_step']:.3f}x",
            )
        if loader.startswith("fastload") and arch == "resnet18" and r["vs_torch"]:
            study.verdict(f"ResNet-18 {loader} >= 2.5x torch DataLoader", r["vs_torch"] >= 2.5, f"{r['vs_torch']:.2f}x")
        if loader == "fastload" and (dali := by.get((arch, "dali"))):
            over = r["step_ms"] / dali["step_ms"]
            study.figure(f"step_over_dali_{arch}", over)
            value = f"{over:.3f}x of {dali['step_ms']:.1f} ms"
            study.verdict(f"{arch} fastload step <= DALI-fed step", over <= 1.0, value)
    if getattr(args, "dali_not_run", None):
        study["dali_not_run"] = args.dali_not_run
        rows.append(["*", "dali", "-", "-", "-", "-", "-", args.dali_not_run])
    heads = ["model", "loader", "train img/s", "step ms", "CPU cores", "input wait", "step vs synthetic", "vs torch"]
    title = f"examples/imagenet.py, batch {args.batch}, bf16 autocast, channels_last"
    return study.finish(table(heads, rows, title), plot=plot if study["runs"] else None)


if __name__ == "__main__":
    sys.exit(main())
