#!/usr/bin/env python3
"""A training loop fed fresh pageable batches: what pinned staging buys once compute overlaps.

Each of --steps steps takes a fresh pageable batch of --batch-bytes (rotating over --sources
pre-touched tensors) and enqueues --compute-ms of GPU work (a calibrated torch.cuda._sleep, or
bf16 4096^2 matmuls). Feeds:
  compute-only   no batch moves: the step's floor (the baseline of the overlap ratio)
  (i)    pageable x.cuda()
  (ii)   x.pin_memory().cuda(non_blocking=True)
  (iii)  a hand-written feeder: a thread stages into a PinnedPool slot with a ParallelCopier and
         copies on a side stream; a slot is reused after its copy's event
  (iv)   torch_fastload.DataLoader(batch_size=None, stage_threads=--loader-threads)
The step time is read on the GPU (events after the warm-up and after the last step); every
batch's first and last byte is checked on the device. overlap = compute-only step / step.

    python benchmarks/pinned_loop.py                         # 0 and 5 ms compute, ~15 s
    python benchmarks/pinned_loop.py --compute matmul --compute-ms 2,5,10
"""

from __future__ import annotations

import collections
import faulthandler
import queue
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

import torch_fastload
from torch_fastload._benchutil import (
    CudaSleeper,
    MiB,
    Progress,
    Study,
    aligned_empty,
    float_list,
    fmt,
    fmt_size,
    gbps,
    needs_cuda,
    parse_study,
    size_arg,
    study_parser,
    table,
)
from torch_fastload.pool import PinnedPool
from torch_fastload.staging import ParallelCopier


class ThreadedPinnedFeeder:
    """Mode (iii): a thread stages each batch into a pool slot and copies it to the GPU on a side
    stream; the slot goes back to the pool with its copy's event (acquire waits for it), the
    consumer's stream waits on that event and the output is record_stream'd for it."""

    def __init__(self, srcs, total: int, nbytes: int, slots: int, threads: int, device):
        self.srcs, self.total, self.nbytes, self.device = srcs, total, nbytes, device
        self.pool = PinnedPool(slots, nbytes, pin=True)
        self.copier = ParallelCopier(threads)
        self.stream = torch.cuda.Stream(device=device)
        self.q: queue.Queue = queue.Queue(maxsize=slots)
        self.stop = threading.Event()
        self.stage_s = 0.0
        self.thread = threading.Thread(target=self._run, name="pinned-loop-feeder", daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                return self.q.put(item, timeout=0.1)
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            for step in range(self.total):
                slot = self.pool.acquire(stop=self.stop, timeout=60)
                span = slot.buffer[: self.nbytes]
                t0 = time.perf_counter()
                self.copier.copy_into(span, [(0, self.srcs[step % len(self.srcs)])])
                self.stage_s += time.perf_counter() - t0
                with torch.cuda.stream(self.stream):
                    out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                    out.copy_(span, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.stream)
                self.pool.release(slot, done)
                self._put((out, done))
        except BaseException as exc:  # carried to the consumer's next()
            self._put((exc, traceback.format_exc()))

    def __next__(self) -> torch.Tensor:
        out, done = self.q.get(timeout=120)
        if isinstance(out, BaseException):
            raise RuntimeError(f"feeder thread failed:\n{done}") from out
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        torch.cuda.synchronize(self.device)
        self.copier.close()
        self.pool.close()


class Batches(torch.utils.data.Dataset):
    """Map-style dataset whose items are whole batches (for batch_size=None)."""

    def __init__(self, srcs, length: int):
        self.srcs, self.length = srcs, length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.srcs[index % len(self.srcs)]


def make_compute(kind: str, ms: float, sleeper: CudaSleeper, device) -> tuple:
    """A callable enqueueing ~``ms`` of GPU work on the current stream, and its description."""
    if ms <= 0:
        return (lambda: None), {"kind": "none"}
    if kind == "sleep":
        cycles = sleeper.cycles(ms)
        return (lambda: torch.cuda._sleep(cycles)), {"kind": "sleep", "target_ms": ms, "cycles": cycles}
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, a, out=c)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.matmul(a, a, out=c)
    end.record()
    end.synchronize()
    count = max(1, round(ms / (start.elapsed_time(end) / 20)))

    def run():
        for _ in range(count):
            torch.matmul(a, a, out=c)

    return run, {"kind": "matmul", "target_ms": ms, "matmuls": count}


