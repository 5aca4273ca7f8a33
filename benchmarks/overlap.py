#!/usr/bin/env python3
"""Does a training step fed by torch_fastload run as fast as one fed from data already on the
GPU? And how does it compare with torch's DataLoader?

Data: an in-memory TensorDataset of pageable float32 rows + int64 labels, batches of --batch
rows of each --row-sizes (default 64 x 1 MiB = 64 MiB and 64 x 256 KiB = 16 MiB). Compute: a
residual MLP over the batch viewed as tokens of --model-dim (LayerNorm -> Linear -> GELU ->
Linear, bf16 autocast, forward + backward + fused AdamW, captured as a CUDA graph), its hidden
width calibrated so a step takes --ratios x the batch's pinned transfer time; ratio 0 is pure
input (one small kernel reads the batch). Feeds, each for the same steps after a warm-up:

  resident       batches pre-staged on the GPU, cycled: the ideal
  resident+h2d   resident, plus a raw pinned H2D copy of a batch per step on a side stream,
                 consumed two steps later: the hardware's own price for overlapping a copy
  torch          DataLoader(pin_memory=True, num_workers=N) + .cuda(non_blocking=True), N in
                 --torch-workers, best kept
  fastload       torch_fastload.DataLoader(num_workers=0, stage_threads=T), T in
                 --stage-threads, best kept
  torchdata      (when torchdata imports; "not installed" otherwise) torchdata's
                 StatefulDataLoader with the torch run's settings, N in --torch-workers

Baseline in the same run: the link (pinned H2D of one batch); CPU cores per GB/s from process
(+ worker) CPU time. Targets: T1 fastload step <= 1.05x resident when compute >= transfer;
T2 fastload samples/s >= 2x torch's best on batches >= 16 MiB; T3 pure input >= 40 GB/s with
<= 8 staging threads.

    python benchmarks/overlap.py            # ~2-4 min on one H100
    python benchmarks/overlap.py --quick    # <= ~1 min
"""

from __future__ import annotations

import faulthandler
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.utils.data as tud

import torch_fastload
from torch_fastload._benchutil import (
    GiB,
    InflightWindow,
    KiB,
    MiB,
    Progress,
    Study,
    cpu_seconds,
    empty_host_cache,
    float_list,
    fmt,
    fmt_size,
    int_list,
    link_baseline,
    log,
    parse_study,
    peers,
    size_arg,
    size_list,
    study_parser,
    sync,
    table,
)

T1, T2, T3_GBPS, T3_THREADS = 1.05, 2.0, 40.0, 8


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
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPStep:
    """forward + backward + AdamW of a residual MLP on the batch viewed as [tokens, d]. On CUDA the
    step is one CUDA graph (warm-up on a side stream, capturable fused AdamW, autocast cache off),
    so a step is GPU time, not Python launch overhead competing with the loader for the GIL
    (--eager measures that case). A failed capture runs eagerly and says why."""

    def __init__(self, args, hidden: int, batch_shape: tuple):
        self.d, self.device = args.model_dim, args.device
        self.amp = args.amp == "bf16" and args.device.type == "cuda"
        self.graph, self.graph_error = None, None
        want_graph = not args.eager and args.device.type == "cuda"
        self._build(args, hidden, capturable=want_graph)
        if want_graph:
            try:
                self._capture(batch_shape)
            except Exception as exc:
                self.graph, self.graph_error = None, f"{type(exc).__name__}: {exc}"
                torch.cuda.synchronize()
                self._build(args, hidden, capturable=False)

    @property
    def mode(self) -> str:
        return "cuda graph" if self.graph is not None else f"eager ({self.graph_error or 'asked for'})"

    def _build(self, args, hidden: int, capturable: bool) -> None:
        torch.manual_seed(args.seed)
        self.model = nn.Sequential(*[Block(self.d, hidden) for _ in range(args.layers)]).to(self.device)
        params = list(self.model.parameters())
        self.params = sum(p.numel() for p in params)
        cuda = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda or None, capturable=capturable)

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
        graph.replay()  # one real run: a broken capture shows here, not mid-measurement
        torch.cuda.synchronize()
        self.graph = graph

    def __call__(self, x: torch.Tensor) -> None:
        if self.graph is None:
            return self._eager(x)
        self.static.copy_(x.view(self.static.shape))
        self.graph.replay()


