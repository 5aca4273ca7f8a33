"""Decoding on the CPU: one image (``decode_cpu``), or a batch's JPEGs on the C++ decoder.

The C++ batch decoder (csrc/jpeg_decode.cpp, libjpeg-turbo where ``setup.py`` found
``jpeglib.h``) writes planar RGB straight into a pinned buffer, on the engine's low-priority
threads with the GIL released. ``NativeJpegs`` holds its arguments for some of a batch's images.
"""

from __future__ import annotations

import io as _io
import os
import threading
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..errors import FastloadError
from .settings import DECODE_NICE

__all__ = ["ImageDecodeError", "decode_cpu", "try_decode_cpu", "PACKED", "NativeJpegs", "native_jpeg"]

RGB = 3  # torchvision.io.ImageReadMode.RGB


class ImageDecodeError(FastloadError, ValueError):
    """An image that cannot be decoded: names the file, its index in the dataset and why."""

    def __init__(self, name: str, index: int | None, reason: str):
        self.name = name
        self.index = index
        self.reason = reason
        where = f"image {index} " if index is not None else "image "
        super().__init__(f"{where}'{name}': {reason}")


def torchvision_ops():
    """torchvision's decode ops (torch.ops: no per-call deprecation warning, GIL released)."""
    import torchvision  # noqa: F401  (registers torch.ops.image)

    return torch.ops.image


def decode_cpu(encoded: torch.Tensor) -> torch.Tensor:
    """``(3, H, W)`` uint8 on the CPU: torchvision (libjpeg-turbo, libpng, ...), then PIL."""
    try:
        image = torchvision_ops().decode_image(encoded, RGB, False)
    except RuntimeError as first:
        try:
            from PIL import Image

            with Image.open(_io.BytesIO(encoded.numpy().tobytes())) as pil:
                array = np.asarray(pil.convert("RGB"))
        except Exception as exc:
            raise ValueError(f"undecodable ({first}; PIL: {exc})") from None
        image = torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    return image.contiguous()


PACKED = object()  # try_decode_cpu's result when the image went into the place it was given


def try_decode_cpu(encoded: torch.Tensor, place: torch.Tensor | None = None):
    """The decoded image (or ``PACKED`` once copied into ``place``, where its shape is
    ``place``'s), or the reason it failed (a string) for the caller to raise or skip."""
    try:
        image = decode_cpu(encoded)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    if place is not None and image.shape == place.shape:
        place.copy_(image)
        return PACKED
    return image


@dataclass
class NativeJpegs:
    """The C++ decoder's arguments (``_C.decode_jpegs_planar``, ``_C.JpegSplitJob``) for images
    ``which`` of a batch: where their bytes are, their probed sizes, and where each one's
    planar RGB goes in the (pinned) destination buffer."""

    src_ptr: int
    src_size: int
    starts: np.ndarray  # int64: each image's first byte in the source
    lengths: np.ndarray  # int64: its length
    dst_ptr: int
    dst_size: int
    dst_offsets: np.ndarray  # int64: where its (3, height, width) goes in the destination
    heights: np.ndarray  # int64: probed sizes (a decode of another size is refused)
    widths: np.ndarray
    regions: np.ndarray  # int64 (top, left, height, width) per image, flattened: the part decoded

    @classmethod
    def of(
        cls,
        data: torch.Tensor,
        offsets: np.ndarray,
        info: np.ndarray,
        boxes: np.ndarray,
        which: list,
        buffer: torch.Tensor,
        starts: list,
    ) -> NativeJpegs:
        """Images ``which`` of ``data`` (probe rows ``info``, decoded parts ``boxes``) into
        ``buffer`` at ``starts``."""
        pick = np.asarray(which, dtype=np.int64)
        begin = offsets[pick]
        return cls(
            src_ptr=data.data_ptr(),
            src_size=data.numel(),
            starts=begin,
            lengths=offsets[pick + 1] - begin,
            dst_ptr=buffer.data_ptr(),
            dst_size=buffer.numel(),
            dst_offsets=np.asarray(starts, dtype=np.int64),
            heights=info[pick, 1].astype(np.int64),
            widths=info[pick, 2].astype(np.int64),
            regions=np.ascontiguousarray(boxes[pick]).reshape(-1),
        )

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def native_jpeg() -> bool:
    """Whether the extension has the C++ batch JPEG decoder (built against libjpeg)."""
    try:
        from .. import _C
    except ImportError:
        return False
    return bool(getattr(_C, "HAVE_LIBJPEG", False))


def native_regions() -> bool:
    """Whether the C++ decoder skips what lies outside a region (libjpeg-turbo)."""
    try:
        from .. import _C
    except ImportError:
        return False
    return bool(getattr(_C, "JPEG_REGIONS", False))


def lower_priority() -> None:
    """nice +10 for this thread (Linux: per thread): decoding yields its core to the training
    thread, whose kernel launches slow ~2x when decode threads take its core (H100 machine)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DECODE_NICE)
    except (AttributeError, OSError):
        pass
