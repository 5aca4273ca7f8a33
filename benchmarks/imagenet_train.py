#!/usr/bin/env python3
"""End-to-end ImageNet-style training (examples/imagenet.py): train images/s and input wait,
fed by torch_fastload vs torch's DataLoader vs device-resident synthetic batches, one run.

Every configuration is a fresh ``examples/imagenet.py`` process on the same generated folder
(--classes x --per-class real-photo JPEGs, page cache hot after the first run), bf16 autocast,
channels_last, batch --batch, SGD; throughput counts the training steps after the first
--warmup-steps, epoch boundaries included, validation excluded. The warm-up covers the model's
first steps and fastload's one-time route trial (cpu_decode_share="auto": from the 9th batch
the CPU decoder, then nvJPEG if the loop waited, are timed for ~15 batches each; the decision
and its timings are printed), so the steps measured
are the steady state every configuration reaches; 3 epochs x 39 steps leave 72 of them.

  synthetic   one batch kept on the GPU: the model's step time with no input pipeline
  fastload    torch_fastload ImageFolder with its defaults (engine reads; the first batches time
              nvJPEG and the C++ CPU decoder and keep the faster; GPU augmentation)
  fastload-share-S (--share-too S[:THREADS[:PREFETCH]])  the same with cpu_decode_share=S (0: nvJPEG;
              1: every JPEG on the C++ CPU decoder; steal: work stealing between the two), and
              cpu_decode_threads / prefetch for that run only
  torch       torchvision ImageFolder + PIL + DataLoader(num_workers=--workers, pin_memory)

Targets (issue 4): ResNet-50 step time with fastload <= 1.05x the synthetic step; ResNet-18
fastload >= 2.5x the torch DataLoader version's train images/s.

    python benchmarks/imagenet_train.py               # ~5 min on the H100 machine
    python benchmarks/imagenet_train.py --share-too 0        # + nvJPEG alone, beside the default
    python benchmarks/imagenet_train.py --cpu-smoke   # no GPU: tiny model steps, code paths only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torch_fastload._benchutil import fmt, log, machine_info, table, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "imagenet-sample")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=45)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--archs", default="resnet50,resnet18")
    p.add_argument(
        "--share-too",
        metavar="SHARE[:THREADS[:PREFETCH]]",
        help="also run fastload with cpu_decode_share=SHARE (0: nvJPEG; 1: every JPEG on the C++ CPU "
        "decoder; steal: the two split each batch by work stealing), and for that run only "
        "cpu_decode_threads=THREADS and prefetch=PREFETCH, beside the default",
    )
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if args.cpu_smoke:
        args.classes, args.per_class, args.batch, args.epochs, args.warmup_steps, args.workers = 4, 4, 4, 1, 1, 2
        args.archs = "resnet18"
    args.out.mkdir(parents=True, exist_ok=True)
    common = [
        "--sample-dir",
        str(args.dir),
        "--sample-classes",
        str(args.classes),
        "--sample-train-per-class",
        str(args.per_class),
        "--sample-val-per-class",
        "10" if not args.cpu_smoke else "2",
        "--batch-size",
        str(args.batch),
        "--epochs",
        str(args.epochs),
        "--warmup-steps",
        str(args.warmup_steps),
        "--workers",
        str(args.workers),
        "--checkpoint-dir",
        str(args.dir) + "-checkpoints",
        "--no-progress",
    ]
    if args.cpu_smoke:
        common += ["--steps-per-epoch", "3", "--no-amp"]
    report = {
        "machine": machine_info(cuda),
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": [],
        "failures": [],
        "page_cache": "hot: the folder is generated (or read by an earlier run) first",
    }
    plan = []
    variant = "fastload-share-" + (args.share_too or "").replace(":", "-")  # the same loader, other settings
    variant_env = variant_settings(args.share_too) if args.share_too else {}
    for arch in args.archs.split(","):
        plan += [(arch, "synthetic"), (arch, "fastload")] + ([(arch, variant)] if args.share_too else [])
        plan += [(arch, "torch")]
    for arch, name in plan:
        loader = "fastload" if name == variant else name
        env = dict(os.environ, **variant_env) if name == variant else None
        out = args.out / f"train-{arch}-{name}.json"
        extra = [] if (arch == "resnet18" and name == "fastload") else ["--no-val"]
        cmd = [
            sys.executable,
            str(REPO / "examples" / "imagenet.py"),
            "--arch",
            arch,
            "--loader",
            loader,
            "--json",
            str(out),
            *common,
            *extra,
        ]
        settings = " ".join(f"{k}={v}" for k, v in variant_env.items()) + " " if env else ""
        log(f"-- {arch} {name}: {settings}{' '.join(cmd[1:])}")
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=1200, env=env)
        if res.returncode != 0 or not out.exists():
            report["failures"].append(
                {"arch": arch, "loader": name, "rc": res.returncode, "stderr": res.stderr[-3000:]}
            )
            log(f"   FAILED rc {res.returncode}\n{res.stderr[-3000:]}")
            continue
        result = json.loads(out.read_text())
        result["loader"] = name
        result["process_seconds"] = time.perf_counter() - t0
        report["runs"].append(result)
        log(
            f"   {result['train_images_per_s']:,.0f} images/s, step {result['step_ms']:.1f} ms, input wait "
            f"{100 * result['input_wait_fraction']:.1f}%"
            + (f", last val top-1 {result['history'][-1]['top1']:.1f}%" if result["history"] else "")
            + (f"\n   decode route: {result['decode_route']['measured']}" if result.get("decode_route") else "")
        )
    by = {(r["arch"], r["loader"]): r for r in report["runs"]}
    rows, verdicts = [], []
    for (arch, loader), r in by.items():
        synthetic = by.get((arch, "synthetic"))
        torch_run = by.get((arch, "torch"))
        r["vs_synthetic_step"] = r["step_ms"] / synthetic["step_ms"] if synthetic else None
        r["vs_torch"] = r["train_images_per_s"] / torch_run["train_images_per_s"] if torch_run else None
        rows.append(
            [
                arch,
                loader,
                fmt(r["train_images_per_s"], ",.0f"),
                fmt(r["step_ms"], ".1f"),
                fmt(100 * r["input_wait_fraction"], ".1f") + "%",
                fmt(r["vs_synthetic_step"], ".3f") + "x",
                fmt(r["vs_torch"], ".2f") + "x",
            ]
        )
    log("")
    log(
        table(
            ["model", "loader", "train img/s", "step ms", "input wait", "step vs synthetic", "vs torch"],
            rows,
            title=f"examples/imagenet.py, batch {args.batch}, bf16 autocast, channels_last",
        )
    )
    if cuda:
        for name in ("fastload", variant):
            r50, r18 = by.get(("resnet50", name)), by.get(("resnet18", name))
            if r50 and r50.get("vs_synthetic_step"):
                verdicts.append(
                    {
                        "target": f"ResNet-50 {name} step <= 1.05x device-resident",
                        "value": r50["vs_synthetic_step"],
                        "verdict": "PASS" if r50["vs_synthetic_step"] <= 1.05 else "FAIL",
                    }
                )
            if r18 and r18.get("vs_torch"):
                verdicts.append(
                    {
                        "target": f"ResNet-18 {name} >= 2.5x torch DataLoader",
                        "value": r18["vs_torch"],
                        "verdict": "PASS" if r18["vs_torch"] >= 2.5 else "FAIL",
                    }
                )
        for v in verdicts:
            log(f"{v['verdict']}: {v['target']} ({v['value']:.3f})")
    report["verdicts"] = verdicts
    write_json(args.out / "imagenet_train.json", report)
    plot(report, args.out / "imagenet_train.png")
    return 1 if report["failures"] else 0


def variant_settings(spec: str) -> dict:
    """``SHARE[:THREADS[:PREFETCH]]`` as the environment of the variant's run."""
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts):
        raise SystemExit(f"--share-too takes SHARE[:THREADS[:PREFETCH]], got {spec!r}")
    names = ("TORCH_FASTLOAD_CPU_DECODE_SHARE", "TORCH_FASTLOAD_CPU_DECODE_THREADS", "TORCH_FASTLOAD_PREFETCH")
    return dict(zip(names, parts))


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = report["runs"]
    if not runs:
        return
    archs = sorted({r["arch"] for r in runs})
    names = ["synthetic", "fastload"] + sorted({r["loader"] for r in runs if r["loader"].startswith("fastload-")})
    loaders = [name for name in names + ["torch"] if any(r["loader"] == name for r in runs)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(loaders)
    for k, loader in enumerate(loaders):
        values = [
            next((r["train_images_per_s"] for r in runs if r["arch"] == a and r["loader"] == loader), 0) for a in archs
        ]
        ax.bar([i + (k - (len(loaders) - 1) / 2) * width for i in range(len(archs))], values, width, label=loader)
    ax.set_xticks(range(len(archs)), archs)
    ax.set_ylabel("train images/s")
    ax.set_title("examples/imagenet.py: device-resident vs torch_fastload vs torch DataLoader")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
