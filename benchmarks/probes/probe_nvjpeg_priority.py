"""Is nvJPEG ~9x slower beside a saturating training step because its stream has no priority?

torchvision's ``decode_jpegs_cuda`` decodes on a normal-priority pool stream, so its colour
conversion kernels queue behind the step's kernels. This probe calls libnvjpeg's batched
(hardware) decoder itself through ctypes, on a stream of our choosing, and times a batch of 256
alone and beside a ResNet-50 bf16 step loop: torchvision, ours on a normal stream, ours on a
high-priority stream, with nvJPEG's memory pools, to YUV (no colour-conversion kernel), two
states alternating with no wait a batch, two threads, and training on a side stream. It also
checks our pixels against torchvision's. Findings: RESULTS.md, "nvJPEG's hardware engines
driven directly" (the hardware path was integrated, measured slower end to end and reverted).

    python benchmarks/probes/probe_nvjpeg_priority.py [OUT.json]
"""

import ctypes
import glob
import json
import os
import site
import statistics
import sys
import threading
import time

import numpy as np
import torch
import torchvision

sys.path.insert(0, os.getcwd())
from torch_fastload.vision.decode import probe, route  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402

BATCH = 256
dev = torch.device("cuda", 0)


def find_nvjpeg() -> list:
    roots = [os.path.dirname(torchvision.__file__), os.path.dirname(torch.__file__)] + site.getsitepackages()
    pats = []
    for r in roots:
        pats += [
            f"{r}/../torchvision.libs/libnvjpeg*.so*",
            f"{r}/lib/libnvjpeg*.so*",
            f"{r}/nvidia/*/lib/libnvjpeg*.so*",
            f"{r}/nvidia/cu*/lib/libnvjpeg*.so*",
        ]
    pats += [
        "/usr/local/cuda*/lib64/libnvjpeg.so*",
        "/usr/local/cuda*/targets/*/lib/libnvjpeg.so*",
        "/usr/lib/x86_64-linux-gnu/libnvjpeg.so*",
    ]
    found = []
    for p in pats:
        found += sorted(glob.glob(p))
    return list(dict.fromkeys(os.path.realpath(f) for f in found))


