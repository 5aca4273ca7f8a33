"""torch DataLoader vs torch_fastload.DataLoader on a generated image dataset, side by side.

    python -m torch_fastload.bench                  # GPU: 8192 images 3x128x128 (1.6 GB), 3 repeats, ~2-3 min
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

Each configuration runs ``--repeats`` times, the loaders taking turns (so drift in the
machine's speed is shared out). Reported per loader: the median samples/s and its spread
(min-max over the repeats), the input-wait fraction (time the loop spent blocked in ``next()``
plus the ``.to()`` call, over wall time), GB/s of input delivered and the speedup: the ratio of
medians over the best torch configuration; then ``loader.stats()`` of torch_fastload. A
"device-resident" row (the dataset already on the device) shows what the model alone can do;
fastload is compared with it round by round (the two runs of a round are back to back, so the
machine's drift between rounds cancels), and on a GPU the rounds' median ratio is judged against
``RESIDENT_FLOOR`` and fastload's input wait against ``WAIT_CEILING``. The JSON keeps every repeat.

Without CUDA everything runs on the CPU with smaller defaults (torch gets pin_memory=False),
which exercises the code paths; what the loader is built for (pinned memory, the host-to-device
copy and its overlap with the step) is absent there, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from torch_fastload._benchutil import (
    CudaSleeper,
    Progress,
    fmt,
    int_list,
    link_baseline,
    log,
    machine_info,
    resolve_device,
    table,
)
from torch_fastload._benchutil.workload import (
    ResidentLoader,
    SmallConvNet,
    StepClock,
    Trainer,
    make_dataset,
    time_compute_ms,
)

__all__ = ["main", "build_parser", "make_dataset", "SmallConvNet", "CudaSleeper"]

MiB = 1 << 20


def time_transfer_ms(nbytes: int, device: torch.device, reps: int = 10) -> float | None:
    """Median time of one pinned -> device copy of ``nbytes`` (the link at its best)."""
    return link_baseline(device, nbytes, reps)["copy_ms"] if device.type == "cuda" else None


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
    """``args.epochs`` epochs of the training loop over ``loader``; the first
    ``args.warmup_steps`` are not timed (see ``StepClock``). Input wait = time in
    ``iter()``/``next()`` plus the ``.to(device, non_blocking=True)`` calls."""
    total = len(loader) * args.epochs
    if total <= args.warmup_steps:
        raise SystemExit(
            f"{name}: {total} steps in {args.epochs} epoch(s) is not more than "
            f"--warmup-steps {args.warmup_steps}; use more --samples or --epochs"
        )
    clock = StepClock(args, device, fastload)
    bar = Progress(total, name, args.progress)
    first_loss = last_loss = None
    try:
        for _epoch in range(args.epochs):
            t0 = time.perf_counter()
            iterator = iter(loader)
            clock.waited(time.perf_counter() - t0)
            while True:
                t0 = time.perf_counter()
                try:
                    x, y = next(iterator)
                except StopIteration:
                    clock.waited(time.perf_counter() - t0)
                    break
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                clock.waited(time.perf_counter() - t0)
                clock.count(x, y)
                loss = trainer.step(x, y)
                if trainer.compute_ms is None:  # a busy kernel has no loss
                    first_loss = loss if first_loss is None else first_loss
                    last_loss = loss
                clock.step_done()
                bar.update()
            del iterator
        result = clock.stop(name)
    finally:
        bar.close()
    result["first_loss"] = float(first_loss) if first_loss is not None else None
    result["last_loss"] = float(last_loss) if last_loss is not None else None
    if fastload is not None:
        snapshot = fastload.stats()
        result["fastload_stats"] = snapshot.as_dict()
        result["_snapshot"] = snapshot
    return result


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
    g.add_argument("--epochs", type=int, default=None, help="[6 / 2]")
    g.add_argument("--warmup-steps", type=int, default=5, help="untimed steps at the start of each run")
    g.add_argument(
        "--repeats", type=int, default=3, help="runs of each loader (taking turns); median and min-max reported [3]"
    )
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
        "epochs": 6 if gpu else 2,
        "torch_workers": [0, 4] if gpu else [0, 2],
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("samples", "image_size", "channels", "classes", "batch_size", "epochs", "max_inflight", "repeats"):
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


def _print_table(runs: list[dict], baseline: dict | None) -> None:
    rows = []
    for r in runs:
        if r.get("error"):
            rows.append([r["name"], "error", "", "", "", "", "", ""])
            continue
        speedup = (
            r["samples_per_s"] / baseline["samples_per_s"]
            if baseline and baseline.get("samples_per_s") and r.get("samples_per_s")
            else None
        )
        low, high = r["samples_per_s_range"]
        rows.append(
            [
                r["name"],
                fmt(r["samples_per_s"], ",.0f"),
                f"{low:,.0f}-{high:,.0f}" if low is not None else "-",
                fmt(r["step_ms"], ".2f"),
                fmt(100 * r["wait_fraction"] if r["wait_fraction"] is not None else None, ".1f"),
                fmt(r["gbps"], ".2f"),
                fmt(speedup, ".2f") + ("x" if speedup else ""),
                fmt(r["last_loss"], ".4f"),
            ]
        )
    heads = ["loader", "samples/s (median)", "min-max", "step ms", "input wait %", "GB/s", "speedup", "final loss"]
    log(table(heads, rows))


MEDIAN_KEYS = ("samples_per_s", "step_ms", "wait_fraction", "gbps", "cpu_cores")


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _aggregate(name: str, repeats: list[dict]) -> dict:
    """One loader's figures over its repeats: the median of each, samples/s's min-max, and every
    repeat kept (``repeats``); an error if any repeat failed."""
    failed = [r for r in repeats if r.get("error")]
    if failed:
        return {**failed[0], "name": name, "repeats": repeats}
    speeds = [r["samples_per_s"] for r in repeats if r["samples_per_s"] is not None]
    out = {"name": name, "steps": repeats[0]["steps"], "samples": repeats[0]["samples"]}
    out.update({key: _median([r.get(key) for r in repeats]) for key in MEDIAN_KEYS})
    out["samples_per_s_range"] = (min(speeds), max(speeds)) if speeds else (None, None)
    out["spread"] = (
        (max(speeds) - min(speeds)) / out["samples_per_s"] if len(speeds) > 1 and out["samples_per_s"] else 0.0
    )
    out["first_loss"], out["last_loss"] = repeats[-1]["first_loss"], repeats[-1]["last_loss"]
    if "fastload_stats" in repeats[-1]:
        out["fastload_stats"] = repeats[-1]["fastload_stats"]
    out["repeats"] = repeats
    return out


# The promise the main job checks on a GPU: the loader keeps a launch-bound step at the model's
# own pace (samples/s at least this share of the device-resident run's) ...
RESIDENT_FLOOR = 0.95
# ... and the loop spends at most this share of its wall time in next() and .to().
WAIT_CEILING = 0.03


def against_resident(runs: list[dict]) -> dict | None:
    """torch_fastload against the device-resident run: the ratio of the medians, and each round's
    ratio (the two runs of a round are back to back, so a drift of the machine's speed between
    rounds, 20% on the H100s, cancels in the round's ratio; their median is the figure the floor
    is judged on); the input waits of both. None without both runs' samples/s."""
    fast = next((r for r in runs if r["name"].startswith("torch_fastload") and not r.get("error")), None)
    resident = next((r for r in runs if r["name"].startswith("device-resident") and not r.get("error")), None)
    if fast is None or resident is None or not resident["samples_per_s"]:
        return None
    rounds = [
        a["samples_per_s"] / b["samples_per_s"]
        for a, b in zip(fast["repeats"], resident["repeats"])
        if a.get("samples_per_s") and b.get("samples_per_s")
    ]
    if not rounds:
        return None
    return {
        "ratio_of_medians": fast["samples_per_s"] / resident["samples_per_s"],
        "round_ratios": rounds,
        "paired_ratio": _median(rounds),
        "wait_fraction": fast["wait_fraction"],
        "resident_wait_fraction": resident["wait_fraction"],
    }


