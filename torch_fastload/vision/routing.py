"""Where each image of a batch is decoded: the routes the probe gives, and the batch's plan.

``route`` sends every probed image to a GPU decoder ('nvjpeg': nvJPEG on CUDA cores, or the
hardware JPEG engines on an engine route), to the CPU ('cpu:<reason>') or to an error;
``share_out`` moves a CPU share of the GPU's images to the CPU. ``BatchRoute`` is the plan
``decode.BatchDecoder`` follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import config
from .cpu import refusal_of
from .probe import ADOBE, ARITHMETIC, FORMATS, HIGH_PRECISION, JPEG, LOSSLESS, PROGRESSIVE

__all__ = ["route", "share_out", "engines_out", "Decoded", "EncodedSlices", "BatchRoute", "NATIVE_ROUTES"]

# 8-bit 1- or 3-component JPEGs the CPU takes from a GPU decoder: libjpeg decodes them as torchvision does
NATIVE_ROUTES = ("cpu:share", "cpu:huge", "cpu:progressive")


def route(
    info: np.ndarray, device: torch.device, gpu_max_pixels: int, max_pixels: int | None = None, engines: bool = False
) -> list[str]:
    """Where each probed image is decoded: 'nvjpeg' (a GPU decoder), 'cpu:<reason>' or
    'error:<reason>' (``max_pixels``: default the option's). ``engines``: the GPU decoder is the
    hardware JPEG engines, which take no progressive JPEG ('cpu:progressive')."""
    limit = config.resolve("max_pixels", max_pixels)
    routes = []
    cuda = device.type == "cuda"
    for row in info.tolist():
        fmt, height, width, comps, flags, _ = row
        refusal = refusal_of(row, limit)
        if refusal is not None:
            routes.append("error:" + refusal.reason)
        elif fmt != JPEG:
            routes.append("cpu:" + FORMATS[fmt])
        elif not cuda:
            routes.append("cpu:device-cpu")
        elif comps == 4 or (flags & ADOBE and comps != 3 and comps != 1):
            routes.append("cpu:cmyk")
        elif flags & (ARITHMETIC | LOSSLESS | HIGH_PRECISION) or comps not in (1, 3):
            routes.append("cpu:jpeg-unsupported")
        elif height * width > gpu_max_pixels or height == 0 or width == 0:
            routes.append("cpu:huge" if height * width > gpu_max_pixels else "cpu:jpeg-unsupported")
        elif engines and flags & PROGRESSIVE:
            routes.append("cpu:progressive")
        else:
            routes.append("nvjpeg")
    return routes


@dataclass
class Decoded:
    """A decoded batch (``BatchDecoder.decode``)."""

    images: list  # (3, H, W) uint8 on the decoder's device, one per kept position
    kept: np.ndarray  # int64: the batch positions kept (all unless on_error="skip" dropped some)
    info: np.ndarray  # the probe rows of the whole batch
    geometry: object  # transforms.Geometry of the kept images; None without ``crop``


class EncodedSlices:
    """Image ``i``'s encoded bytes, ``data[offsets[i]:offsets[i + 1]]``, made when asked: the C++
    decoder reads the slab by offset, so on the CPU route most images never need a tensor of
    their own (256 slices were ~0.5 ms of a stage thread's Python a batch)."""

    def __init__(self, data: torch.Tensor, offsets: np.ndarray):
        self.data = data
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]


@dataclass
class BatchRoute:
    """Where each image of a batch goes (``BatchDecoder._route``)."""

    info: np.ndarray  # probe rows
    routes: list  # per image: 'nvjpeg' or 'engines' (the GPU decoder), 'cpu:<reason>', 'error:<reason>'
    slices: EncodedSlices  # per image: its encoded bytes (a view of the batch's data)
    geometry: object  # the transform's geometry drawn from the probed sizes, or None
    failed: dict  # position -> Refusal: what the probe already refused
    gpu: list  # positions the GPU decoder (nvJPEG, or the engines) decodes alone
    steal: list  # positions split between the GPU decoder and the C++ decoder by work stealing
    cpu: list  # positions routed to the CPU
    native: list  # those of ``cpu`` the C++ batch decoder takes (the rest: Python threads)
    boxes: np.ndarray  # int64 (N, 4): the part of each image decoded (top, left, height, width)
    engines: bool = False  # ``gpu`` and ``steal`` go to the hardware JPEG engines, not nvJPEG
    # a three-way split: positions the JPEG engines decode while nvJPEG decodes ``gpu``
    engine_part: list = field(default_factory=list)

    @property
    def laid_out(self) -> list:
        """The CPU's images in the pinned buffer's order. Work-stealing candidates come last to
        first: the CPU takes them from the back, so what it decoded is one run of bytes after
        the other CPU images."""
        return self.cpu + self.steal[::-1]


def share_out(routes: list, cpu_share: float, work_stealing: bool) -> tuple[list, list]:
    """``(gpu, steal)``: the images the GPU decodes alone, and those it splits with the CPU by
    work stealing. A fixed share's images (the batch's last ones: the same every time it is
    decoded) are routed 'cpu:share' in ``routes``."""
    gpu = [i for i, r in enumerate(routes) if r == "nvjpeg"]
    if work_stealing and len(gpu) > 1:
        return [], gpu
    shared = int(round(cpu_share * len(gpu))) if len(gpu) > 1 or cpu_share == 1 else 0
    for i in gpu[len(gpu) - shared :] if shared else ():
        routes[i] = "cpu:share"
    return gpu[: len(gpu) - shared], []


def engines_out(routes: list, info: np.ndarray, gpu: list, count: int) -> tuple[list, list]:
    """``(nvjpeg, engines)``: a three-way split's GPU images ``gpu`` (what ``share_out`` left
    after the CPU's share) between nvJPEG and the JPEG engines, the first ``count`` baseline
    JPEGs to the engines (routed 'engines'); progressive ones stay nvJPEG's (the engines take
    baseline JPEGs only)."""
    engines = [i for i in gpu if not int(info[i, 4]) & PROGRESSIVE][: max(0, count)]
    for i in engines:
        routes[i] = "engines"
    taken = set(engines)
    return [i for i in gpu if i not in taken], engines