def run_loop(batches, compute, args, expected=None) -> dict:
    """Consume warm-up + ``args.steps`` batches with compute per step, the host at most
    ``args.max_inflight`` steps ahead of the GPU; the timed steps' GPU time between events."""
    total, warm, nbytes = args.warmup_steps + args.steps, args.warmup_steps, args.batch_bytes
    check = torch.zeros((total, 2), dtype=torch.uint8, device=args.device)
    inflight: collections.deque = collections.deque()
    first = last = None
    for step in range(total):
        if step == warm:
            t0 = time.perf_counter()
        flat = next(batches).reshape(-1).view(torch.uint8)
        if flat.device.type != "cuda" or flat.numel() != nbytes:
            raise RuntimeError(f"step {step}: expected {nbytes} bytes on the GPU, got {flat.numel()} on {flat.device}")
        compute()
        check[step].copy_(flat[:: nbytes - 1][:2])
        last = torch.cuda.Event(enable_timing=True)
        last.record()
        first = last if step == warm - 1 else first
        inflight.append(last)
        if len(inflight) > args.max_inflight:
            inflight.popleft().synchronize()
    torch.cuda.synchronize()
    host_s = time.perf_counter() - t0
    seconds = first.elapsed_time(last) / 1e3
    res = {"step_ms": 1e3 * seconds / args.steps, "host_step_ms": 1e3 * host_s / args.steps}
    if expected is not None:
        res["gbps"] = gbps(nbytes * args.steps, seconds)
        got = check.cpu().tolist()
        wrong = [s for s in range(total) if got[s] != [expected(s)] * 2]
        res["data_check"] = "ok" if not wrong else f"{len(wrong)} of {total} batches had wrong bytes"
    return res


def one_setting(args, ms: float, sleeper: CudaSleeper, srcs: list, bar: Progress) -> dict:
    compute, info = make_compute(args.compute, ms, sleeper, args.device)
    total = args.warmup_steps + args.steps
    values = [int(s[0]) for s in srcs]
    expected = lambda step: values[step % len(srcs)]  # noqa: E731
    dummy = torch.zeros(args.batch_bytes, dtype=torch.uint8, device=args.device)

    def threaded():
        feeder = ThreadedPinnedFeeder(srcs, total, args.batch_bytes, args.slots, args.loader_threads, args.device)
        try:
            res = run_loop(feeder, compute, args, expected)
        finally:
            feeder.close()
        return {**res, "stage_gbps": gbps(args.batch_bytes * total, feeder.stage_s)}

    def loader():
        kwargs = dict(batch_size=None, device=args.device, stage_threads=args.loader_threads)
        fl = torch_fastload.DataLoader(Batches(srcs, total), **kwargs)
        faulthandler.dump_traceback_later(300, exit=True)  # a hung loader must not hang the study
        try:
            return {**run_loop(iter(fl), compute, args, expected), "stats": fl.stats().as_dict()}
        finally:
            faulthandler.cancel_dump_traceback_later()
            fl.close()

    feeds = {
        "compute-only": lambda: run_loop(iter(lambda: dummy, None), compute, args),
        "(i) pageable .cuda()": lambda: run_loop(
            (srcs[s % len(srcs)].cuda() for s in range(total)), compute, args, expected
        ),
        "(ii) pin_memory().cuda(nb)": lambda: run_loop(
            (srcs[s % len(srcs)].pin_memory().cuda(non_blocking=True) for s in range(total)), compute, args, expected
        ),
        "(iii) threaded pinned pool": threaded,
        "(iv) torch_fastload.DataLoader": loader,
    }
    modes = {}
    for name, fn in feeds.items():
        try:
            modes[name] = fn()
        except Exception as exc:
            modes[name] = {"error": f"{type(exc).__name__}: {exc}"}
        bar.update(1, f"{ms:g} ms {name}")
    base = modes["compute-only"].get("step_ms") if ms > 0 else None
    for res in modes.values():
        if base and "step_ms" in res:
            res["overlap"] = base / res["step_ms"]
    return {"compute_ms": ms, "compute": info, "modes": modes}