def _log_against_resident(vs: dict, device: torch.device) -> None:
    rounds = ", ".join(f"{r:.3f}x" for r in vs["round_ratios"])
    log(
        f"torch_fastload vs device-resident: {vs['ratio_of_medians']:.3f}x the median samples/s; "
        f"round by round {rounds} (median {vs['paired_ratio']:.3f}x); input wait "
        f"{100 * vs['wait_fraction']:.1f}% vs the resident loop's own {100 * vs['resident_wait_fraction']:.1f}%"
    )
    if device.type != "cuda":
        return
    verdict = "PASS" if vs["paired_ratio"] >= RESIDENT_FLOOR else "FAIL"
    floor = f">= {RESIDENT_FLOOR:.2f}x device-resident samples/s (rounds' median)"
    log(f"{verdict}  torch_fastload {floor}: {vs['paired_ratio']:.3f}x")
    verdict = "PASS" if vs["wait_fraction"] <= WAIT_CEILING else "FAIL"
    log(f"{verdict}  torch_fastload input wait <= {100 * WAIT_CEILING:.0f}%: {100 * vs['wait_fraction']:.1f}%")


def _calibrate(args, device: torch.device, dataset) -> tuple[int, dict, CudaSleeper | None, dict | None]:
    """The conv net's width (or the busy kernel), logged with the pinned copy of a batch."""
    sleeper = sleep_cal = None
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
        return width, calibration, sleeper, sleep_cal
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
    return width, calibration, sleeper, sleep_cal


