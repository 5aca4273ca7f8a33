#!/usr/bin/env python3
"""torch_fastload overlap study: does a training step fed by the loader run as fast as one fed
from data already on the GPU?

Data: an in-memory map-style dataset (``TensorDataset``) of pageable float32 rows + int64
labels; batches of ``--batch`` rows of each ``--row-sizes`` (default 64 x 1 MiB = 64 MiB and
64 x 256 KiB = 16 MiB batches). Compute: a residual MLP over the batch viewed as tokens
(``[batch * row / d, d]``; LayerNorm -> Linear(d, h) -> GELU -> Linear(h, d), bf16 autocast,
forward + backward + fused AdamW), its hidden width ``h`` calibrated so one step takes
``--ratios`` x the pinned H2D time of one batch; ratio 0 is the pure-input run, where the
consumer only touches the batch (a small kernel reading it). Feeds, each run for the same
number of steps after untimed warm-up steps:

  resident       batches pre-staged on the GPU, cycled: the ideal
  resident+h2d   resident, plus one raw pinned H2D copy of a batch per step on a side stream
                 (consumed two steps later): the hardware's own price for overlapping a copy
  torch          torch.utils.data.DataLoader(pin_memory=True, num_workers=N) and
                 ``.cuda(non_blocking=True)`` in the loop, N in --torch-workers; best is kept
  fastload       torch_fastload.DataLoader(num_workers=0, stage_threads=T), T in
                 --stage-threads; best is kept

Also measured in the same run: raw pinned H2D GB/s (``torch.empty(pin_memory=True)`` ->
cuda copy) for each batch size, the link's ceiling; and process CPU time (this process and
its worker processes) to report CPU cores used per GB/s delivered.

Targets (the issue's):
  T1  step time with torch_fastload <= 1.05 x device-resident when compute >= transfer time
  T2  torch_fastload samples/s >= 2 x the best torch DataLoader (batches >= 16 MiB)
  T3  pure input: pageable batches reach >= 40 GB/s into the GPU with <= 8 staging threads

    python benchmarks/overlap.py                  # ~2-4 min on one H100
    python benchmarks/overlap.py --quick          # <= ~1 min
    python benchmarks/overlap.py --cpu-smoke --quick    # no GPU: tiny sizes, code paths only

Prints one line per run, detail tables, then the summary table and the PASS/FAIL verdicts
last; writes overlap.json (every number, machine, date, command) and overlap.png to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout, not some installed copy

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.data as tud  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload._benchutil import (
    InflightWindow,
    Progress,
    cpu_seconds,
    error_text,
    float_list,  # noqa: E402
    fmt,
    int_list,
    log,
    machine_info,
    sync,
    table,
    write_json,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TARGET_T1 = 1.05
TARGET_T2 = 2.0
TARGET_T3_GBPS = 40.0
TARGET_T3_THREADS = 8


# --------------------------------------------------------------------------------------------
# argument parsing helpers
# --------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'1MiB', '256KiB', '64M', '1G'; a bare number means bytes."""
    s = str(text).strip().lower()
    for suffix, mult in (("gib", GiB), ("g", GiB), ("mib", MiB), ("m", MiB), ("kib", KiB), ("k", KiB), ("b", 1)):
        if s.endswith(suffix):
            s, unit = s[: -len(suffix)], mult
            break
    else:
        unit = 1
    try:
        value = int(float(s) * unit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r} (try 1MiB, 256KiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    return [parse_size(v) for v in text.split(",") if v.strip()]


def fmt_size(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------------------------
# dataset, sampler, model
# --------------------------------------------------------------------------------------------
def make_rows(rows: int, row_elems: int, seed: int) -> tud.TensorDataset:
    """Pageable float32 rows (uniform noise, every page touched) and int64 labels."""
    g = torch.Generator().manual_seed(seed)
    data = torch.empty(rows, row_elems, dtype=torch.float32)
    chunk = max(1, (256 * MiB) // (row_elems * 4))
    for start in range(0, rows, chunk):
        data[start : start + chunk].uniform_(-1.0, 1.0, generator=g)
    labels = torch.randint(0, 1000, (rows,), generator=g, dtype=torch.int64)
    return tud.TensorDataset(data, labels)


class EpochsSampler(tud.Sampler):
    """``total`` indices: seeded random permutations of the dataset, concatenated."""

    def __init__(self, n: int, total: int, seed: int):
        self.n, self.total, self.seed = n, total, seed

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        emitted = 0
        while emitted < self.total:
            perm = torch.randperm(self.n, generator=g).tolist()[: self.total - emitted]
            emitted += len(perm)
            yield from perm


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPStep:
    """forward + backward + AdamW of a residual MLP on the batch viewed as [tokens, d].

    On CUDA the whole step is captured in a CUDA graph (the documented whole-network pattern:
    warm-up on a side stream, ``capturable`` fused AdamW, autocast cache off) and each call is
    ``static_input.copy_(x)`` + ``replay()``: step time is then GPU time, not Python launch
    overhead, which would otherwise dominate and compete with the loader's threads for the GIL
    (``--eager`` measures that case). If capture fails the step runs eagerly and says why.
    """

    def __init__(
        self,
        d: int,
        hidden: int,
        layers: int,
        device: torch.device,
        amp: bool,
        seed: int,
        batch_shape: tuple | None = None,
        graph: bool = False,
    ):
        self.d, self.hidden, self.layers, self.device, self.seed = d, hidden, layers, device, seed
        self.amp = amp and device.type == "cuda"
        self.graph = None
        self.graph_error = None
        want_graph = graph and device.type == "cuda" and batch_shape is not None
        self._build(capturable=want_graph)
        if want_graph:
            try:
                self._capture(batch_shape)
            except Exception as exc:  # fall back to eager, from fresh state
                self.graph_error = error_text(exc)
                self.graph = None
                torch.cuda.synchronize()
                self._build(capturable=False)

    @property
    def mode(self) -> str:
        if self.graph is not None:
            return "cuda graph"
        return "eager" + (f" (graph capture failed: {self.graph_error})" if self.graph_error else "")

    def _build(self, capturable: bool) -> None:
        torch.manual_seed(self.seed)
        self.model = nn.Sequential(*[Block(self.d, self.hidden) for _ in range(self.layers)]).to(self.device)
        params = list(self.model.parameters())
        self.params = sum(p.numel() for p in params)
        cuda = self.device.type == "cuda"
        try:
            self.opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda, capturable=capturable)
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(params, lr=1e-4, foreach=cuda, capturable=capturable)

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp, cache_enabled=False):
            return self.model(x.view(-1, self.d)).float().square().mean()

    def _eager(self, x: torch.Tensor) -> None:
        self._loss(x).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _capture(self, batch_shape: tuple) -> None:
        self.static = torch.zeros(batch_shape, dtype=torch.float32, device=self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._eager(self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._loss(self.static).backward()
            self.opt.step()
        graph.replay()  # one real run, so a broken capture shows up here and not mid-measurement
        torch.cuda.synchronize()
        self.graph = graph

    def __call__(self, x: torch.Tensor) -> None:
        if self.graph is None:
            self._eager(x)
            return
        self.static.copy_(x.view(self.static.shape))
        self.graph.replay()


class TouchStep:
    """The pure-input consumer: one small kernel that reads 4096 elements spread over the batch
    (so the step depends on the batch having arrived) and accumulates them."""

    def __init__(self, device: torch.device):
        self.acc = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        self.acc += flat[:: max(1, flat.numel() // 4096)].sum()


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------
def measure_link(nbytes: int, device: torch.device, reps: int) -> dict:
    """Raw H2D from fresh pinned memory (``torch.empty(pin_memory=True)``), the link's ceiling:
    CUDA events around back-to-back copies (>= 256 MiB per sample), median GB/s; and the median
    time of one copy. On the CPU smoke: a pageable memcpy instead."""
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times[1:])
        return {
            "what": "CPU memcpy (smoke: no GPU)",
            "bytes": nbytes,
            "gbps": nbytes / seconds / 1e9,
            "copy_ms": seconds * 1e3,
            "samples_gbps": [nbytes / t / 1e9 for t in times[1:]],
        }
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    inner = max(1, min(64, (256 * MiB) // nbytes))
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    sync(device)
    samples, singles = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(nbytes * inner / (start.elapsed_time(end) / 1e3) / 1e9)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        singles.append(start.elapsed_time(end))
    ok = int(dst[0].item()) == 1 and int(dst[-1].item()) == 1
    del src, dst
    return {
        "what": "pinned (torch.empty(pin_memory=True)) -> cuda, copy_(non_blocking=True)",
        "bytes": nbytes,
        "inner": inner,
        "gbps": statistics.median(samples),
        "best_gbps": max(samples),
        "copy_ms": statistics.median(singles),
        "samples_gbps": samples,
        "bytes_verified": ok,
    }


def step_ms(fn, x: torch.Tensor, device: torch.device, min_total_ms: float = 150.0) -> float:
    """Mean time of ``fn(x)`` (x already on the device), after warm-up; CUDA events on the GPU."""
    for _ in range(3):
        fn(x)
    sync(device)

    def timed(n: int) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn(x)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x)
        return (time.perf_counter() - t0) * 1e3 / n

    first = timed(3)
    n = int(max(5, min(200, math.ceil(min_total_ms / max(first, 1e-3)))))
    return timed(n)


def calibrate(target_ms: float, x: torch.Tensor, args, device: torch.device, bar: Progress) -> dict:
    """Hidden width ``h`` whose MLP step on ``x`` takes ~``target_ms``: time two widths, fit
    ms = a + b*h, solve, then correct up to twice with the measured error."""
    gpu = device.type == "cuda"
    quantum, lo, hi, h_min, h_max = (128, 1024, 4096, 128, 65536) if gpu else (16, 32, 128, 16, 4096)
    history = []

    def measure(h: int) -> float:
        step = MLPStep(
            args.model_dim, h, args.layers, device, args.amp == "bf16", args.seed, tuple(x.shape), graph=not args.eager
        )
        ms = step_ms(step, x, device)
        history.append({"hidden": h, "ms": ms, "mode": step.mode})
        del step
        bar.update()
        return ms

    def clamp(h: float) -> int:
        return int(min(h_max, max(h_min, round(h / quantum) * quantum)))

    t_lo, t_hi = measure(lo), measure(hi)
    slope = (t_hi - t_lo) / (hi - lo)
    if slope <= 0:
        slope = max(t_hi, 1e-3) / hi
    h = clamp(lo + (target_ms - t_lo) / slope)
    ms = measure(h)
    for _ in range(2):
        if abs(ms / target_ms - 1) <= 0.05:
            break
        h_new = clamp(h + (target_ms - ms) / slope)
        if h_new == h:
            break
        h = h_new
        ms = measure(h)
    best = min(history, key=lambda e: abs(e["ms"] - target_ms))
    return {"target_ms": target_ms, "hidden": best["hidden"], "compute_ms": best["ms"], "history": history}


# --------------------------------------------------------------------------------------------
# feeds and the measured loop
# --------------------------------------------------------------------------------------------
class Feed:
    """What one run consumes: ``next()`` returns a batch's x on the device."""

    name = "feed"
    loader = None

    def next(self) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ResidentFeed(Feed):
    def __init__(self, batches: list[torch.Tensor]):
        self.name, self.batches, self.i = "resident", batches, 0

    def next(self):
        x = self.batches[self.i % len(self.batches)]
        self.i += 1
        return x


class ResidentCopyFeed(ResidentFeed):
    """Resident batches, plus per step one raw pinned H2D copy of a batch on a side stream that
    the consumer waits for two steps later (an ideal prefetching loader with no host cost)."""

    def __init__(self, batches: list[torch.Tensor], nbytes: int, device: torch.device):
        super().__init__(batches)
        self.name = "resident+h2d"
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.dst = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(3)]
        self.stream = torch.cuda.Stream(device=device)
        self.events: list = []

    def next(self):
        consumer = torch.cuda.current_stream()
        slot = self.i % len(self.dst)  # nothing reads dst, so rotating needs no stream wait
        with torch.cuda.stream(self.stream):
            self.dst[slot].copy_(self.src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.events.append(done)
        del self.events[:-3]
        if len(self.events) == 3:
            consumer.wait_event(self.events[0])  # the batch copied two steps ago is consumed now
        return super().next()

    def close(self):
        torch.cuda.synchronize()


class LoaderFeed(Feed):
    def __init__(self, name: str, loader, device: torch.device, move: bool):
        self.name, self.loader, self.device, self.move = name, loader, device, move
        self.iterator = iter(loader)

    def next(self):
        x, y = next(self.iterator)
        if self.move:  # torch: the copy is issued in the loop, as users write it
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
        return x

    def close(self):
        self.iterator = None
        if hasattr(self.loader, "close"):
            self.loader.close()
        self.loader = None


def run_feed(
    feed_factory, step, steps: int, args, device: torch.device, batch_bytes: int, samples: int, desc: str
) -> dict:
    """``warmup + steps`` training steps; the clock (and the CPU-time counters, and the loader's
    stats) start after the warm-up and a device synchronize, and stop after a synchronize."""
    faulthandler.dump_traceback_later(args.run_timeout, exit=True)  # a hung loader must not hang the study
    feed = None
    bar = Progress(args.warmup + steps, desc, args.progress)
    try:
        feed = feed_factory()
        window = InflightWindow(device, args.max_inflight)
        wait = 0.0
        started = cpu0 = 0.0
        for i in range(args.warmup + steps):
            if i == args.warmup:
                window.drain()
                if isinstance(feed.loader, torch_fastload.DataLoader):
                    feed.loader.stats(reset=True)
                cpu0 = cpu_seconds()
                started = time.perf_counter()
            t0 = time.perf_counter()
            x = feed.next()
            if i >= args.warmup:
                wait += time.perf_counter() - t0
            step(x)
            window.step_done()
            bar.update()
        window.drain()
        wall = time.perf_counter() - started
        cpu = cpu_seconds() - cpu0
        nbytes = steps * batch_bytes
        gbps = nbytes / wall / 1e9
        result = {
            "steps": steps,
            "wall_s": wall,
            "step_ms": 1e3 * wall / steps,
            "samples_per_s": steps * samples / wall,
            "gbps": gbps,
            "wait_s": wait,
            "wait_fraction": wait / wall,
            "cpu_s": cpu,
            "cpu_cores": cpu / wall,
            "cores_per_gbps": (cpu / wall) / gbps if gbps > 0 else None,
        }
        # this process's CPU time is exact (process_time); worker processes' comes in 10 ms clock ticks
        if wall < (0.1 if getattr(feed.loader, "num_workers", 0) > 0 else 0.01):
            result.update(
                cpu_cores=None, cores_per_gbps=None, cpu_note=f"run too short ({wall * 1e3:.1f} ms) to measure CPU time"
            )
        if isinstance(feed.loader, torch_fastload.DataLoader):
            snapshot = feed.loader.stats()
            result["fastload_stats"] = snapshot.as_dict()
            result["fastload_stats_text"] = str(snapshot)
        return result
    finally:
        bar.close()
        if feed is not None:
            feed.close()
        faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------------------------
# the study
# --------------------------------------------------------------------------------------------
def study_row_size(row_bytes: int, args, device: torch.device, results: dict, save) -> dict:
    gpu = device.type == "cuda"
    row_elems = row_bytes // 4
    if row_bytes % 4 or row_elems % args.model_dim:
        raise ValueError(f"row size {row_bytes} B is not a whole number of {args.model_dim}-float tokens")
    batch = args.batch
    x_bytes = batch * row_bytes
    batch_bytes = x_bytes + batch * 8  # rows + int64 labels: what a loader delivers per step
    rows = max(batch * 2, args.data_bytes // row_bytes)
    steps = max(args.min_steps, math.ceil(args.run_bytes / batch_bytes))
    torch_steps = max(args.min_steps, math.ceil(args.torch_run_bytes / batch_bytes))
    entry: dict = {
        "row_bytes": row_bytes,
        "batch": batch,
        "batch_bytes": batch_bytes,
        "rows": rows,
        "dataset_bytes": rows * (row_bytes + 8),
        "steps": steps,
        "torch_steps": torch_steps,
        "warmup": args.warmup,
        "cases": [],
        "errors": {},
    }
    results["row_sizes"].append(entry)
    label = f"{fmt_size(row_bytes)} rows x {batch} = {fmt_size(x_bytes) if x_bytes % MiB == 0 else f'{x_bytes / MiB:.1f} MiB'}"
    log(
        f"\n=== {label} batches: dataset {rows} rows = {rows * row_bytes / GiB:.2f} GiB pageable, "
        f"{steps} timed steps per run, {torch_steps} for torch (+{args.warmup} warm-up) ==="
    )

    t0 = time.perf_counter()
    dataset = make_rows(rows, row_elems, args.seed)
    entry["dataset_gen_s"] = time.perf_counter() - t0

    link = measure_link(batch_bytes, device, args.link_reps)
    entry["link"] = link
    transfer_ms = batch_bytes / (link["gbps"] * 1e9) * 1e3
    entry["transfer_ms"] = transfer_ms
    log(
        f"link ceiling: {link['what']}: {link['gbps']:.2f} GB/s for {batch_bytes / MiB:.1f} MiB "
        f"-> transfer of one batch {transfer_ms:.3f} ms (one copy timed alone: {link['copy_ms']:.3f} ms)"
    )
    save()

    # the batches every feed sees first, pre-staged on the device for the resident feeds
    order = EpochsSampler(rows, batch * args.resident_batches, args.seed)
    idx = list(order)
    resident = [dataset.tensors[0][idx[i * batch : (i + 1) * batch]].to(device) for i in range(args.resident_batches)]

    for ratio in args.ratios:
        case: dict = {"ratio": ratio, "runs": [], "errors": {}}
        entry["cases"].append(case)
        if ratio > 0:
            bar = Progress(5, f"calibrating compute {ratio:g}x", args.progress)
            try:
                cal = calibrate(ratio * transfer_ms, resident[0], args, device, bar)
            finally:
                bar.close()
            case["calibration"] = cal
            case["hidden"] = cal["hidden"]
            case["compute_ms"] = cal["compute_ms"]
            case["achieved_ratio"] = cal["compute_ms"] / transfer_ms
            step = MLPStep(
                args.model_dim,
                cal["hidden"],
                args.layers,
                device,
                args.amp == "bf16",
                args.seed,
                tuple(resident[0].shape),
                graph=not args.eager,
            )
            case["params"] = step.params
            case["step_mode"] = step.mode
            log(
                f"-- compute {ratio:g}x transfer: MLP {args.layers} x [{args.model_dim} -> {cal['hidden']} -> "
                f"{args.model_dim}] ({step.params / 1e6:.1f} M params, "
                f"{'bf16 autocast' if step.amp else 'fp32'}, {step.mode}), tokens {batch * row_elems // args.model_dim}: "
                f"{cal['compute_ms']:.3f} ms/step = {case['achieved_ratio']:.2f}x transfer"
            )
        else:
            step = TouchStep(device)
            case["compute_ms"] = step_ms(step, resident[0], device, min_total_ms=30.0)
            case["achieved_ratio"] = 0.0
            log(f"-- pure input (consumer only touches the batch: {case['compute_ms']:.3f} ms/step)")
        save()

        feeds = [("resident", {}, lambda: ResidentFeed(resident))]
        if gpu:
            feeds.append(("resident+h2d", {}, lambda: ResidentCopyFeed(resident, batch_bytes, device)))
        for n in args.torch_workers:
            feeds.append(
                (
                    "torch",
                    {"num_workers": n},
                    lambda n=n: LoaderFeed(
                        f"torch w={n}",
                        tud.DataLoader(
                            dataset,
                            batch_size=batch,
                            sampler=EpochsSampler(rows, (args.warmup + torch_steps) * batch, args.seed),
                            num_workers=n,
                            pin_memory=gpu,
                            drop_last=True,
                        ),
                        device,
                        move=True,
                    ),
                )
            )
        for t in args.stage_threads:
            feeds.append(
                (
                    "fastload",
                    {"stage_threads": t},
                    lambda t=t: LoaderFeed(
                        f"fastload T={t}",
                        torch_fastload.DataLoader(
                            dataset,
                            batch_size=batch,
                            sampler=EpochsSampler(rows, (args.warmup + steps) * batch, args.seed),
                            num_workers=0,
                            drop_last=True,
                            device=device,
                            stage_threads=t,
                            **args.loader_kwargs,
                        ),
                        device,
                        move=False,
                    ),
                )
            )

        for kind, params, factory in feeds:
            repeats = 1 if kind == "torch" else args.repeats
            desc = f"{fmt_size(row_bytes)} r={ratio:g} {kind} {' '.join(f'{k}={v}' for k, v in params.items())}"
            best = None
            tries = []
            for rep in range(repeats):
                try:
                    res = run_feed(
                        factory,
                        step,
                        torch_steps if kind == "torch" else steps,
                        args,
                        device,
                        batch_bytes,
                        batch,
                        desc.strip(),
                    )
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    case["errors"][desc] = {"error": error_text(exc), "traceback": traceback.format_exc()}
                    log(f"   {desc}: FAILED {error_text(exc)}")
                    break
                tries.append(res["step_ms"])
                if best is None or res["step_ms"] < best["step_ms"]:
                    best = res
            if best is None:
                continue
            best.update(kind=kind, params=params, repeats_step_ms=tries)
            case["runs"].append(best)
            log(
                f"   {kind:<13} {' '.join(f'{k}={v}' for k, v in params.items()):<16} "
                f"{best['step_ms']:8.3f} ms/step  {best['samples_per_s']:9,.0f} samples/s  "
                f"{best['gbps']:6.2f} GB/s  wait {100 * best['wait_fraction']:5.1f}%  "
                f"{fmt(best['cpu_cores'], '5.2f', '    -')} cores"
            )
            save()
        del step
        gc.collect()
        summarize_case(case, entry)
        save()

    del resident, dataset
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            try:
                empty_host()
            except Exception:
                pass
    return entry


def best_of(case: dict, kind: str) -> dict | None:
    runs = [r for r in case["runs"] if r["kind"] == kind]
    return min(runs, key=lambda r: r["step_ms"]) if runs else None


def summarize_case(case: dict, entry: dict) -> None:
    res, fl, tb, rh = (best_of(case, k) for k in ("resident", "fastload", "torch", "resident+h2d"))
    ceiling = entry["link"]["gbps"]
    case["best"] = {
        "resident_step_ms": res and res["step_ms"],
        "resident_h2d_step_ms": rh and rh["step_ms"],
        "torch_step_ms": tb and tb["step_ms"],
        "torch_params": tb and tb["params"],
        "torch_samples_per_s": tb and tb["samples_per_s"],
        "torch_gbps": tb and tb["gbps"],
        "fastload_step_ms": fl and fl["step_ms"],
        "fastload_params": fl and fl["params"],
        "fastload_samples_per_s": fl and fl["samples_per_s"],
        "fastload_gbps": fl and fl["gbps"],
        "fastload_over_resident": (fl["step_ms"] / res["step_ms"]) if (fl and res) else None,
        "fastload_over_resident_h2d": (fl["step_ms"] / rh["step_ms"]) if (fl and rh) else None,
        "fastload_vs_torch": (fl["samples_per_s"] / tb["samples_per_s"]) if (fl and tb) else None,
        "fastload_of_ceiling": (fl["gbps"] / ceiling) if (fl and ceiling) else None,
        "torch_of_ceiling": (tb["gbps"] / ceiling) if (tb and ceiling) else None,
        "fastload_cores_per_gbps": fl and fl["cores_per_gbps"],
        "torch_cores_per_gbps": tb and tb["cores_per_gbps"],
    }


# --------------------------------------------------------------------------------------------
# verdicts, tables, plot
# --------------------------------------------------------------------------------------------
def verdicts(results: dict) -> list[dict]:
    """One entry per target: PASS / FAIL / NOT RUN, with the evidence."""
    out = []
    t1, t2, t3 = [], [], []
    for entry in results["row_sizes"]:
        rs = fmt_size(entry["row_bytes"])
        for case in entry["cases"]:
            b = case.get("best") or {}
            if case["ratio"] >= 1 and b.get("fastload_over_resident") is not None:
                t1.append(
                    (
                        b["fastload_over_resident"] <= TARGET_T1,
                        f"{rs} rows, compute {case['achieved_ratio']:.2f}x transfer: "
                        f"{b['fastload_over_resident']:.3f}x resident",
                    )
                )
            if entry["batch_bytes"] >= 16 * MiB and b.get("fastload_vs_torch") is not None:
                t2.append(
                    (
                        b["fastload_vs_torch"] >= TARGET_T2,
                        f"{rs} rows, compute {case['ratio']:g}x: {b['fastload_vs_torch']:.2f}x torch "
                        f"(torch num_workers={(b['torch_params'] or {}).get('num_workers')})",
                    )
                )
            if case["ratio"] == 0:
                runs = [
                    r
                    for r in case["runs"]
                    if r["kind"] == "fastload" and r["params"]["stage_threads"] <= TARGET_T3_THREADS
                ]
                if runs:
                    top = max(runs, key=lambda r: r["gbps"])
                    enough = [r for r in runs if r["gbps"] >= TARGET_T3_GBPS]
                    fewest = min(enough, key=lambda r: r["params"]["stage_threads"]) if enough else None
                    t3.append(
                        (
                            top["gbps"] >= TARGET_T3_GBPS,
                            f"{rs} rows: {top['gbps']:.1f} GB/s at {top['params']['stage_threads']} threads "
                            f"({100 * top['gbps'] / entry['link']['gbps']:.0f}% of pinned "
                            f"{entry['link']['gbps']:.1f}), {fmt(top['cores_per_gbps'], '.3f')} cores per GB/s"
                            + (
                                f"; >= {TARGET_T3_GBPS:g} from {fewest['params']['stage_threads']} threads"
                                if fewest
                                else ""
                            ),
                        )
                    )
    specs = [
        ("T1", f"step time with torch_fastload <= {TARGET_T1}x device-resident when compute >= transfer", t1),
        ("T2", f"torch_fastload samples/s >= {TARGET_T2:g}x best torch DataLoader (batches >= 16 MiB)", t2),
        ("T3", f"pure input: >= {TARGET_T3_GBPS:g} GB/s into the GPU with <= {TARGET_T3_THREADS} staging threads", t3),
    ]
    for key, text, items in specs:
        verdict = "NOT RUN" if not items else ("PASS" if all(ok for ok, _ in items) else "FAIL")
        out.append(
            {
                "target": key,
                "text": text,
                "verdict": verdict,
                "cases": [{"pass": ok, "evidence": ev} for ok, ev in items],
            }
        )
    return out


def detail_tables(results: dict) -> str:
    lines = []
    for entry in results["row_sizes"]:
        rows = []
        for case in entry["cases"]:
            for r in case["runs"]:
                rows.append(
                    [
                        f"{case['ratio']:g}x",
                        r["kind"],
                        " ".join(f"{k}={v}" for k, v in r["params"].items()),
                        fmt(r["step_ms"], ".3f"),
                        fmt(r["samples_per_s"], ",.0f"),
                        fmt(r["gbps"], ".2f"),
                        "-" if r["kind"] == "resident" else fmt(100 * r["gbps"] / entry["link"]["gbps"], ".0f"),
                        fmt(100 * r["wait_fraction"], ".1f"),
                        fmt(r["cpu_cores"], ".2f"),
                        fmt(r["cores_per_gbps"], ".3f"),
                    ]
                )
        lines.append("")
        lines.append(
            table(
                [
                    "compute",
                    "feed",
                    "config",
                    "step ms",
                    "samples/s",
                    "GB/s",
                    "% link",
                    "wait %",
                    "cores",
                    "cores/GB/s",
                ],
                rows,  # resident: GB/s consumed, nothing crosses the link
                title=f"{fmt_size(entry['row_bytes'])} rows x {entry['batch']} "
                f"({entry['batch_bytes'] / MiB:.1f} MiB batches; link "
                f"{entry['link']['gbps']:.1f} GB/s, batch transfer {entry['transfer_ms']:.3f} ms)",
            )
        )
    return "\n".join(lines)


def summary_table(results: dict) -> str:
    rows = []
    for entry in results["row_sizes"]:
        for case in entry["cases"]:
            b = case.get("best") or {}
            tp, fp = b.get("torch_params") or {}, b.get("fastload_params") or {}
            rows.append(
                [
                    f"{fmt_size(entry['row_bytes'])} x{entry['batch']}",
                    f"{case['ratio']:g}x ({case['achieved_ratio']:.2f})",
                    fmt(b.get("resident_step_ms"), ".3f"),
                    fmt(b.get("resident_h2d_step_ms"), ".3f"),
                    fmt(b.get("torch_step_ms"), ".3f") + (f" w{tp['num_workers']}" if tp else ""),
                    fmt(b.get("fastload_step_ms"), ".3f") + (f" T{fp['stage_threads']}" if fp else ""),
                    fmt(b.get("fastload_over_resident"), ".3f"),
                    fmt(b.get("fastload_vs_torch"), ".2f"),
                    fmt(b.get("fastload_gbps"), ".1f"),
                    fmt(100 * b["fastload_of_ceiling"] if b.get("fastload_of_ceiling") else None, ".0f"),
                    fmt(b.get("fastload_cores_per_gbps"), ".3f"),
                ]
            )
    return table(
        [
            "batches",
            "compute (actual)",
            "resident ms",
            "+h2d ms",
            "torch best ms",
            "fastload best ms",
            "fl/resident",
            "fl/torch sps",
            "fl GB/s",
            "% link",
            "fl cores/GB/s",
        ],
        rows,
        title="SUMMARY: step time by feed (best config of each); fl/resident target <= "
        f"{TARGET_T1} when compute >= 1x, fl/torch target >= {TARGET_T2:g}",
    )


def make_plot(results: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as exc:
        return f"no plot: matplotlib unavailable ({error_text(exc)})"
    entries = [e for e in results["row_sizes"] if e["cases"]]
    if not entries:
        return "no plot: nothing measured"
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    # 1: step time relative to resident
    ax = axes[0]
    kinds = [("resident+h2d", "tab:gray"), ("torch", "tab:red"), ("fastload", "tab:blue")]
    labels, width = [], 0.27
    pos = 0
    for entry in entries:
        for case in entry["cases"]:
            res = best_of(case, "resident")
            if res is None or case["ratio"] == 0:
                continue
            for k, (kind, color) in enumerate(kinds):
                r = best_of(case, kind)
                if r is not None:
                    ax.bar(
                        pos + (k - 1) * width,
                        r["step_ms"] / res["step_ms"],
                        width,
                        color=color,
                        label=kind if pos == 0 else None,
                    )
            labels.append(f"{fmt_size(entry['row_bytes'])}\n{case['achieved_ratio']:.1f}x")
            pos += 1
    if labels:
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(TARGET_T1, color="tab:green", ls="--", lw=1, label=f"T1 {TARGET_T1}x")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel("step time / device-resident step time")
        ax.set_title("training step with compute (row size, compute/transfer)")
        ax.legend(fontsize=8)
    else:
        ax.set_visible(False)
    # 2 and 3: pure input GB/s and cores per GB/s by staging threads
    for entry, marker in zip(entries, "osD^v"):
        case = next((c for c in entry["cases"] if c["ratio"] == 0), None)
        if case is None:
            continue
        runs = sorted((r for r in case["runs"] if r["kind"] == "fastload"), key=lambda r: r["params"]["stage_threads"])
        if not runs:
            continue
        threads = [r["params"]["stage_threads"] for r in runs]
        name = f"{fmt_size(entry['row_bytes'])} rows"
        line = axes[1].plot(threads, [r["gbps"] for r in runs], marker=marker, label=f"fastload {name}")[0]
        axes[1].axhline(entry["link"]["gbps"], color=line.get_color(), ls=":", lw=1, label=f"pinned ceiling {name}")
        tb = best_of(case, "torch")
        if tb is not None:
            axes[1].axhline(
                tb["gbps"],
                color=line.get_color(),
                ls="-.",
                lw=1,
                label=f"torch best {name} (w={tb['params']['num_workers']})",
            )
            if tb.get("cores_per_gbps") is not None:
                axes[2].axhline(tb["cores_per_gbps"], color=line.get_color(), ls="-.", lw=1, label=f"torch best {name}")
        axes[2].plot(
            threads,
            [math.nan if r.get("cores_per_gbps") is None else r["cores_per_gbps"] for r in runs],
            marker=marker,
            color=line.get_color(),
            label=f"fastload {name}",
        )
    for ax in axes[1:]:
        ax.set_xticks(sorted({t for t in results["args"]["stage_threads"]}))
    axes[1].axhline(TARGET_T3_GBPS, color="tab:green", ls="--", lw=1, label=f"T3 {TARGET_T3_GBPS:g} GB/s")
    axes[1].set_xlabel("stage_threads")
    axes[1].set_ylabel("GB/s into the device (1e9 B/s)")
    axes[1].set_title("pure input: pageable batches -> GPU")
    axes[1].legend(fontsize=7)
    axes[2].set_xlabel("stage_threads")
    axes[2].set_ylabel("CPU cores per GB/s")
    axes[2].set_title("pure input: CPU cost")
    axes[2].legend(fontsize=7)
    m = results["machine"]
    fig.suptitle(
        f"torch_fastload overlap study: {(m.get('gpu') or {}).get('name', 'CPU smoke')}, torch {m['torch']}, "
        f"{m['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "out",
        help="directory for overlap.json and overlap.png",
    )
    p.add_argument("--quick", action="store_true", help="short run (<= ~1 min on one H100)")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU needed: tiny sizes on the CPU, exercising every code path (numbers meaningless)",
    )
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--row-sizes", type=size_list, default=None, help="bytes per row [1MiB,256KiB; smoke 64KiB,16KiB]")
    p.add_argument("--batch", type=int, default=None, help="rows per batch [64; smoke 16]")
    p.add_argument(
        "--data-bytes",
        type=parse_size,
        default=None,
        help="pageable dataset size per row size [2GiB, 1GiB quick; smoke 32MiB]",
    )
    p.add_argument(
        "--run-bytes",
        type=parse_size,
        default=None,
        help="bytes consumed per timed resident / fastload run (sets the steps) [8GiB, 1GiB quick; smoke 32MiB]",
    )
    p.add_argument(
        "--torch-run-bytes",
        type=parse_size,
        default=None,
        help="the same for torch DataLoader runs (slow, and steady) [3GiB, 1GiB quick; smoke 16MiB]",
    )
    p.add_argument("--min-steps", type=int, default=None, help="at least this many timed steps [30; smoke 8]")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per run [8, 5 quick; smoke 3]")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per resident / fastload config, best kept (torch runs once) [2, 1 quick]",
    )
    p.add_argument(
        "--ratios",
        type=float_list,
        default=None,
        help="compute time per step as multiples of the batch's pinned transfer time; 0 = pure input [0,1,2]",
    )
    p.add_argument(
        "--torch-workers", type=int_list, default=None, help="torch num_workers tried [0,4,8; 0,4 quick; smoke 0,2]"
    )
    p.add_argument(
        "--stage-threads",
        type=int_list,
        default=None,
        help="torch_fastload stage_threads tried [1,2,4,8; 2,4,8 quick; smoke 1,2]",
    )
    p.add_argument(
        "--loader-kwargs",
        type=json.loads,
        default={},
        help="extra JSON kwargs for torch_fastload.DataLoader, e.g. '{\"pool_slots\": 4}'",
    )
    p.add_argument("--model-dim", type=int, default=None, help="MLP token width d [1024; smoke 128]")
    p.add_argument("--layers", type=int, default=None, help="MLP residual blocks [1]")
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast for the MLP (CUDA)")
    p.add_argument(
        "--eager",
        action="store_true",
        help="run the MLP step eagerly instead of as a CUDA graph (then Python launch overhead is part "
        "of the step and competes with the loader's threads for the GIL)",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="diagnostic: sys.setswitchinterval(SECONDS) for the run (Python's default is 0.005)",
    )
    p.add_argument("--max-inflight", type=int, default=2, help="steps the host may queue ahead of the GPU")
    p.add_argument("--resident-batches", type=int, default=8, help="distinct batches pre-staged on the device")
    p.add_argument("--link-reps", type=int, default=7, help="samples of the pinned H2D ceiling")
    p.add_argument(
        "--run-timeout", type=int, default=300, help="seconds before a hung run dumps every thread's stack and exits"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    p.add_argument("--strict", action="store_true", help="exit with status 3 when a target fails")
    return p


def finish_args(args) -> None:
    smoke, q = args.cpu_smoke, args.quick

    def pick(name, full, quick, smoke_value):
        if getattr(args, name) is None:
            setattr(args, name, smoke_value if smoke else (quick if q else full))

    pick("row_sizes", [MiB, 256 * KiB], [MiB, 256 * KiB], [64 * KiB, 16 * KiB])
    pick("batch", 64, 64, 16)
    pick("data_bytes", 2 * GiB, GiB, 32 * MiB)
    pick("run_bytes", 8 * GiB, GiB, 32 * MiB)
    pick("torch_run_bytes", 3 * GiB, GiB, 16 * MiB)
    pick("min_steps", 30, 20, 12)
    pick("warmup", 8, 5, 3)
    pick("repeats", 2, 1, 1)
    pick("ratios", [0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [0.0, 1.0])
    pick("torch_workers", [0, 4, 8], [0, 4], [0, 2])
    pick("stage_threads", [1, 2, 4, 8], [2, 4, 8], [1, 2])
    pick("model_dim", 1024, 1024, 128)
    pick("layers", 1, 1, 1)
    for name in (
        "batch",
        "min_steps",
        "warmup",
        "repeats",
        "model_dim",
        "layers",
        "max_inflight",
        "resident_batches",
        "link_reps",
        "run_timeout",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(t < 1 for t in args.stage_threads):
        raise SystemExit(f"--stage-threads must be >= 1, got {args.stage_threads}")
    if not isinstance(args.loader_kwargs, dict):
        raise SystemExit(f"--loader-kwargs must be a JSON object, got {args.loader_kwargs!r}")
    if args.data_bytes > 16 * GiB:
        raise SystemExit(f"--data-bytes {fmt_size(args.data_bytes)} > 16 GiB: keep the dataset modest")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    finish_args(args)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.stderr.write(
            f"overlap.py: CUDA is not available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); this study needs a GPU.\n"
            f"Use --cpu-smoke to exercise the code paths on the CPU with tiny sizes.\n"
        )
        return 2
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.cpu_smoke:
        device = torch.device("cpu")
    else:
        if args.device >= torch.cuda.device_count():
            sys.stderr.write(f"overlap.py: --device {args.device} but {torch.cuda.device_count()} CUDA device(s)\n")
            return 2
        torch.cuda.set_device(args.device)
        device = torch.device("cuda", args.device)
        torch.backends.cuda.matmul.allow_tf32 = True

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "overlap_cpu_smoke" if args.cpu_smoke else "overlap"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    results: dict = {
        "benchmark": "benchmarks/overlap.py",
        "machine": machine_info(device.type == "cuda"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": {
            "T1_max_step_over_resident": TARGET_T1,
            "T2_min_speedup_vs_torch": TARGET_T2,
            "T3_min_gbps": TARGET_T3_GBPS,
            "T3_max_threads": TARGET_T3_THREADS,
        },
        "design_reference": {
            "pinned_h2d_gbps": [53.5, 55.3],
            "staging_gbps_8_16_threads": [33, 50],
            "torch_tensordataset_gbps": {"num_workers=0": 3.9, "num_workers=4": 2.1},
            "h2d_slows_concurrent_gemm": 0.11,
        },
        "row_sizes": [],
        "errors": {},
    }
    began = time.perf_counter()

    def save():
        results["elapsed_s"] = time.perf_counter() - began
        write_json(json_path, results)

    m = results["machine"]
    log(
        f"torch_fastload overlap study on {(m.get('gpu') or {}).get('name', 'CPU (smoke: numbers are meaningless)')}: "
        f"torch {m['torch']}, python {m['python']}, {m['cpu_affinity'] or m['cpu_count']} CPUs, "
        f"stage copier {m.get('stage_copier')}, {m['date']}"
    )
    log(f"command: {m['command_line']}")
    save()

    for row_bytes in args.row_sizes:
        try:
            study_row_size(row_bytes, args, device, results, save)
        except KeyboardInterrupt:
            results["errors"][fmt_size(row_bytes)] = "interrupted"
            save()
            raise
        except Exception as exc:
            results["errors"][fmt_size(row_bytes)] = {"error": error_text(exc), "traceback": traceback.format_exc()}
            log(f"{fmt_size(row_bytes)} rows: FAILED {error_text(exc)}")
            traceback.print_exc()
        save()

    results["verdicts"] = verdicts(results)
    if args.plot:
        problem = make_plot(results, png_path)
        results["plot"] = problem or str(png_path)
    save()

    log(detail_tables(results))
    for entry in results["row_sizes"]:
        case = next((c for c in entry["cases"] if c["ratio"] == 0), None)
        fl = best_of(case, "fastload") if case else None
        if fl is not None and fl.get("fastload_stats_text"):
            log(
                f"\nloader.stats() of the best pure-input torch_fastload run, {fmt_size(entry['row_bytes'])} rows "
                f"(stage_threads={fl['params']['stage_threads']}):"
            )
            log(fl["fastload_stats_text"])
    errors = dict(results["errors"])
    for entry in results["row_sizes"]:
        for case in entry["cases"]:
            errors.update(case["errors"])
    if errors:
        log("\nERRORS: " + "; ".join(f"{k}: {v['error'] if isinstance(v, dict) else v}" for k, v in errors.items()))
    log(
        f"\nwrote {json_path}"
        + (
            f" and {png_path}"
            if results.get("plot") == str(png_path)
            else (f" ({results['plot']})" if args.plot else "")
        )
    )
    log(f"total time {time.perf_counter() - began:.1f} s")
    log("")
    log(summary_table(results))
    log("")
    if args.cpu_smoke:
        log("CPU smoke run: verdicts below only show the code path works; they say nothing about the targets.")
    for v in results["verdicts"]:
        log(f"{v['target']} {v['verdict']:<7} {v['text']}")
        for c in v["cases"]:
            log(f"     {'pass' if c['pass'] else 'FAIL'}  {c['evidence']}")
    failed = any(v["verdict"] == "FAIL" for v in results["verdicts"])
    if errors:
        return 1
    return 3 if (failed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