def plot(data: dict, plt):
    settings = data["settings"]
    names = list(settings[0]["modes"])[1:]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [s["modes"][n].get("gbps") or 0 for n in names], width, label=f"compute {s['compute_ms']:g} ms")
    ax.set_xticks(
        [j + width * (len(settings) - 1) / 2 for j in range(len(names))],
        [n.split(" ", 1)[1] for n in names],
        rotation=15,
    )
    ax.set(ylabel="effective GB/s", title=f"loop: {fmt_size(data['args']['batch_bytes'])} pageable batches")
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--batch-bytes", type=size_arg, default=64 * MiB, help="bytes a batch")
    p.add_argument("--steps", type=int, help="timed steps per feed [200; quick 40]")
    p.add_argument("--warmup-steps", type=int, help="untimed steps first [10; quick 5]")
    p.add_argument("--compute-ms", type=float_list, default=[0.0, 5.0], help="GPU compute per step, one setting each")
    p.add_argument("--compute", choices=["sleep", "matmul"], default="sleep", help="calibrated _sleep, or bf16 matmuls")
    p.add_argument("--loader-threads", type=int, default=8, help="staging threads of feeds (iii) and (iv)")
    p.add_argument("--slots", type=int, default=3, help="pinned slots of feed (iii)")
    p.add_argument("--sources", type=int, default=4, help="pre-touched pageable batches rotated")
    p.add_argument("--max-inflight", type=int, default=2, help="steps the host may run ahead of the GPU")
    args = parse_study(p, argv, steps=(200, 40, 4), warmup_steps=(10, 5, 2))
    if not needs_cuda(args, "pinned_loop.py"):
        return 2
    study = Study("pinned_loop", args, "training loop fed pageable batches")
    sleeper = CudaSleeper()
    study["sleep_calibration"] = sleeper.calibrate()
    if args.compute == "sleep" and not sleeper.available:
        args.compute = "matmul"
    srcs = [aligned_empty(args.batch_bytes, fill=(11 + 29 * i) % 251 + 1) for i in range(args.sources)]
    bar = Progress(5 * len(args.compute_ms), "loop", args.progress)
    study["settings"] = [one_setting(args, ms, sleeper, srcs, bar) for ms in args.compute_ms]
    bar.close()
    rows = []
    for s in study["settings"]:
        for name, res in s["modes"].items():
            if "error" in res:
                study["failures"].append({"what": f"{s['compute_ms']:g} ms {name}", "error": res["error"]})
            key = name.split(" ")[0].strip("()")
            study.figure(f"step_ms_{key}_{s['compute_ms']:g}ms", res.get("step_ms"))
            study.figure(f"gbps_{key}_{s['compute_ms']:g}ms", res.get("gbps"))
            study.figure(f"overlap_{key}_{s['compute_ms']:g}ms", res.get("overlap"))
            notes = res.get("error") or (res.get("data_check") or "") + (
                f"; staged {res['stage_gbps']:.1f} GB/s" if res.get("stage_gbps") else ""
            )
            rows.append(
                [
                    f"{s['compute_ms']:g}",
                    name,
                    fmt(res.get("step_ms")),
                    fmt(res.get("gbps")),
                    fmt(res.get("overlap")),
                    notes,
                ]
            )
    return study.finish(
        table(
            ["compute ms", "feed", "step ms", "GB/s", "overlap", "notes"],
            rows,
            title=f"{args.steps} steps x {fmt_size(args.batch_bytes)} pageable batches, compute {args.compute}, "
            f"stage_threads {args.loader_threads}, slots {args.slots}",
        ),
        plot=plot,
    )


if __name__ == "__main__":
    sys.exit(main())