def _loaders(args, device: torch.device, dataset) -> list[tuple]:
    """``(name, make_loader, is_fastload)`` for every run: each torch worker count, fastload, and
    the device-resident reference."""
    import torch_fastload

    pin = device.type == "cuda"
    runs = [
        (
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
            False,
        )
        for workers in args.torch_workers
    ]
    threads = args.stage_threads if args.stage_threads is not None else torch_fastload.config.get("stage_threads")
    fastload = lambda: torch_fastload.DataLoader(  # noqa: E731
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
    )
    runs.append((f"torch_fastload (workers={args.fastload_workers}, stage_threads={threads})", fastload, True))
    if args.resident:
        resident = lambda: ResidentLoader(dataset, args.batch_size, device, args.seed)  # noqa: E731
        runs.append(("device-resident (model alone)", resident, False))
    return runs


def _run_all(args, device: torch.device, dataset, width: int, sleeper) -> tuple[list[dict], object]:
    """Every loader's runs, ``args.repeats`` rounds with the loaders taking turns (a failed run
    is reported as such), aggregated per loader; fastload's last stats snapshot."""
    loaders = _loaders(args, device, dataset)
    repeats: dict[str, list] = {name: [] for name, _, _ in loaders}
    snapshot = None
    for round_ in range(args.repeats):
        if args.repeats > 1:
            log(f"round {round_ + 1} of {args.repeats}")
        for name, make_loader, fastload in loaders:
            loader = None
            try:
                loader = make_loader()
                trainer = Trainer(args, device, width, sleeper)
                result = train_run(name, loader, trainer, args, device, fastload=loader if fastload else None)
                if fastload:
                    snapshot = result.pop("_snapshot")
                log(f"  {name}: {result['samples_per_s']:,.0f} samples/s")
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
            repeats[name].append(result)
    return [_aggregate(name, runs) for name, runs in repeats.items()], snapshot


def _summary(args, device: torch.device, machine: dict, runs: list[dict], snapshot) -> tuple:
    """The results table and the lines after it; the baseline run, fastload's speedup and its
    comparison with the device-resident run (``against_resident``)."""
    torch_runs = [r for r in runs if r["name"].startswith("torch DataLoader") and not r.get("error")]
    baseline = max(torch_runs, key=lambda r: r["samples_per_s"] or 0) if torch_runs else None
    fast = next((r for r in runs if r["name"].startswith("torch_fastload") and not r.get("error")), None)
    speedup = (
        fast["samples_per_s"] / baseline["samples_per_s"] if fast and baseline and baseline["samples_per_s"] else None
    )
    log()
    log(
        f"results ({device}; {args.repeats} run(s) per loader, {runs[0].get('steps', '?')} timed steps each after "
        f"warm-up; medians, speedup = ratio of medians vs {baseline['name'] if baseline else 'n/a'})"
    )
    _print_table(runs, baseline)
    if fast and baseline:
        low = fast["samples_per_s_range"][0] / baseline["samples_per_s_range"][1]
        high = fast["samples_per_s_range"][1] / baseline["samples_per_s_range"][0]
        log(
            f"torch_fastload: {speedup:.2f}x the median samples/s of the best torch DataLoader "
            f"(slowest vs fastest repeat {low:.2f}x, fastest vs slowest {high:.2f}x); input wait "
            f"{100 * fast['wait_fraction']:.1f}% vs {100 * baseline['wait_fraction']:.1f}% of wall time"
        )
    vs = against_resident(runs)
    if vs is not None:
        _log_against_resident(vs, device)
    noisy = [r["name"] for r in runs if not r.get("error") and r.get("spread", 0) > 0.2]
    if noisy:
        log(
            f"spread: {', '.join(noisy)} varied by more than 20% of the median between repeats; the ratio is "
            "not a stable figure here (an idle machine or more --repeats narrow it)"
        )
    losses = [r["last_loss"] for r in runs if r.get("last_loss") is not None and not r["name"].startswith("device")]
    if args.compute_ms is None and len(losses) > 1:
        log(
            f"final losses of the loader runs (same batches, same initial weights): "
            f"{', '.join(f'{v:.4f}' for v in losses)}"
        )
    if device.type == "cpu":
        cores = machine["cpu_affinity"] or machine["cpu_count"]
        log(
            "what these CPU figures mean: no GPU, so none of what torch_fastload is built for is measured: "
            "no pinned memory, no host-to-device copy and no overlap of that copy with the step. They time "
            f"each loader's batching and threads competing with the model's {torch.get_num_threads()} intra-op "
            f"threads for {cores} cores: a check that every loader runs and trains identically, not a speedup "
            "you will see on a GPU (python -m torch_fastload.bench on a CUDA machine measures that)."
        )
    if snapshot is not None:
        log()
        log(str(snapshot))
    return baseline, speedup, vs


def main(argv=None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    device = resolve_device(args.device)
    _finish_args(args, device)
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
    width, calibration, sleeper, sleep_cal = _calibrate(args, device, dataset)
    runs, snapshot = _run_all(args, device, dataset, width, sleeper)
    baseline, speedup, vs_resident = _summary(args, device, machine, runs, snapshot)

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
            "vs_resident": vs_resident,
            "elapsed_s": elapsed,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        log(f"wrote {args.json}")
    return 1 if any(r.get("error") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