class Nvjpeg:
    def __init__(self, path, flags=0):
        self.lib = lib = ctypes.CDLL(path)
        vp = ctypes.c_void_p
        lib.nvjpegCreateEx.argtypes = [ctypes.c_int, vp, vp, ctypes.c_uint, ctypes.POINTER(vp)]
        lib.nvjpegJpegStateCreate.argtypes = [vp, ctypes.POINTER(vp)]
        lib.nvjpegDecodeBatchedInitialize.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.nvjpegDecodeBatched.argtypes = [vp, vp, vp, vp, vp, vp]
        lib.nvjpegJpegStreamCreate.argtypes = [vp, ctypes.POINTER(vp)]
        lib.nvjpegJpegStreamParseHeader.argtypes = [vp, vp, ctypes.c_size_t, vp]
        lib.nvjpegDecodeBatchedSupported.argtypes = [vp, vp, ctypes.POINTER(ctypes.c_int)]
        lib.nvjpegGetImageInfo.argtypes = [
            vp,
            vp,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_int),
            vp,
            vp,
        ]
        self.handle = vp()
        status = lib.nvjpegCreateEx(3, None, None, flags, ctypes.byref(self.handle))  # NVJPEG_BACKEND_HARDWARE
        self.hardware = status == 0
        if status != 0:
            print("hardware backend refused:", status, "-> default backend", flush=True)
            self.check(lib.nvjpegCreateEx(0, None, None, 0, ctypes.byref(self.handle)), "create")
        self.local = threading.local()

    @staticmethod
    def check(status, what):
        if status != 0:
            raise RuntimeError(f"nvjpeg {what}: status {status}")

    def state(self):
        if not hasattr(self.local, "state"):
            s = ctypes.c_void_p()
            self.check(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(s)), "state")
            self.local.state = s
        return self.local.state

    def supported(self, blobs) -> list:
        js = ctypes.c_void_p()
        self.check(self.lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(js)), "stream")
        ok = []
        for b in blobs:
            r = ctypes.c_int(-1)
            if self.lib.nvjpegJpegStreamParseHeader(self.handle, b.data_ptr(), b.numel(), js) == 0:
                self.check(self.lib.nvjpegDecodeBatchedSupported(self.handle, js, ctypes.byref(r)), "supported")
            ok.append(r.value == 0)
        return ok

    def new_state(self):
        s = ctypes.c_void_p()
        self.check(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(s)), "state")
        return s

    def yuv_layout(self, blobs):
        """Per image the (height, width) of each of its planes, from nvjpegGetImageInfo."""
        planes = []
        for b in blobs:
            comps, sub = ctypes.c_int(), ctypes.c_int()
            w, h = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
            self.check(
                self.lib.nvjpegGetImageInfo(
                    self.handle, b.data_ptr(), b.numel(), ctypes.byref(comps), ctypes.byref(sub), w, h
                ),
                "info",
            )
            planes.append([(h[c], w[c]) for c in range(comps.value)])
        return planes

    def decode_yuv(self, blobs, planes, stream):
        n = len(blobs)
        sizes = [[ph * pw for ph, pw in p] for p in planes]
        total = sum(sum(s) for s in sizes)
        with torch.cuda.stream(stream):
            out = torch.empty(total, dtype=torch.uint8, device=dev)
        dest = np.zeros((n, 8), dtype=np.uint64)
        at = out.data_ptr()
        for i, p in enumerate(planes):
            for c, (ph, pw) in enumerate(p):
                dest[i, c], dest[i, 4 + c] = at, pw
                at += ph * pw
        ptrs = np.array([b.data_ptr() for b in blobs], dtype=np.uint64)
        lens = np.array([b.numel() for b in blobs], dtype=np.uint64)
        st = self.state()
        self.check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, st, n, 1, 1), "init")  # NVJPEG_OUTPUT_YUV
        self.check(
            self.lib.nvjpegDecodeBatched(
                self.handle, st, ptrs.ctypes.data, lens.ctypes.data, dest.ctypes.data, stream.cuda_stream
            ),
            "decode yuv",
        )
        return out

    def decode(self, blobs, heights, widths, stream, state=None):
        """Every image planar RGB into one device buffer; returns (buffer, per-image views)."""
        n = len(blobs)
        sizes = 3 * heights * widths
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        with torch.cuda.stream(stream):
            out = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=dev)
        base = out.data_ptr()
        dest = np.zeros((n, 8), dtype=np.uint64)
        plane = heights * widths
        dest[:, 0] = base + starts
        dest[:, 1] = base + starts + plane
        dest[:, 2] = base + starts + 2 * plane
        dest[:, 4] = dest[:, 5] = dest[:, 6] = widths
        ptrs = np.array([b.data_ptr() for b in blobs], dtype=np.uint64)
        lens = np.array([b.numel() for b in blobs], dtype=np.uint64)
        st = state if state is not None else self.state()
        self.check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, st, n, 1, 3), "init")  # NVJPEG_OUTPUT_RGB
        self.check(
            self.lib.nvjpegDecodeBatched(
                self.handle, st, ptrs.ctypes.data, lens.ctypes.data, dest.ctypes.data, stream.cuda_stream
            ),
            "decode",
        )
        views = [out[s : s + 3 * h * w].view(3, h, w) for s, h, w in zip(starts, heights, widths)]
        return out, views


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    report = {"device": torch.cuda.get_device_name(), "libs": find_nvjpeg()}
    print("libnvjpeg candidates:", report["libs"], flush=True)
    train, _ = make_image_folder("/tmp/probe-imgs-8", classes=64, train_per_class=8, val_per_class=1, progress=False)
    files = sorted(glob.glob(f"{train}/*/*"))
    blobs = [torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8).pin_memory() for f in files]
    offsets = np.concatenate([[0], np.cumsum([b.numel() for b in blobs])])
    info = probe(torch.cat(blobs).numpy(), offsets)
    keep = [i for i, r in enumerate(route(info, dev, 1 << 26)) if r == "nvjpeg"]
    report["nvjpeg_routed"] = len(keep)
    blobs, info = [blobs[i] for i in keep], info[keep]
    nj = Nvjpeg(report["libs"][0])
    report["hardware_backend"] = nj.hardware
    hw = nj.supported(blobs)
    report["batched_supported"] = sum(hw)
    keep = [i for i in range(len(blobs)) if hw[i]][:BATCH]
    blobs, info = [blobs[i] for i in keep], info[keep]
    report["images"] = len(blobs)
    heights, widths = info[:, 1].astype(np.int64), info[:, 2].astype(np.int64)
    normal = torch.cuda.Stream(dev)
    high = torch.cuda.Stream(dev, priority=-5)
    report["priority_range"] = (
        torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else None
    )

    tv = torch.ops.image.decode_jpegs_cuda(blobs, 3, dev)
    _, ours = nj.decode(blobs, heights, widths, normal)
    torch.cuda.synchronize()
    diff = max(int((a.int() - b.int()).abs().max()) for a, b in zip(tv, ours))
    report["max_abs_diff_vs_torchvision"] = diff
    print(
        "hardware",
        nj.hardware,
        "supported",
        report["batched_supported"],
        "of",
        report["nvjpeg_routed"],
        "batch",
        len(blobs),
        "max |diff|",
        diff,
        flush=True,
    )

    def run_tv():
        torch.ops.image.decode_jpegs_cuda(blobs, 3, dev)
        torch.cuda.current_stream().synchronize()

    def timed(queue, stream):
        """A decode that reports the host time of its call, then waits for its GPU work."""

        def go():
            t = time.perf_counter()
            queue()
            call = time.perf_counter() - t
            stream.synchronize()
            return call

        return go

    def run_ours(stream):
        return timed(lambda: nj.decode(blobs, heights, widths, stream), stream)

    pools = Nvjpeg(report["libs"][0], flags=2)  # NVJPEG_FLAGS_ENABLE_MEMORY_POOLS
    run_pools = timed(lambda: pools.decode(blobs, heights, widths, normal), normal)
    yuv = Nvjpeg(report["libs"][0])
    planes = yuv.yuv_layout(blobs)
    report["yuv_planes_first"] = planes[:3]
    run_yuv = timed(lambda: yuv.decode_yuv(blobs, planes, high), high)

    pipe = {
        "states": [nj.new_state(), nj.new_state()],
        "events": [None, None],
        "turn": 0,
        "stream": torch.cuda.Stream(dev),
    }

    def run_pipelined():
        """Two states alternate; a state is reused once its previous batch completed (no sync per batch)."""
        k = pipe["turn"] = 1 - pipe["turn"]
        if pipe["events"][k] is not None:
            pipe["events"][k].synchronize()
        nj.decode(blobs, heights, widths, pipe["stream"], pipe["states"][k])
        ev = pipe["events"][k] = torch.cuda.Event()
        ev.record(pipe["stream"])

    decoders = {
        "ours-pipelined": run_pipelined,
        "ours-yuv": run_yuv,
        "torchvision": run_tv,
        "ours-normal": run_ours(normal),
        "ours-high": run_ours(high),
        "ours-pools": run_pools,
    }
    for name, fn in decoders.items():
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        report[f"alone:{name}"] = statistics.median(times)
        print(f"alone {name}: {statistics.median(times):.1f} ms/batch", flush=True)

    model = torchvision.models.resnet50(num_classes=100).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x0 = torch.randn(BATCH, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y0 = torch.randint(0, 100, (BATCH,), device=dev)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x0), y0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    side = torch.cuda.Stream(dev)
    train_stream = [torch.cuda.current_stream(dev)]

    def steps(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(train_stream[0]):
            for _ in range(n):
                step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / n

    steps(15)
    report["step_alone_ms"] = steps(40)
    print(f"step alone {report['step_alone_ms']:.1f} ms", flush=True)
    cases = [(name, fn, "default") for name, fn in decoders.items()] + [
        ("ours-normal", decoders["ours-normal"], "default2")
    ]
    for name, fn, where in cases:
        train_stream[0] = side if where == "side" else torch.cuda.current_stream(dev)
        if name == "ours-pipelined":
            torch.cuda.synchronize()
        running, times, calls = True, [], []

        def drain():
            while running:
                t = time.perf_counter()
                c = fn()
                times.append((time.perf_counter() - t) * 1e3)
                if c is not None:
                    calls.append(c * 1e3)

        threads = [threading.Thread(target=drain, daemon=True)]
        if where == "default2":  # a second thread, its own state (thread-local) and stream
            other = torch.cuda.Stream(dev)
            fn2 = run_ours(other)

            def drain2():
                while running:
                    t = time.perf_counter()
                    fn2()
                    times.append((time.perf_counter() - t) * 1e3)

            threads.append(threading.Thread(target=drain2, daemon=True))
        for th in threads:
            th.start()
        time.sleep(1.0)
        n0 = len(times)
        t_start = time.perf_counter()
        step_ms = steps(40)
        n1 = len(times)
        elapsed = time.perf_counter() - t_start
        running = False
        for th in threads:
            th.join(30)
        got = times[n0:]
        r = {
            "step_ms": step_ms,
            "batches_per_s": (n1 - n0) / elapsed,
            "decode_ms_median": statistics.median(got) if got else None,
            "batches": len(got),
            "host_call_ms_median": statistics.median(calls) if calls else None,
        }
        report[f"beside:{name}:train-on-{where}"] = r
        print(
            f"beside {name}, training on the {where} stream: "
            + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}),
            flush=True,
        )
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
