"""Where an epoch edge's time goes (issue 6): the file loader of ddp_scaling.py on one GPU.

    python benchmarks/probes/probe_epoch_edge.py --epochs 8 --out $OUT/edge

The 2-GPU scaling run lost ~11 ms an epoch at its edges (iter() to the first batch, and the
end-of-epoch shutdown). This probe stamps each step of both on the host (which thread, when),
times each variant's epochs, and writes a torch.profiler trace (CPU + CUDA) of two edges, so
the GPU's idle gap can be read next to the host's steps. Variants:
  default    the loader as it is
  nosync     the end-of-epoch shutdown does not wait for the copy stream
  switch     sys.setswitchinterval(0.5 ms) (is a thread waiting for the GIL?)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import ddp_scaling  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload import io as fio  # noqa: E402
from torch_fastload import loader as loader_mod  # noqa: E402
from torch_fastload import transfer  # noqa: E402
from torch_fastload.sources.arrays import ArrayDataset  # noqa: E402

STAMPS: list = []


def stamp(label: str) -> None:
    STAMPS.append((time.perf_counter(), threading.current_thread().name, label))


def instrument(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        stamp(label + " in")
        try:
            return original(*args, **kwargs)
        finally:
            stamp(label + " out")

    setattr(owner, name, wrapper)


def instrument_queues() -> None:
    put, get = loader_mod._Pipeline._put, loader_mod._Pipeline._get

    def _put(self, q, item):
        which = "fetched" if q is self.fetched else "ready"
        ok = put(self, q, item)
        stamp(f"put {which} #{item[0]}" + (" END" if item[2] is loader_mod._END else ""))
        return ok

    def _get(self, q):
        item = get(self, q)
        if item is not None:
            stamp(f"got fetched #{item[0]}")
        return item

    loader_mod._Pipeline._put, loader_mod._Pipeline._get = _put, _get


def install() -> None:
    P = loader_mod._Pipeline
    instrument(loader_mod.DataLoader, "__iter__", "iter")
    instrument(loader_mod, "_first_pulled", "first_pulled")
    instrument(P, "__init__", "pipeline init")
    instrument(P, "next", "next")
    instrument(P, "shutdown", "shutdown")
    instrument(P, "_fetch_loop", "fetch thread")
    instrument(P, "_stage_loop", "stage thread")
    instrument(P, "_stage_and_copy", "stage_and_copy")
    instrument(fio.EngineReader, "_read", "engine read")
    instrument(transfer.CopyEngine, "start", "copy start")
    instrument(transfer.CopyEngine, "synchronize", "sync")
    instrument_queues()


def run_variant(name: str, ds, args, consumer, trace_path: Path | None) -> dict:
    Sampler = ddp_scaling.distributed_sampler_class()
    sampler = Sampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch_fastload.DataLoader(ds, batch_size=args.batch, sampler=sampler, device=args.device)
    if name == "switch":
        old_switch = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
    engine = loader._resources()[0]
    if name == "nosync":
        real = engine.synchronize
        engine.synchronize = lambda timeout: True  # the pipeline's END shutdown only
    epochs = []
    profiler = None
    try:
        for epoch in range(args.epochs):
            if trace_path is not None and args.device == "cuda" and epoch == args.epochs - 3:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                profiler.__enter__()
            sampler.set_epoch(epoch)
            consumer.begin_epoch(epoch)
            first = len(STAMPS)
            stamp("epoch begin")
            t0 = time.perf_counter()
            n = 0
            for batch in loader:
                if n == 0:
                    t_first = time.perf_counter()
                consumer(batch, False)
                n += 1
                stamp("consumed")
            stamp("loop exited")
            t_end = time.perf_counter()
            consumer.end_epoch()
            if args.device == "cuda":
                torch.cuda.synchronize()
            stamp("epoch synced")
            t_sync = time.perf_counter()
            epochs.append(
                {
                    "epoch": epoch,
                    "batches": n,
                    "first_batch_ms": 1e3 * (t_first - t0),
                    "loop_ms": 1e3 * (t_end - t0),
                    "end_epoch_sync_ms": 1e3 * (t_sync - t_end),
                    "stamps": (first, len(STAMPS)),
                }
            )
            if profiler is not None and epoch == args.epochs - 2:
                profiler.__exit__(None, None, None)
                profiler.export_chrome_trace(str(trace_path))
                profiler = None
    finally:
        if name == "nosync":
            engine.synchronize = real
        if name == "switch":
            sys.setswitchinterval(old_switch)
        loader.close()
    timed = epochs[1:]
    total_ms = sum(e["loop_ms"] + e["end_epoch_sync_ms"] for e in timed)
    samples = sum(e["batches"] for e in timed) * args.batch
    return {
        "variant": name,
        "epochs": epochs,
        "samples_per_s": samples / total_ms * 1e3,
        "epoch_ms": statistics.median(e["loop_ms"] + e["end_epoch_sync_ms"] for e in timed),
        "first_batch_ms": statistics.median(e["first_batch_ms"] for e in timed),
        "end_sync_ms": statistics.median(e["end_epoch_sync_ms"] for e in timed),
    }


def edge_timeline(result: dict, epoch_index: int) -> list:
    """The stamps from the previous epoch's last 'consumed' to this epoch's first, in ms."""
    prev, cur = result["epochs"][epoch_index - 1], result["epochs"][epoch_index]
    lo = prev["stamps"][1] - 1
    while lo > prev["stamps"][0] and STAMPS[lo][2] != "consumed":
        lo -= 1
    hi = cur["stamps"][0]
    while hi < cur["stamps"][1] and STAMPS[hi][2] != "consumed":
        hi += 1
    base = STAMPS[lo][0]
    return [(round(1e3 * (t - base), 3), thread, label) for t, thread, label in STAMPS[lo : hi + 1]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--row-kib", type=float, default=192.0)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--variants", default="default,nosync,switch,default")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the probe itself")
    p.add_argument("--dir", type=Path, default=REPO / "benchmarks" / "out" / "data-ddp")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "edge")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    layout = ddp_scaling.data_layout(SimpleNamespace(row_kib=args.row_kib, gib=args.gib, seed=0))
    paths = ddp_scaling.make_data(args.dir, layout)
    files = [str(paths[k]) for k in ("features", "labels", "ids")]
    ddp_scaling.warm_page_cache(files)
    ds = ArrayDataset(*files)
    consumer = ddp_scaling.Consumer(len(ds), torch.device(args.device), 0.0, paths["features"], False)
    install()
    results = []
    for k, name in enumerate(args.variants.split(",")):
        trace = args.out / f"edge_trace_{name}_{k}.json" if k == 0 else None
        result = run_variant(name, ds, args, consumer, trace)
        results.append(result)
        print(
            f"{name:8s} {result['samples_per_s']:>10,.0f} samples/s  epoch {result['epoch_ms']:.1f} ms  "
            f"first batch {result['first_batch_ms']:.2f} ms  end-of-epoch sync {result['end_sync_ms']:.2f} ms",
            flush=True,
        )
        for e in (2, 3):
            if e < len(result["epochs"]):
                result[f"edge_{e}"] = edge_timeline(result, e)
    for line in results[0].get("edge_2", []):
        print(f"  {line[0]:9.3f} ms  {line[1]:22s} {line[2]}")
    for r in results:
        for e in r["epochs"]:
            e.pop("stamps")
    (args.out / "edge.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
