"""Does nvJPEG's call slow beside a training step because its work waits for the GPU?

beside_probe.py found torchvision's ``decode_jpegs_cuda`` at 26.5 ms a batch of 256 alone and
52.9 ms beside a ResNet-18 step (H100). This times, alone and beside the step (eager, and
replayed from a CUDA graph: one launch a step, the SMs kept busy), one or three threads
decoding the same baseline JPEGs with torchvision's op and with nvJPEG called directly
(``vision.nvjpeg_direct``: the hardware engines or nvJPEG's CUDA decoder, on a high- or
normal-priority stream), after checking that the direct decode gives torchvision's pixels.
Run ``nvidia-smi dmon -s u`` beside it to see the engines' use (its ``jpg`` column).

    python3 benchmarks/gpu/nvjpeg_stream_probe.py OUT.json [--seconds 6] [--threads 1,3] [--only a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from beside_probe import Step, sync, synthetic_ms  # noqa: E402
from split_probe import BATCH, Jpegs, log, run_for, together  # noqa: E402

from torch_fastload.vision.gpu_backend import gpu_backend  # noqa: E402
from torch_fastload.vision.nvjpeg_direct import DirectNvjpeg  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402

REFUSED: dict = {}  # backend name -> images it refused (None), counted not asserted


def decoder_work(jpegs: Jpegs, backend, offset: int, name: str):
    def work(k: int, size: int) -> None:
        which = jpegs.batch(k + offset, size)
        out = backend.decode([jpegs.views[i] for i in which])
        REFUSED[name] = REFUSED.get(name, 0) + sum(o is None for o in out)

    return work


def same_pixels(jpegs: Jpegs, direct: DirectNvjpeg, reference) -> dict:
    encoded = [jpegs.views[i] for i in range(64)]
    a = direct.decode(encoded)
    b = reference.decode(encoded)
    torch.cuda.synchronize()
    shapes = all(x.shape == y.shape for x, y in zip(a, b))
    diff = max(int((x.int() - y.int()).abs().max()) for x, y in zip(a, b)) if shapes else None
    return {"shapes_equal": shapes, "max_abs_diff": diff}


def beside(step: Step, x, y, seconds: float, parts: list) -> dict:
    """The step on a resident batch in this thread while ``parts`` decode on threads."""
    results: list = [None] * len(parts)

    def go(i, work):
        results[i] = run_for(seconds, work, BATCH)

    threads = [threading.Thread(target=go, args=(i, w)) for i, w in enumerate(parts)]
    for t in threads:
        t.start()
    steps, t0 = 0, time.perf_counter()
    while any(t.is_alive() for t in threads):
        step(x, y)
        steps += 1
        if steps % 4 == 0:
            sync(step.device)
    sync(step.device)
    wall = time.perf_counter() - t0
    for t in threads:
        t.join()
    return {
        "step_ms": 1e3 * wall / steps,
        "decoders": results,
        "images_per_s": sum(r["images_per_s"] for r in results),
    }


class GraphedStep:
    """``step`` on one resident batch captured in a CUDA graph: a replay is one launch, so the
    training thread makes almost no driver calls beside the decoders (the eager step makes
    hundreds a step)."""

    def __init__(self, step: Step, x, y):
        self.device = step.device
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._run(step, x, y)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        step.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self._run(step, x, y, zero=False)

    @staticmethod
    def _run(step: Step, x, y, zero: bool = True) -> None:
        if zero:
            step.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = step.criterion(step.model(x), y)
        loss.backward()
        step.optimizer.step()

    def __call__(self, x, y) -> None:
        self.graph.replay()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dir", default="/tmp/beside-probe")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--threads", default="1,3", help="decode threads of the eager rows")
    p.add_argument("--only", default="", help="comma-separated backends to time (default: all)")
    p.add_argument("--graphed", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    device = torch.device("cuda")
    train, _ = make_image_folder(args.dir, 100, 100, 1, edge_cases=False, progress=False)
    jpegs = Jpegs(train)
    log(f"{jpegs.n} baseline JPEGs in a pinned slab")
    backends = {
        "torchvision": gpu_backend(device, "torchvision"),
        "direct-high": DirectNvjpeg(device, priority="high"),
        "direct-normal": DirectNvjpeg(device, priority="normal"),
        "hybrid-high": DirectNvjpeg(device, priority="high", engines=False),
        "hybrid-normal": DirectNvjpeg(device, priority="normal", engines=False),
    }
    result: dict = {"device": torch.cuda.get_device_name(), "library": backends["direct-high"].library}
    result["hardware_backend"] = backends["direct-high"].hardware
    result["same_pixels"] = same_pixels(jpegs, backends["direct-high"], backends["torchvision"])
    log(f"direct vs torchvision pixels: {result['same_pixels']}, hardware {result['hardware_backend']}")
    result["same_pixels_hybrid"] = same_pixels(jpegs, backends["hybrid-high"], backends["torchvision"])
    log(f"nvJPEG's CUDA decoder vs torchvision (engines) pixels: {result['same_pixels_hybrid']}")
    if args.only:
        backends = {k: v for k, v in backends.items() if k in args.only.split(",")}
    for name, backend in backends.items():  # warm every decoder (allocations, engines)
        for k in range(3):
            decoder_work(jpegs, backend, 0, name)(k, BATCH)
    sync(device)
    step = Step(args.arch, 100, device)
    x = torch.randn(BATCH, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (BATCH,), device=device)
    result["synthetic_ms"] = synthetic_ms(step, BATCH, 224, 100, 40)
    log(f"{args.arch} alone: {result['synthetic_ms']:.1f} ms a step")
    rows = {}
    graphed = GraphedStep(step, x, y)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(40):
        graphed(x, y)
    sync(device)
    result["graphed_ms"] = 1e3 * (time.perf_counter() - t0) / 40
    log(f"{args.arch} in a CUDA graph alone: {result['graphed_ms']:.1f} ms a step")
    plan = [("eager", int(t), n) for t in args.threads.split(",") for n in backends]
    plan += [("graphed", 1, n) for n in backends] if args.graphed else []
    for mode, threads, name in plan:
        backend = backends[name]
        parts = [decoder_work(jpegs, backend, 11 * i, name) for i in range(threads)]
        alone = together(args.seconds, [(w, BATCH) for w in parts])
        near = beside(graphed if mode == "graphed" else step, x, y, args.seconds, parts)
        row = {
            "alone_images_per_s": sum(r["images_per_s"] for r in alone),
            "alone_ms_a_batch": alone[0]["ms_a_batch"],
            "alone_cpu_ms_a_batch": alone[0]["thread_cpu_ms_a_batch"],
            "beside_images_per_s": near["images_per_s"],
            "beside_ms_a_batch": near["decoders"][0]["ms_a_batch"],
            "beside_cpu_ms_a_batch": near["decoders"][0]["thread_cpu_ms_a_batch"],
            "step_ms_beside": near["step_ms"],
        }
        rows[f"{mode} {name} x{threads}"] = row
        log(
            f"{mode:7s} {name:14s} x{threads}: alone {row['alone_images_per_s']:7,.0f} img/s "
            f"({row['alone_ms_a_batch']:5.1f} ms, cpu {row['alone_cpu_ms_a_batch']:5.1f}) | beside "
            f"{row['beside_images_per_s']:7,.0f} img/s ({row['beside_ms_a_batch']:5.1f} ms, cpu "
            f"{row['beside_cpu_ms_a_batch']:5.1f}), step {row['step_ms_beside']:5.1f} ms"
        )
    result["rows"] = rows
    result["refused"] = REFUSED
    log(f"images refused: {REFUSED}")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
