"""Why nvJPEG called directly (decode_backend='nvjpeg') is ~4x faster alone than torchvision's op
but ~2.7x slower inside the loader (issue 20): its raw rate on pinned and on pageable bitstreams,
then the loader with variants of the decoder, one change each.

    python3 benchmarks/gpu/nvjpeg_variants_probe.py OUT.json [--variants as-is,host-waits,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import torch

import torch_fastload
from torch_fastload.vision import gpu_backend as backends
from torch_fastload.vision.nvjpeg_direct import DirectNvjpeg
from torch_fastload.vision.sample_data import make_image_folder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import split_probe as sp  # noqa: E402

# Run once, on a tree whose decoder kept a state per thread (before its lanes); its subclasses
# here kept the default (then high) priority.


class HostWaits(DirectNvjpeg):
    """The host waits for its own batch before returning (torchvision's op does)."""

    def decode(self, encoded):
        out = super().decode(encoded)
        self.synchronize()
        return out


class OneAtATime(HostWaits):
    """One batch at a time in the process (torchvision's mutex)."""

    _lock = threading.Lock()

    def decode(self, encoded):
        with self._lock:
            return super().decode(encoded)


class PinnedBitstreams(DirectNvjpeg):
    """The bitstreams copied into a pinned buffer of the thread's first (pageable input only)."""

    _pinned = threading.local()

    def decode(self, encoded):
        if encoded and not encoded[0].is_pinned():
            local = self._pinned
            total = sum(t.numel() for t in encoded)
            if getattr(local, "pinned", None) is not None:  # its last batch read the buffer
                self.synchronize()
            buf = getattr(local, "pinned", None)
            if buf is None or buf.numel() < total:
                local.pinned = buf = torch.empty(2 * total, dtype=torch.uint8).pin_memory()
            views, at = [], 0
            for t in encoded:
                buf[at : at + t.numel()].copy_(t)
                views.append(buf[at : at + t.numel()])
                at += t.numel()
            encoded = views
        return super().decode(encoded)


VARIANTS = {
    "as-is": lambda d: DirectNvjpeg(d, priority="high"),  # the default when this ran
    "normal-priority": lambda d: DirectNvjpeg(d, priority="normal"),
    "host-waits": lambda d: HostWaits(d),
    "one-at-a-time": lambda d: OneAtATime(d),
    "pinned-bitstreams": lambda d: PinnedBitstreams(d),
}


def raw(jpegs, device, seconds: float) -> dict:
    """The direct decoder and torchvision's op outside the loader: pinned and pageable bitstreams,
    one thread and three."""
    pageable = jpegs.slab.clone()  # not pinned
    pageable_views = [pageable[jpegs.offsets[i] : jpegs.offsets[i + 1]] for i in range(jpegs.n)]
    rows = {}
    for name, backend in (
        ("direct", DirectNvjpeg(device, priority="high")),
        ("torchvision", backends.TorchvisionNvjpeg(device)),
    ):
        for memory, views in (("pinned", jpegs.views), ("pageable", pageable_views)):

            def work(k, size, backend=backend, views=views):
                out = backend.decode([views[i] for i in jpegs.batch(k, size)])
                assert all(o is not None for o in out)

            sp.run_for(0.5, work, sp.BATCH)
            rows[f"{name} {memory} 1 thread"] = sp.run_for(seconds, work, sp.BATCH)["images_per_s"]
            rows[f"{name} {memory} 3 threads"] = sum(
                r["images_per_s"] for r in sp.together(seconds, [(work, sp.BATCH)] * 3)
            )
            sp.log(
                f"raw {name} {memory}: 1 thread {rows[f'{name} {memory} 1 thread']:,.0f} img/s, "
                f"3 threads {rows[f'{name} {memory} 3 threads']:,.0f}"
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--dir", default="/tmp/split-probe")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    train, _ = make_image_folder(args.dir, 100, 40, 1, edge_cases=False, progress=False)
    jpegs = sp.Jpegs(train)
    result = {"device": torch.cuda.get_device_name(), "raw": raw(jpegs, device, args.seconds), "loader": {}}
    pinned_inputs = []
    from torch_fastload.vision import decode as dec

    route = dec.BatchDecoder._route

    def spying_route(self, data, offsets, crop):
        pinned_inputs.append(data.is_pinned())
        return route(self, data, offsets, crop)

    dec.BatchDecoder._route = spying_route
    for name in ["torchvision", *args.variants.split(",")]:
        backends._chosen.clear()
        if name != "torchvision":
            backends._chosen[("nvjpeg", device)] = VARIANTS[name](device)
        with torch_fastload.config.override(
            image_batches_staged=3, decode_backend="torchvision" if name == "torchvision" else "nvjpeg"
        ):
            r = sp.loader_rate(train, 0.0)
        result["loader"][name] = r
        sp.log(f"== {name}: batches' encoded bytes pinned: {set(pinned_inputs)}")
        pinned_inputs.clear()
        sp.print_loader_row(r)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
