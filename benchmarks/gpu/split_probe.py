"""Why a CPU + nvJPEG split of each batch does not beat nvJPEG alone (issue 20).

The route trial measured, loader alone on an H100: every JPEG on the C++ decoder 31.9 ms a batch
of 256, nvJPEG (torchvision's hardware-engine batched decode) 17.3 ms, yet a split at share 0.35
16.8 ms where the two rates predict ~11 ms. This times the two decoders' raw rates alone and at
once (separate threads, as two stage threads run them), then the loader at fixed shares.

    python3 benchmarks/gpu/split_probe.py OUT.json [--classes 100 --per-class 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

import torch_fastload
from torch_fastload import _C
from torch_fastload.sources.images import ImageFolder
from torch_fastload.vision import TrainTransform
from torch_fastload.vision.cpu import NativeJpegs
from torch_fastload.vision.gpu_backend import gpu_backend
from torch_fastload.vision.probe import probe
from torch_fastload.vision.routing import route
from torch_fastload.vision.sample_data import make_image_folder
from torch_fastload.vision.settings import GPU_MAX_PIXELS

BATCH = 256


def log(*a):
    print(*a, flush=True)


class Jpegs:
    """Every JPEG the loader would send to nvJPEG (its own ``route``), in one pinned slab, with
    probed sizes and crop regions."""

    def __init__(self, train_dir: str):
        blobs = [Path(path).read_bytes() for path in ImageFolder(train_dir, transform=None).paths]
        every = np.frombuffer(b"".join(blobs), np.uint8)
        bounds = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
        routes = route(probe(every, bounds), torch.device("cuda"), GPU_MAX_PIXELS)
        blobs = [b for b, r in zip(blobs, routes) if r == "nvjpeg"]
        self.offsets = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
        self.slab = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).pin_memory()
        self.info = probe(self.slab.numpy(), self.offsets)
        self.n = len(blobs)
        geometry = TrainTransform().geometry(self.info[:, 1], self.info[:, 2], np.random.default_rng(0))
        self.boxes = np.stack([geometry.top, geometry.left, geometry.height, geometry.width], axis=1)
        self.views = [self.slab[self.offsets[i] : self.offsets[i + 1]] for i in range(self.n)]

    def batch(self, k: int, size: int) -> list:
        first = (k * size) % (self.n - size)
        return list(range(first, first + size))


class CpuDecoder:
    """The C++ decoder (crop regions, as the loader's split decodes) into a pinned buffer."""

    def __init__(self, jpegs: Jpegs, threads: int):
        self.jpegs, self.threads = jpegs, threads
        self.buffer = torch.empty(BATCH * 3 * 500 * 500, dtype=torch.uint8).pin_memory()

    def decode(self, which: list) -> None:
        j = self.jpegs
        boxes = j.boxes
        sizes = 3 * boxes[which, 2] * boxes[which, 3]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        args = NativeJpegs.of(j.slab, j.offsets, j.info, boxes, which, self.buffer, starts)
        messages = _C.decode_jpegs_planar(**args.kwargs(), num_threads=self.threads)
        assert not any(messages), [m for m in messages if m][:3]


class GpuDecoder:
    def __init__(self, jpegs: Jpegs, device: torch.device):
        self.jpegs, self.backend = jpegs, gpu_backend(device, "torchvision")

    def decode(self, which: list) -> None:
        out = self.backend.decode([self.jpegs.views[i] for i in which])
        assert all(o is not None for o in out)


def cpu_work(jpegs: Jpegs, decoder: CpuDecoder):
    """Batches other than the GPU's (offset by 7), as a split's two parts are."""
    return lambda k, size: decoder.decode(jpegs.batch(k + 7, size))


def run_for(seconds: float, work, size: int, stop: threading.Event | None = None) -> dict:
    """Calls ``work(batch)`` for ``seconds``: images/s, and host CPU seconds a batch of this thread."""
    k, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
        work(k, size)
        k += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {
        "images_per_s": k * size / wall,
        "batches": k,
        "ms_a_batch": 1e3 * wall / max(k, 1),
        "thread_cpu_ms_a_batch": 1e3 * (time.thread_time() - c0) / max(k, 1),
    }


def together(seconds: float, parts: list) -> list:
    """Each (work, size) on its own thread at once; each one's rate."""
    results: list = [None] * len(parts)
    start = threading.Barrier(len(parts))

    def go(i, work, size):
        start.wait()
        results[i] = run_for(seconds, work, size)

    threads = [threading.Thread(target=go, args=(i, w, s)) for i, (w, s) in enumerate(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class Phases:
    """Wall and thread-CPU time of named methods, per call, on whichever thread runs them."""

    def __init__(self):
        self.calls: list = []
        self._lock = threading.Lock()
        self._undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(*a, **k)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                with self._lock:
                    self.calls.append((label, threading.current_thread().name, t0, t1, c1 - c0))

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def summary(self, since: float) -> dict:
        out: dict = {}
        for label, _thread, t0, t1, cpu in self.calls:
            if t0 < since:
                continue
            row = out.setdefault(label, {"calls": 0, "wall_ms": 0.0, "cpu_ms": 0.0})
            row["calls"] += 1
            row["wall_ms"] += 1e3 * (t1 - t0)
            row["cpu_ms"] += 1e3 * cpu
        for row in out.values():
            row["wall_ms_a_call"] = row["wall_ms"] / row["calls"]
            row["cpu_ms_a_call"] = row["cpu_ms"] / row["calls"]
        return out


def instrument() -> Phases:
    from torch_fastload.sources.images import ImageFolder as Folder
    from torch_fastload.vision import decode as dec
    from torch_fastload.vision.gpu_backend import TorchvisionNvjpeg

    phases = Phases()
    phases.wrap(Folder, "__fastload_finish__", "stage: whole batch")
    for name in ("_route", "_start_cpu", "_decode_on_gpu", "_cpu_results", "_place", "_assemble", "_decode_native"):
        phases.wrap(dec.BatchDecoder, name, name)
    phases.wrap(dec.CpuSide, "wait", "cpu.wait")
    phases.wrap(TorchvisionNvjpeg, "decode", "torchvision decode call")
    from torch_fastload.vision.nvjpeg_direct import DirectNvjpeg

    phases.wrap(DirectNvjpeg, "decode", "nvjpeg decode call")
    phases.wrap(DirectNvjpeg, "_decode_batch", "nvjpeg batched call (retries too)")
    phases.wrap(DirectNvjpeg, "_shape", "nvjpeg header read")
    phases.wrap(TrainTransform, "apply", "transform.apply")
    return phases


def loader_rate(train_dir: str, share, epochs: int = 3, batch: int = BATCH, device: str = "cuda") -> dict:
    """The loader alone at a cpu_decode_share: best of ``epochs`` after one untimed ("auto":
    after the route trial chose, its choice in ``chosen``)."""
    with torch_fastload.config.override(cpu_decode_share=share):
        loader = torch_fastload.DataLoader(
            ImageFolder(train_dir, TrainTransform(), seed=0), batch, shuffle=True, drop_last=True, device=device
        )
        on_gpu = torch.device(device).type == "cuda"
        rates, cpu = [], []
        phases = instrument()
        untimed = 1
        if share == "auto":
            untimed = 0
            while untimed < 12 and not trial_chose(loader):
                for _ in loader:
                    pass
                untimed += 1
        for epoch in range(untimed - 1, untimed + epochs):
            if on_gpu:
                torch.cuda.synchronize()
            t0, c0, images = time.perf_counter(), time.process_time(), 0
            if epoch == untimed:
                timed_from = t0
            for _x, y in loader:
                images += len(y)
            if on_gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            if epoch >= untimed:
                rates.append(images / wall)
                cpu.append((time.process_time() - c0) / wall)
        stats = loader.stats()
        phases.restore()
    return {
        "share": share,
        "images_per_s": max(rates),
        "epochs": rates,
        "cores": cpu,
        "phases": phases.summary(timed_from),
        "chosen": trial_chose(loader) if share == "auto" else None,
        "trial": trial_described(loader),
        "decoded": getattr(stats, "decoded", None) if not isinstance(stats, dict) else stats.get("decoded"),
        "failed_batches": direct_failures(),
    }


def direct_failures() -> dict | None:
    """The direct nvJPEG decoder's failed batched calls by nvJPEG status, where it was made."""
    from torch_fastload.vision import gpu_backend as backends

    made = [b for (choice, _), b in backends._chosen.items() if choice == "nvjpeg"]
    return {str(k): v for k, v in made[0].failed_batches.items()} if made else None


def raw_rates(jpegs: Jpegs, device: torch.device, s: float) -> dict:
    """The two decoders' rates alone and at once, outside the loader."""
    gpu = GpuDecoder(jpegs, device)
    cpu12, cpu8, cpu4 = (CpuDecoder(jpegs, t) for t in (12, 8, 4))
    hw = lambda k, size: gpu.decode(jpegs.batch(k, size))  # noqa: E731
    on = {t: cpu_work(jpegs, d) for t, d in ((12, cpu12), (8, cpu8), (4, cpu4))}
    for w in (hw, *on.values()):
        run_for(1.0, w, BATCH)  # warm: decoders made, threads started
    rows = {}
    rows["nvjpeg alone, 256"] = [run_for(s, hw, BATCH)]
    rows["nvjpeg alone, 166"] = [run_for(s, hw, 166)]
    rows["two nvjpeg threads, 256 each"] = together(s, [(hw, BATCH), (hw, BATCH)])
    for t in (12, 8, 4):
        rows[f"cpu {t} threads alone, 90"] = [run_for(s, on[t], 90)]
    for t in (12, 8, 4):
        rows[f"nvjpeg 166 + cpu {t} threads 90, at once"] = together(s, [(hw, 166), (on[t], 90)])
    rows["two stage-like threads: (nvjpeg 166 then cpu-12 90) x2"] = together(
        s, [(lambda k, size: (hw(k, 166), on[12](k, 90)), 256)] * 2
    )

    def split_batch(k, size):  # the loader's shape: CPU part on a thread, GPU part here, then join
        t = threading.Thread(target=on[12], args=(k, 90))
        t.start()
        hw(k, 166)
        t.join()

    rows["split batches, one stage thread"] = [run_for(s, split_batch, 256)]
    rows["split batches, two stage threads"] = together(s, [(split_batch, 256), (split_batch, 256)])
    for name, rs in rows.items():
        log(
            f"{name:55s} "
            + " | ".join(
                f"{r['images_per_s']:8,.0f} img/s {r['ms_a_batch']:6.1f} ms/batch"
                f" cpu {r['thread_cpu_ms_a_batch']:5.1f} ms"
                for r in rs
            )
        )
    return rows


def trial_chose(loader):
    """The route trial's choice (None while it runs), from the dataset's decoder."""
    for decoder in loader.dataset._decoders.values():
        if decoder.trial is not None and decoder.trial.choice is not None:
            return str(decoder.trial.choice)
    return None


def trial_described(loader) -> list:
    """What each route trial of the dataset's decoders measured (its balance included)."""
    return [d.trial.describe() for d in loader.dataset._decoders.values() if d.trial is not None]


def print_loader_row(r: dict) -> None:
    log(
        f"loader share {r['share']} (chosen {r.get('chosen')}): {r['images_per_s']:,.0f} images/s "
        f"(epochs {[round(x) for x in r['epochs']]}), "
        f"cores {[round(c, 1) for c in r['cores']]}, decoded {r['decoded']}"
        + (f", direct nvJPEG's failed batches {r['failed_batches']}" if r.get("failed_batches") is not None else "")
    )
    for label, row in sorted(r["phases"].items(), key=lambda kv: -kv[1]["wall_ms"]):
        log(
            f"   {label:28s} {row['calls']:5d} calls {row['wall_ms_a_call']:7.2f} ms wall {row['cpu_ms_a_call']:7.2f} "
            f"ms cpu a call ({row['wall_ms'] / 1e3:6.2f} s in all)"
        )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dir", default="/tmp/split-probe")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--shares", default="0,0.17,0.25,0.35")
    p.add_argument("--stage-threads", default="2")
    p.add_argument("--skip-raw", action="store_true", help="only the loader rows")
    p.add_argument("--backends", default="auto", help="decode_backend values of the loader rows, in turn")
    args = p.parse_args()
    device = torch.device("cuda")
    result: dict = {
        "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name(),
    }
    log(result["lscpu"])
    train, _ = make_image_folder(args.dir, args.classes, args.per_class, 1, edge_cases=False, progress=False)
    jpegs = Jpegs(train)
    log(f"{jpegs.n} JPEGs nvJPEG takes, mean {jpegs.offsets[-1] / jpegs.n / 1e3:.0f} KB")
    result["raw"] = raw_rates(jpegs, device, args.seconds) if not args.skip_raw else None
    result["loader"] = []

    for stage_threads in [int(x) for x in args.stage_threads.split(",")]:
        # image_batches_staged (the loader keeps at least 2, at most prefetch + 1 = 3)
        log(f"-- {stage_threads} stage threads")
        for share in [x if x == "auto" else float(x) for x in args.shares.split(",")]:
            for backend in args.backends.split(","):
                with torch_fastload.config.override(image_batches_staged=stage_threads, decode_backend=backend):
                    r = loader_rate(train, share)
                r["stage_threads"], r["decode_backend"] = stage_threads, backend
                result["loader"].append(r)
                log(f"decode_backend={backend}:")
                print_loader_row(r)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
