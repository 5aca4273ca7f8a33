#!/usr/bin/env python3
"""Issue 17: where an epoch's edge goes on the training thread, with many short epochs (GPU host).
A TensorDataset of the main job's rows (3x128x128 float32, batch 128, 16 batches an epoch) on
the GPU; each epoch times iter(), the first next() and the next() that stops, and inside iter()
its pieces (the epoch's draws, torch's iterator, the hooks, the native pipeline's set-up, its
first group's allocation and submit, the turn thread's bind). ``turn_thread`` auto and 0
alternate by block. Then a cProfile of iter() alone. Writes $OUT/edge-pieces.json.

  OUT=... PYTHONPATH=$PWD python3 benchmarks/gpu/edge_pieces.py [--epochs 200] [--profile 100]
"""

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import time

import torch
from _timed import wrap_timed

import torch_fastload
import torch_fastload.loader as L
import torch_fastload.native as N
import torch_fastload.resume as R

acc = collections.defaultdict(lambda: collections.defaultdict(list))
mode = ["?"]


def timed(obj, name, key):
    wrap_timed(obj, name, lambda seconds: acc[mode[0]][key].append(seconds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=200, help="epochs a mode (alternated in blocks of 20)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", type=int, default=100, help="epochs with iter() under cProfile (0: none)")
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 3, 128, 128, generator=g), torch.randint(0, 10, (2048,)))
    timed(R, "begin_epoch", "iter.begin_epoch")
    timed(L, "make_source", "iter.make_source")
    timed(L, "source_hooks", "iter.source_hooks")
    timed(L, "run_native_or_none", "iter.native")
    for m in ("__init__", "_describe", "_start", "_fill", "_submit_group", "_allocate_group"):
        timed(N.NativePipeline, m, "pipeline." + m)
    timed(N._TurnWorker, "bind", "turns.bind")
    timed(N._TurnWorker, "__init__", "turns.start")

    def epochs(turn: str, n: int, profile: cProfile.Profile | None = None) -> None:
        mode[0] = f"turn_thread={turn}"
        with torch_fastload.config.override(turn_thread=turn):
            for _ in range(n):
                t = time.perf_counter()
                if profile is not None:
                    profile.enable()
                it = iter(loader)
                if profile is not None:
                    profile.disable()
                a = time.perf_counter()
                batch = next(it)
                b = time.perf_counter()
                for batch in it:
                    batch[0].sum()
                c = time.perf_counter()
                try:
                    next(it)
                except StopIteration:
                    pass
                d = time.perf_counter()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                acc[mode[0]]["edge.iter"].append(a - t)
                acc[mode[0]]["edge.next_first"].append(b - a)
                acc[mode[0]]["edge.next_stop"].append(d - c)

    loader = torch_fastload.DataLoader(data, batch_size=128, shuffle=True, device=device)
    for turn in ("auto", "0"):
        epochs(turn, 10)
    acc.clear()
    for block in range(args.epochs // 20):
        for turn in ("auto", "0") if block % 2 == 0 else ("0", "auto"):
            epochs(turn, 20)
    out = {}
    for m in sorted(acc):
        print(m)
        out[m] = {}
        for k, v in sorted(acc[m].items()):
            s = sorted(v)
            out[m][k] = {"n": len(s), "p50_us": s[len(s) // 2] * 1e6, "mean_us": sum(s) / len(s) * 1e6}
            print(f"  {k:28s} n {len(s):5d}  p50 {s[len(s) // 2] * 1e6:8.1f}  mean {sum(s) / len(s) * 1e6:8.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        epochs("auto", args.profile, prof)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    loader.close()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "edge-pieces.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
