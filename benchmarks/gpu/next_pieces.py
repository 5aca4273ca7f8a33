#!/usr/bin/env python3
"""Per-piece host cost of NativePipeline.next() inside the main job (GPU host): each method of
the native pipeline, the C++ loop calls and the stats calls are wrapped with perf_counter while
`python -m torch_fastload.bench` runs; then the same pieces alone in a tight loop. Writes
$OUT/next-pieces.json. Used by benchmarks/gpu/step17.sh."""

import collections
import json
import os
import sys
import time

import torch

import torch_fastload.bench as B
import torch_fastload.native as N

acc = collections.defaultdict(list)


def wrap(obj, name, key):
    f = getattr(obj, name)
    if getattr(f, "_timed", False):  # the loader's stats outlive an epoch's pipeline: wrap once
        return

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key].append(time.perf_counter() - t)

    w._timed = True
    setattr(obj, name, w)


def split_allocate_on(self, stream, shapes):
    """CopyEngine.allocate_on with its pieces timed: the stream switch, the allocations."""
    t0 = time.perf_counter()
    prior = torch._C._cuda_getCurrentStream(self._index)
    torch._C._cuda_setStream(
        stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
    )
    t1 = time.perf_counter()
    try:
        out = []
        for shape, dtype in shapes:
            a = time.perf_counter()
            out.append(torch.empty(shape, dtype=dtype, device=self.device))
            acc["alloc.empty_one"].append(time.perf_counter() - a)
        return out
    finally:
        t2 = time.perf_counter()
        torch._C._cuda_setStream(stream_id=prior[0], device_index=prior[1], device_type=prior[2])
        t3 = time.perf_counter()
        acc["alloc.switch_to"].append(t1 - t0)
        acc["alloc.empties"].append(t2 - t1)
        acc["alloc.switch_back"].append(t3 - t2)


if os.environ.get("PIECES_DETAIL") == "1":
    from torch_fastload.transfer import CopyEngine

    CopyEngine.allocate_on = split_allocate_on


P = N.NativePipeline
PIECES = ("next", "_fill", "_take", "_views", "_allocate", "_allocate_group", "_submit_group", "_consumer_stream")
PIECES += ("_group_views", "_claim_group", "_full_batches", "_same_size", "_next_indices")  # the group's turn
for m in PIECES:
    if hasattr(P, m):
        wrap(P, m, m)
orig_init = P.__init__


def init(self, *a, **k):
    orig_init(self, *a, **k)
    src = self.source
    wrap(src, "_next_index", "sampler")
    if getattr(self, "_index_arrays", None) is not None:
        arrays = self._index_arrays

        def timed_arrays():
            while True:
                t = time.perf_counter()
                try:
                    a = next(arrays)
                except StopIteration:
                    return
                acc["sampler.arrays"].append(time.perf_counter() - t)
                yield a

        self._index_arrays = timed_arrays()
    loop = self.loop

    class L:  # proxy timing submit/take calls of the C++ loop
        def __getattr__(s, n):
            return getattr(loop, n)

        def submit(s, *a, **k):
            t = time.perf_counter()
            r = loop.submit(*a, **k)
            acc["loop.submit"].append(time.perf_counter() - t)
            return r

        def submit_fields(s, *a, **k):
            t = time.perf_counter()
            r = loop.submit_fields(*a, **k)
            acc["loop.submit_fields"].append(time.perf_counter() - t)
            return r

        def submit_group(s, *a, **k):
            t = time.perf_counter()
            r = loop.submit_group(*a, **k)
            acc["loop.submit_group"].append(time.perf_counter() - t)
            return r

        def take(s, *a, **k):
            t = time.perf_counter()
            r = loop.take(*a, **k)
            acc["loop.take"].append(time.perf_counter() - t)
            return r

    self.loop = L()
    st = self.stats
    for m in ("request_started", "delivered", "mark"):
        wrap(st, m, "stats." + m)
    wrap(self.progress, "yielded", "progress.yielded")


P.__init__ = init
rc = B.main(
    [
        "--no-progress",
        "--no-resident",
        "--torch-workers",
        "0",
        "--json",
        os.environ["OUT"] + "/next-pieces-bench.json",
        *sys.argv[1:],
    ]
)
res = {}
for k, v in acc.items():
    v = sorted(v)
    res[k] = {
        "n": len(v),
        "p50_us": v[len(v) // 2] * 1e6,
        "p90_us": v[int(len(v) * 0.9)] * 1e6,
        "mean_us": sum(v) / len(v) * 1e6,
    }
# standalone costs on this host
dev = torch.device("cuda")


def t(f, n=3000):
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


x = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
res["alone.torch.empty.cuda"] = t(lambda: torch.empty(128 * 49216, dtype=torch.uint8, device=dev))
res["alone.view3"] = t(lambda: x[0:4096].view(torch.float32).view((8, 128)))
res["alone.raw_stream"] = t(lambda: torch._C._cuda_getCurrentRawStream(0))
res["alone.current_stream"] = t(lambda: torch.cuda.current_stream())
bs = iter(torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(10**7)), 128, True))
res["alone.batch_sampler"] = t(lambda: next(bs))
a = torch.randn(64, 64, device=dev)
res["alone.tiny_kernel_launch"] = t(lambda: a.add_(1))
block = torch.empty(8 * 49664, dtype=torch.float32, device=dev)
strided = ((8, 128, 384), (49664, 384, 1))
res["alone.as_strided_unbind8.cuda"] = t(lambda: block.as_strided(*strided).unbind(0))
host_block = torch.empty(8 * 49664, dtype=torch.float32)
res["alone.as_strided_unbind8.cpu"] = t(lambda: host_block.as_strided(*strided).unbind(0))
res["alone.python_call"] = t(lambda: None)
print(json.dumps(res, indent=1))
json.dump(res, open(os.environ["OUT"] + "/next-pieces.json", "w"), indent=1)