class TouchStep:
    """The pure-input consumer: one small kernel reading 4096 elements spread over the batch."""

    def __init__(self, device: torch.device):
        self.acc = torch.zeros((), dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        self.acc += flat[:: max(1, flat.numel() // 4096)].sum()


def step_ms(fn, x: torch.Tensor, device: torch.device, min_total_ms: float = 150.0) -> float:
    """Mean time of ``fn(x)`` on a device-resident ``x`` after a warm-up (CUDA events)."""
    for _ in range(3):
        fn(x)
    sync(device)

    def timed(n: int) -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x)
            return (time.perf_counter() - t0) * 1e3 / n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    first = timed(3)
    return timed(int(max(5, min(200, math.ceil(min_total_ms / max(first, 1e-3))))))


def calibrate(target_ms: float, x: torch.Tensor, args) -> dict:
    """The hidden width whose step on ``x`` takes ~``target_ms``: two widths fit ms = a + b * h,
    solved, then corrected up to twice with the measured error."""
    gpu = args.device.type == "cuda"
    quantum, lo, hi, h_min, h_max = (128, 1024, 4096, 128, 65536) if gpu else (16, 32, 128, 16, 4096)
    history = []

    def measure(h: int) -> float:
        history.append({"hidden": h, "ms": step_ms(MLPStep(args, h, tuple(x.shape)), x, args.device)})
        return history[-1]["ms"]

    def clamp(h: float) -> int:
        return int(min(h_max, max(h_min, round(h / quantum) * quantum)))

    t_lo, t_hi = measure(lo), measure(hi)
    slope = (t_hi - t_lo) / (hi - lo) if t_hi > t_lo else max(t_hi, 1e-3) / hi
    h = clamp(lo + (target_ms - t_lo) / slope)
    ms = measure(h)
    for _ in range(2):
        h_new = clamp(h + (target_ms - ms) / slope)
        if abs(ms / target_ms - 1) <= 0.05 or h_new == h:
            break
        h, ms = h_new, measure(h_new)
    best = min(history, key=lambda e: abs(e["ms"] - target_ms))
    return {"target_ms": target_ms, "hidden": best["hidden"], "compute_ms": best["ms"], "history": history}


class ResidentFeed:
    """Pre-staged batches cycled; with ``copy_bytes``, also one raw pinned H2D copy a step on a
    side stream that the consumer waits for two steps later (a prefetching loader with no host
    cost)."""

    def __init__(self, batches: list, device: torch.device, copy_bytes: int = 0):
        self.batches, self.i, self.loader = batches, 0, None
        self.copy = copy_bytes > 0
        if self.copy:
            self.src = torch.ones(copy_bytes, dtype=torch.uint8, pin_memory=True)
            self.dst = [torch.empty(copy_bytes, dtype=torch.uint8, device=device) for _ in range(3)]
            self.stream, self.events = torch.cuda.Stream(device=device), []

    def next(self) -> torch.Tensor:
        if self.copy:
            with torch.cuda.stream(self.stream):  # nothing reads dst: rotating needs no wait
                self.dst[self.i % 3].copy_(self.src, non_blocking=True)
                self.events.append(torch.cuda.Event())
                self.events[-1].record(self.stream)
            del self.events[:-3]
            if len(self.events) == 3:
                torch.cuda.current_stream().wait_event(self.events[0])
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def close(self) -> None:
        sync(torch.device("cuda") if self.copy else torch.device("cpu"))


class LoaderFeed:
    def __init__(self, loader, device: torch.device, move: bool):
        self.loader, self.device, self.move = loader, device, move
        self.iterator = iter(loader)

    def next(self) -> torch.Tensor:
        x, _y = next(self.iterator)
        return x.to(self.device, non_blocking=True) if self.move else x  # torch: the copy is in the loop

    def close(self) -> None:
        self.iterator = None
        if hasattr(self.loader, "close"):
            self.loader.close()


def run_feed(make_feed, step, steps: int, args, batch_bytes: int, desc: str) -> dict:
    """Warm-up + ``steps`` steps; the clock, CPU time and the loader's stats start after the
    warm-up and a synchronize and stop after a synchronize."""
    faulthandler.dump_traceback_later(args.run_timeout, exit=True)  # a hung loader must not hang the study
    bar, feed = Progress(args.warmup + steps, desc, args.progress), None
    try:
        feed = make_feed()
        fastload = feed.loader if isinstance(feed.loader, torch_fastload.DataLoader) else None
        window, wait = InflightWindow(args.device, args.max_inflight), 0.0
        for i in range(args.warmup + steps):
            if i == args.warmup:
                window.drain()
                if fastload is not None:
                    fastload.stats(reset=True)
                cpu0, started = cpu_seconds(), time.perf_counter()
            t0 = time.perf_counter()
            x = feed.next()
            wait += time.perf_counter() - t0 if i >= args.warmup else 0.0
            step(x)
            window.step_done()
            bar.update()
        window.drain()
        wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu0
        gbps = steps * batch_bytes / wall / 1e9
        result = {
            "steps": steps,
            "wall_s": wall,
            "step_ms": 1e3 * wall / steps,
            "samples_per_s": steps * args.batch / wall,
        }
        result.update(gbps=gbps, wait_fraction=wait / wall, cpu_cores=cpu / wall, cores_per_gbps=cpu / wall / gbps)
        if wall < (0.1 if getattr(feed.loader, "num_workers", 0) else 0.01):  # worker CPU time comes in 10 ms ticks
            result.update(cpu_cores=None, cores_per_gbps=None)
        if fastload is not None:
            result["fastload_stats"] = str(fastload.stats())
        return result
    finally:
        bar.close()
        if feed is not None:
            feed.close()
        faulthandler.cancel_dump_traceback_later()


def feeds(args, dataset, resident: list, batch_bytes: int, steps: int, torch_steps: int) -> list:
    """``(kind, params, make_feed, steps)`` of every run of one case."""
    rows, device = len(dataset), args.device
    out = [("resident", {}, lambda: ResidentFeed(resident, device), steps)]
    if device.type == "cuda":
        out.append(("resident+h2d", {}, lambda: ResidentFeed(resident, device, batch_bytes), steps))
    for n in args.torch_workers:
        sampler = EpochsSampler(rows, (args.warmup + torch_steps) * args.batch, args.seed)
        make = lambda n=n, s=sampler: LoaderFeed(  # noqa: E731
            tud.DataLoader(
                dataset, args.batch, sampler=s, num_workers=n, pin_memory=device.type == "cuda", drop_last=True
            ),
            device,
            move=True,
        )
        out.append(("torch", {"num_workers": n}, make, torch_steps))
        if args.torchdata:
            make = lambda n=n, s=sampler: LoaderFeed(  # noqa: E731
                peers.stateful_loader(
                    dataset, args.batch, sampler=s, num_workers=n, pin_memory=device.type == "cuda", drop_last=True
                ),
                device,
                move=True,
            )
            out.append(("torchdata", {"num_workers": n}, make, torch_steps))
    for t in args.stage_threads:
        sampler = EpochsSampler(rows, (args.warmup + steps) * args.batch, args.seed)
        make = lambda t=t, s=sampler: LoaderFeed(  # noqa: E731
            torch_fastload.DataLoader(
                dataset, args.batch, sampler=s, drop_last=True, device=device, stage_threads=t, **args.loader_kwargs
            ),
            device,
            move=False,
        )
        out.append(("fastload", {"stage_threads": t}, make, steps))
    return out


def run_case(study: Study, args, ratio: float, entry: dict, dataset, resident: list) -> dict:
    case = {"ratio": ratio, "runs": []}
    transfer_ms, x = entry["transfer_ms"], resident[0]
    if ratio > 0:
        cal = calibrate(ratio * transfer_ms, x, args)
        step = MLPStep(args, cal["hidden"], tuple(x.shape))
        case.update(calibration=cal, compute_ms=cal["compute_ms"], mode=step.mode, params=step.params)
        log(
            f"-- compute {ratio:g}x transfer: hidden {cal['hidden']} ({step.params / 1e6:.1f} M params, {step.mode}): "
            f"{cal['compute_ms']:.3f} ms"
        )
    else:
        step = TouchStep(args.device)
        case["compute_ms"] = step_ms(step, x, args.device, min_total_ms=30.0)
        log(f"-- pure input (the consumer only touches the batch: {case['compute_ms']:.3f} ms/step)")
    case["achieved_ratio"] = case["compute_ms"] / transfer_ms if ratio > 0 else 0.0
    for kind, params, make, steps in feeds(
        args, dataset, resident, entry["batch_bytes"], entry["steps"], entry["torch_steps"]
    ):
        config = " ".join(f"{k}={v}" for k, v in params.items())
        desc = f"{fmt_size(entry['row_bytes'])} r={ratio:g} {kind} {config}"
        tries = [
            study.attempt(desc, run_feed, make, step, steps, args, entry["batch_bytes"], desc)
            for _ in range(1 if kind in ("torch", "torchdata") else args.repeats)
        ]
        tries = [t for t in tries if t]
        if tries:
            best = min(tries, key=lambda r: r["step_ms"])
            case["runs"].append(
                {**best, "kind": kind, "params": params, "repeats_step_ms": [t["step_ms"] for t in tries]}
            )
            log(
                f"   {kind:<13}{config:<17}{best['step_ms']:8.3f} ms/step {best['samples_per_s']:9,.0f} samples/s "
                f"{best['gbps']:6.2f} GB/s wait {100 * best['wait_fraction']:5.1f}%"
            )
    case["best"] = summarize(case, entry["link"]["gbps"])
    return case


def best_of(case: dict, kind: str) -> dict | None:
    runs = [r for r in case["runs"] if r["kind"] == kind]
    return min(runs, key=lambda r: r["step_ms"]) if runs else None


def summarize(case: dict, link_gbps: float) -> dict:
    res, rh, tb, fl = (best_of(case, k) for k in ("resident", "resident+h2d", "torch", "fastload"))
    td = best_of(case, "torchdata")
    return {
        "torchdata_ms": td and td["step_ms"],
        "fastload_vs_torchdata": fl["samples_per_s"] / td["samples_per_s"] if fl and td else None,
        "resident_ms": res and res["step_ms"],
        "resident_h2d_ms": rh and rh["step_ms"],
        "torch_ms": tb and tb["step_ms"],
        "torch_params": tb and tb["params"],
        "fastload_ms": fl and fl["step_ms"],
        "fastload_params": fl and fl["params"],
        "fastload_gbps": fl and fl["gbps"],
        "fastload_over_resident": fl["step_ms"] / res["step_ms"] if fl and res else None,
        "fastload_vs_torch": fl["samples_per_s"] / tb["samples_per_s"] if fl and tb else None,
        "fastload_of_link": fl["gbps"] / link_gbps if fl else None,
        "fastload_cores_per_gbps": fl and fl["cores_per_gbps"],
    }


def study_row_size(study: Study, args, row_bytes: int) -> dict:
    row_elems, batch = row_bytes // 4, args.batch
    if row_bytes % 4 or row_elems % args.model_dim:
        raise ValueError(f"row size {row_bytes} B is not a whole number of {args.model_dim}-float tokens")
    batch_bytes = batch * (row_bytes + 8)  # rows + int64 labels: what a loader delivers a step
    rows = max(2 * batch, args.data_bytes // row_bytes)
    entry = {
        "row_bytes": row_bytes,
        "batch": batch,
        "batch_bytes": batch_bytes,
        "rows": rows,
        "steps": max(args.min_steps, math.ceil(args.run_bytes / batch_bytes)),
        "torch_steps": max(args.min_steps, math.ceil(args.torch_run_bytes / batch_bytes)),
        "cases": [],
    }
    g = torch.Generator().manual_seed(args.seed)
    data = torch.empty(rows, row_elems).uniform_(-1.0, 1.0, generator=g)  # pageable, every page touched
    dataset = tud.TensorDataset(data, torch.randint(0, 1000, (rows,), generator=g))
    entry["link"] = link_baseline(args.device, batch_bytes, args.link_reps)
    entry["transfer_ms"] = batch_bytes / (entry["link"]["gbps"] * 1e9) * 1e3
    log(
        f"\n=== {fmt_size(row_bytes)} rows x {batch} ({batch_bytes / MiB:.1f} MiB batches), {rows} rows = "
        f"{rows * row_bytes / GiB:.2f} GiB pageable; link {entry['link']['gbps']:.2f} GB/s, a batch's transfer "
        f"{entry['transfer_ms']:.3f} ms; {entry['steps']} timed steps ({entry['torch_steps']} for torch) ==="
    )
    idx = list(EpochsSampler(rows, batch * args.resident_batches, args.seed))
    resident = [data[idx[i * batch : (i + 1) * batch]].to(args.device) for i in range(args.resident_batches)]
    for ratio in args.ratios:
        case = study.attempt(
            f"{fmt_size(row_bytes)} ratio {ratio:g}", run_case, study, args, ratio, entry, dataset, resident
        )
        if case:
            entry["cases"].append(case)
        study.save()
    del resident, dataset, data
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host_cache()
    return entry


def verdicts(study: Study) -> None:
    t1, t2, t3 = [], [], []
    for entry in study["row_sizes"]:
        rs = fmt_size(entry["row_bytes"])
        for case in entry["cases"]:
            b = case["best"]
            if case["ratio"] >= 1 and b["fastload_over_resident"] is not None:
                t1.append(
                    (
                        b["fastload_over_resident"] <= T1,
                        f"{rs} {case['achieved_ratio']:.2f}x: {b['fastload_over_resident']:.3f}x",
                    )
                )
            if entry["batch_bytes"] >= 16 * MiB and b["fastload_vs_torch"] is not None:
                t2.append((b["fastload_vs_torch"] >= T2, f"{rs} {case['ratio']:g}x: {b['fastload_vs_torch']:.2f}x"))
            few = [r for r in case["runs"] if r["kind"] == "fastload" and r["params"]["stage_threads"] <= T3_THREADS]
            if case["ratio"] == 0 and few:
                top = max(few, key=lambda r: r["gbps"])
                t3.append(
                    (
                        top["gbps"] >= T3_GBPS,
                        f"{rs}: {top['gbps']:.1f} GB/s at {top['params']['stage_threads']} threads",
                    )
                )
    for target, items in (
        (f"T1 fastload step <= {T1}x device-resident when compute >= transfer", t1),
        (f"T2 fastload samples/s >= {T2:g}x torch DataLoader's best (batches >= 16 MiB)", t2),
        (f"T3 pure input >= {T3_GBPS:g} GB/s into the GPU with <= {T3_THREADS} staging threads", t3),
    ):
        if items:
            study.verdict(target, all(ok for ok, _ in items), "; ".join(text for _, text in items))


def summary_row(study: Study, entry: dict, case: dict) -> list:
    """The case's best of each feed as one SUMMARY row, its figures recorded."""
    b, rs = case["best"], fmt_size(entry["row_bytes"])
    for name in ("resident_ms", "resident_h2d_ms", "torch_ms", "fastload_ms", "fastload_gbps"):
        study.figure(f"{name}_{rs.replace(' ', '')}_{case['ratio']:g}x", b[name])
    for name in ("fastload_over_resident", "fastload_vs_torch", "fastload_cores_per_gbps", "fastload_vs_torchdata"):
        study.figure(f"{name}_{rs.replace(' ', '')}_{case['ratio']:g}x", b[name])
    tp, fp = b["torch_params"] or {}, b["fastload_params"] or {}
    row = [f"{rs} x{entry['batch']}", f"{case['ratio']:g}x ({case['achieved_ratio']:.2f})"]
    row += [fmt(b["resident_ms"], ".3f"), fmt(b["resident_h2d_ms"], ".3f")]
    row += [fmt(b["torch_ms"], ".3f") + (f" w{tp['num_workers']}" if tp else "")]
    row += [fmt(b["fastload_ms"], ".3f") + (f" T{fp['stage_threads']}" if fp else "")]
    row += [fmt(b["fastload_over_resident"], ".3f"), fmt(b["fastload_vs_torch"], ".2f") + "x"]
    return row + [
        fmt(b["fastload_gbps"], ".1f"),
        fmt(100 * (b["fastload_of_link"] or 0), ".0f"),
        fmt(b["fastload_cores_per_gbps"], ".3f"),
    ]


def tables(study: Study) -> list[str]:
    out, summary = [], []
    for entry in study["row_sizes"]:
        study.figure(f"link_gbps_{fmt_size(entry['row_bytes']).replace(' ', '')}", entry["link"]["gbps"])
        detail = []
        for case in entry["cases"]:
            summary.append(summary_row(study, entry, case))
            for r in case["runs"]:
                config = " ".join(f"{k}={v}" for k, v in r["params"].items())
                detail.append(
                    [
                        f"{case['ratio']:g}x",
                        r["kind"],
                        config,
                        fmt(r["step_ms"], ".3f"),
                        fmt(r["samples_per_s"], ",.0f"),
                    ]
                )
                detail[-1] += [
                    fmt(r["gbps"]),
                    fmt(100 * r["wait_fraction"], ".1f"),
                    fmt(r["cpu_cores"]),
                    fmt(r["cores_per_gbps"], ".3f"),
                ]
        link = f"link {entry['link']['gbps']:.1f} GB/s, transfer {entry['transfer_ms']:.3f} ms"
        title = (
            f"{fmt_size(entry['row_bytes'])} x{entry['batch']} ({entry['batch_bytes'] / MiB:.1f} MiB batches; {link})"
        )
        heads = ["compute", "feed", "config", "step ms", "samples/s", "GB/s", "wait %", "cores", "cores/GB/s"]
        out.append(table(heads, detail, title))
        best = next((best_of(c, "fastload") for c in entry["cases"] if c["ratio"] == 0), None)
        if best and best.get("fastload_stats"):
            out.append(
                f"loader.stats() of the best pure-input fastload run ({best['params']}):\n{best['fastload_stats']}"
            )
    heads = ["batches", "compute (actual)", "resident ms", "+h2d ms", "torch best ms", "fastload best ms"]
    heads += ["fl/resident", "fl/torch samples/s", "fl GB/s", "% link", "fl cores/GB/s"]
    title = f"SUMMARY: best config of each feed (T1 fl/resident <= {T1} at >= 1x compute; T2 fl/torch >= {T2:g})"
    return out + [table(heads, summary, title)]


def plot(data: dict, plt):
    entries = [e for e in data["row_sizes"] if e["cases"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    labels, pos = [], 0
    for entry in entries:
        for case in (c for c in entry["cases"] if c["ratio"] > 0 and best_of(c, "resident")):
            base = best_of(case, "resident")["step_ms"]
            for k, (kind, color) in enumerate(
                (("resident+h2d", "tab:gray"), ("torch", "tab:red"), ("fastload", "tab:blue"))
            ):
                if (r := best_of(case, kind)) is not None:
                    axes[0].bar(
                        pos + (k - 1) * 0.27, r["step_ms"] / base, 0.27, color=color, label=kind if pos == 0 else None
                    )
            labels.append(f"{fmt_size(entry['row_bytes'])}\n{case['achieved_ratio']:.1f}x")
            pos += 1
    axes[0].axhline(T1, color="tab:green", ls="--", lw=1, label=f"T1 {T1}x")
    axes[0].set_xticks(range(len(labels)), labels)
    axes[0].set_yscale("log")
    axes[0].set(ylabel="step time / device-resident step", title="training step (row size, compute/transfer)")
    axes[0].legend(fontsize=8)
    for entry in entries:
        case = next((c for c in entry["cases"] if c["ratio"] == 0), None)
        runs = sorted(
            (r for r in (case or {"runs": []})["runs"] if r["kind"] == "fastload"),
            key=lambda r: r["params"]["stage_threads"],
        )
        if runs:
            line = axes[1].plot(
                [r["params"]["stage_threads"] for r in runs],
                [r["gbps"] for r in runs],
                "o-",
                label=f"fastload {fmt_size(entry['row_bytes'])} rows",
            )[0]
            axes[1].axhline(entry["link"]["gbps"], color=line.get_color(), ls=":", lw=1, label="link")
    axes[1].axhline(T3_GBPS, color="tab:green", ls="--", lw=1, label=f"T3 {T3_GBPS:g} GB/s")
    axes[1].set(xlabel="stage_threads", ylabel="GB/s into the device", title="pure input: pageable batches -> GPU")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--row-sizes", type=size_list, help="bytes a row [1MiB,256KiB; cpu 64KiB,16KiB]")
    p.add_argument("--batch", type=int, help="rows a batch [64; cpu 16]")
    p.add_argument("--data-bytes", type=size_arg, help="pageable dataset per row size [2GiB; quick 1GiB]")
    p.add_argument(
        "--run-bytes", type=size_arg, help="bytes a timed resident / fastload run consumes [8GiB; quick 1GiB]"
    )
    p.add_argument("--torch-run-bytes", type=size_arg, help="the same for torch runs [3GiB; quick 1GiB]")
    p.add_argument("--min-steps", type=int, help="at least this many timed steps [30; quick 20]")
    p.add_argument("--warmup", type=int, help="untimed steps a run [8; quick 5]")
    p.add_argument("--repeats", type=int, help="runs per resident / fastload config, best kept [2; quick 1]")
    p.add_argument("--ratios", type=float_list, help="compute / a batch's transfer time; 0 = pure input [0,1,2]")
    p.add_argument("--torch-workers", type=int_list, help="torch num_workers tried [0,4,8; quick 0,4]")
    p.add_argument("--stage-threads", type=int_list, help="fastload stage_threads tried [1,2,4,8; quick 2,4,8]")
    p.add_argument(
        "--loader-kwargs", type=json.loads, default={}, help="extra JSON kwargs for torch_fastload.DataLoader"
    )
    p.add_argument("--model-dim", type=int, help="MLP token width [1024; cpu 128]")
    p.add_argument("--layers", type=int, default=1, help="MLP residual blocks")
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast for the MLP (CUDA)")
    p.add_argument("--eager", action="store_true", help="no CUDA graph: Python launch overhead joins the step")
    p.add_argument("--max-inflight", type=int, default=2, help="steps the host may queue ahead of the GPU")
    p.add_argument("--resident-batches", type=int, default=8, help="distinct batches pre-staged on the device")
    p.add_argument("--link-reps", type=int, default=7, help="samples of the link baseline")
    p.add_argument("--run-timeout", type=int, default=300, help="seconds before a hung run dumps its stacks and exits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="exit 3 when a target fails")
    args = parse_study(
        p,
        argv,
        row_sizes=([MiB, 256 * KiB], [MiB, 256 * KiB], [64 * KiB, 16 * KiB]),
        batch=(64, 64, 16),
        data_bytes=(2 * GiB, GiB, 32 * MiB),
        run_bytes=(8 * GiB, GiB, 32 * MiB),
        torch_run_bytes=(3 * GiB, GiB, 16 * MiB),
        min_steps=(30, 20, 12),
        warmup=(8, 5, 3),
        repeats=(2, 1, 1),
        ratios=([0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [0.0, 1.0]),
        torch_workers=([0, 4, 8], [0, 4], [0, 2]),
        stage_threads=([1, 2, 4, 8], [2, 4, 8], [1, 2]),
        model_dim=(1024, 1024, 128),
    )
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    study = Study("overlap", args, "training step fed device-resident vs torch DataLoader vs torch_fastload")
    study["row_sizes"], study["peers"] = [], {"torchdata": peers.status("torchdata").as_dict()}
    args.torchdata = study["peers"]["torchdata"]["installed"]
    if not args.torchdata:
        log(f"torchdata: {peers.status('torchdata').line()}")
    for row_bytes in args.row_sizes:
        entry = study.attempt(f"{fmt_size(row_bytes)} rows", study_row_size, study, args, row_bytes)
        if entry:
            study["row_sizes"].append(entry)
        study.save()
    verdicts(study)
    return study.finish(*tables(study), plot=plot if study["row_sizes"] else None, strict=args.strict)


if __name__ == "__main__":
    sys.exit(main())
