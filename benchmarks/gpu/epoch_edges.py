#!/usr/bin/env python3
"""Issue 17: what an epoch's edges cost the training thread inside the main job (GPU host).
Times, per epoch of `python -m torch_fastload.bench` (fastload and the device-resident loop):
iter(), the epoch's first next(), its steady next() calls and the next() that raises
StopIteration; inside fastload's, the native pipeline's set-up pieces (the C++ loop's
construction, the slot lease, the first fill) and shutdown pieces (the loop's stop, stats,
the slots' release). Writes $OUT/epoch-edges.json.

  OUT=... PYTHONPATH=$PWD python3 benchmarks/gpu/epoch_edges.py [bench args]
"""

import collections
import json
import os
import sys
import time

from _timed import wrap_timed

import torch_fastload.bench as B
import torch_fastload.loader as L
import torch_fastload.native as N
from torch_fastload._benchutil import workload as W

acc = collections.defaultdict(list)


def timed(obj, name, key):
    wrap_timed(obj, name, lambda seconds: acc[key].append(seconds))


timed(L.DataLoader, "__iter__", "fastload.iter")
timed(N.NativePipeline, "__init__", "pipeline.init")
for m in ("_lease_slots", "_describe", "_map_files", "_choose_copy_route", "_fill", "shutdown", "sync_stats"):
    timed(N.NativePipeline, m, "pipeline." + m)
native_require = N.engine._require


def require():
    module = native_require()

    class Timed:
        def __getattr__(self, name):
            return getattr(module, name)

        def NativeLoop(self, *a, **k):  # noqa: N802
            t = time.perf_counter()
            loop = module.NativeLoop(*a, **k)
            acc["loop.construct"].append(time.perf_counter() - t)
            return _TimedLoop(loop)

    return Timed()


class _TimedLoop:
    def __init__(self, loop):
        self._loop = loop

    def __getattr__(self, name):
        return getattr(self._loop, name)

    def stop(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._loop.stop(*a, **k)
        finally:
            acc["loop.stop"].append(time.perf_counter() - t)


N.engine._require = require
orig_next = L._FastloadIter.__next__


def fastload_next(self):
    first = self._num_yielded == 0
    t = time.perf_counter()
    try:
        out = orig_next(self)
    except StopIteration:
        acc["fastload.next.stop"].append(time.perf_counter() - t)
        raise
    acc["fastload.next.first" if first else "fastload.next.steady"].append(time.perf_counter() - t)
    return out


L._FastloadIter.__next__ = fastload_next
orig_resident_iter = W.ResidentLoader.__iter__


def resident_iter(self):
    t = time.perf_counter()
    inner = orig_resident_iter(self)
    first = True
    while True:
        a = time.perf_counter()
        try:
            out = next(inner)
        except StopIteration:
            acc["resident.next.stop"].append(time.perf_counter() - a)
            return
        acc["resident.next.first" if first else "resident.next.steady"].append(time.perf_counter() - a)
        if first:
            acc["resident.iter_to_first"].append(time.perf_counter() - t)
        first = False
        yield out


W.ResidentLoader.__iter__ = resident_iter
B.ResidentLoader = W.ResidentLoader
bench_json = os.environ["OUT"] + "/epoch-edges-bench.json"
rc = B.main(["--no-progress", "--torch-workers", "0", "--json", bench_json, *sys.argv[1:]])
res = {}
for k, v in sorted(acc.items()):
    s = sorted(v)
    res[k] = {
        "n": len(s),
        "total_ms": sum(s) * 1e3,
        "p50_us": s[len(s) // 2] * 1e6,
        "max_us": s[-1] * 1e6,
        "mean_us": sum(s) / len(s) * 1e6,
    }
for k, v in res.items():
    print(
        f"{k:34s} n {v['n']:5d}  total {v['total_ms']:8.2f} ms  p50 {v['p50_us']:9.1f}  "
        f"mean {v['mean_us']:9.1f}  max {v['max_us']:9.1f} us"
    )
json.dump(res, open(os.environ["OUT"] + "/epoch-edges.json", "w"), indent=1)
sys.exit(rc)
