"""Decoding on the CPU: one image (``decode_cpu``), or a batch's JPEGs on the C++ decoder.

Only decoders that refuse damaged input with an error run on the CPU: the C++ decoder
(libjpeg-turbo) for JPEGs, PIL for the rest and for what the C++ decoder refuses. torchvision's
CPU ``decode_image`` is never used: it crashed the process on more than half of 300 PNGs with a
few flipped bits (issue 18; tests/fuzz_images.py). No image is decoded whose header declares
more than ``max_pixels`` pixels.

The C++ batch decoder (csrc/jpeg_decode.cpp, libjpeg-turbo where ``setup.py`` found
``jpeglib.h``) writes planar RGB straight into a pinned buffer, on the engine's low-priority
threads with the GIL released. ``NativeJpegs`` holds its arguments for some of a batch's images.
"""

from __future__ import annotations

import io as _io
from dataclasses import dataclass, fields

import numpy as np
import torch

from .. import config
from ..errors import FastloadError
from ..priority import lower_thread_priority
from .probe import BAD_HEADER, BMP, EMPTY, GIF, JPEG, OK, PNG, STATUS_TEXT, TRUNCATED, WEBP, probe
from .settings import DECODE_NICE

__all__ = [
    "ImageDecodeError",
    "Refusal",
    "TooManyPixels",
    "decode_cpu",
    "try_decode_cpu",
    "refusal_of",
    "too_many_pixels",
    "PACKED",
    "NativeJpegs",
    "native_jpeg",
]

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
    """torchvision's decode ops (torch.ops: no per-call deprecation warning, GIL released). Only
    nvJPEG's (``decode_jpegs_cuda``) are used: torchvision's CPU decode crashes on damaged PNGs."""
    import torchvision  # noqa: F401  (registers torch.ops.image)

    return torch.ops.image


@dataclass
class Refusal:
    """Why an image is not decoded: ``kind`` counts it (``skipped:<kind>``), ``reason`` says it."""

    kind: str  # 'empty', 'truncated', 'bad-header', 'max-pixels' or 'undecodable'
    reason: str


class TooManyPixels(ValueError):
    """An image whose header declares more than ``max_pixels`` pixels."""


_STATUS_KINDS = {EMPTY: "empty", TRUNCATED: "truncated", BAD_HEADER: "bad-header"}


def too_many_pixels(height: int, width: int, max_pixels: int) -> str | None:
    """The reason an image of this declared size is refused, or None where it is within the limit."""
    if height * width <= max_pixels:
        return None
    return (
        f"declares {width}x{height} pixels ({height * width:,}), more than max_pixels={max_pixels:,} "
        "(a decompression bomb? TORCH_FASTLOAD_MAX_PIXELS raises the limit)"
    )


def refusal_of(row, max_pixels: int) -> Refusal | None:
    """Why the probe alone refuses an image (its probe row: status, declared size), or None."""
    status = int(row[5])
    if status != OK:
        return Refusal(_STATUS_KINDS[status], STATUS_TEXT[status])
    reason = too_many_pixels(int(row[1]), int(row[2]), max_pixels)
    return Refusal("max-pixels", reason) if reason else None


def decode_cpu(encoded: torch.Tensor, *, max_pixels: int | None = None) -> torch.Tensor:
    """``(3, H, W)`` uint8 on the CPU, through decoders that refuse damaged input with an error:
    JPEGs on the C++ decoder (libjpeg-turbo, bit-exact with torchvision's CPU decode) where it
    is built; everything else, and what the C++ decoder refuses, on PIL. The header is probed
    first: an empty, truncated or unreadable file, or one declaring more than ``max_pixels``
    pixels (default: the ``max_pixels`` option), raises ``ValueError`` (``TooManyPixels``)
    before anything is allocated."""
    limit = config.resolve("max_pixels", max_pixels)
    fmt, height, width, comps, _, status = probe(encoded.numpy(), np.array([0, encoded.numel()]))[0].tolist()
    refusal = refusal_of((fmt, height, width, comps, 0, status), limit)
    if refusal is not None:
        raise (TooManyPixels if refusal.kind == "max-pixels" else ValueError)(refusal.reason)
    first = ""
    if fmt == JPEG and height and width and comps in (1, 3) and native_jpeg():
        image = torch.empty((3, height, width), dtype=torch.uint8)
        first = _decode_native_one(encoded, image)
        if not first:
            return image
    return _decode_pil(encoded, fmt, limit, first)


def _decode_native_one(encoded: torch.Tensor, image: torch.Tensor) -> str:
    """The C++ decoder on one JPEG into ``image`` (its probed size); '' or why it refused."""
    from .. import _C

    size = encoded.numel()
    _, height, width = image.shape
    [message] = _C.decode_jpegs_planar(
        encoded.data_ptr(), size, [0], [size], image.data_ptr(), image.numel(), [0], [height], [width], 1
    )
    return message


def _decode_pil(encoded: torch.Tensor, fmt: int, max_pixels: int, first: str) -> torch.Tensor:
    """PIL, told the probed format (no other plugin sees the bytes); the size its header
    declares is checked against ``max_pixels`` before the pixels are decoded."""
    from PIL import Image

    try:
        with Image.open(_io.BytesIO(encoded.numpy().tobytes()), formats=[_PIL_FORMATS[fmt]]) as pil:
            reason = too_many_pixels(pil.height, pil.width, max_pixels)
            if reason:
                raise TooManyPixels(reason)
            array = _rgb(pil)
    except TooManyPixels:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own limit (2 x PIL.Image.MAX_IMAGE_PIXELS)
        raise TooManyPixels(f"PIL: {exc}") from None
    except Exception as exc:  # PIL refuses damage with many types (OSError, SyntaxError, EOFError, ...)
        before = f"{first}; " if first else ""
        raise ValueError(f"undecodable ({before}PIL: {type(exc).__name__}: {exc})") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


_PIL_FORMATS = {JPEG: "JPEG", PNG: "PNG", GIF: "GIF", WEBP: "WEBP", BMP: "BMP"}


def _rgb(pil) -> np.ndarray:
    """``(H, W, 3)`` uint8. 16-bit grayscale keeps its high byte (PIL's convert would clip it at 255)."""
    if pil.mode in ("I;16", "I;16B", "I;16L", "I"):
        gray = (np.asarray(pil).astype(np.uint32) >> 8).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=2)
    return np.asarray(pil.convert("RGB"))


PACKED = object()  # try_decode_cpu's result when the image went into the place it was given


def try_decode_cpu(encoded: torch.Tensor, place: torch.Tensor | None = None, *, max_pixels: int):
    """The decoded image (or ``PACKED`` once copied into ``place``, where its shape is
    ``place``'s), or a ``Refusal`` for the caller to raise or skip."""
    try:
        image = decode_cpu(encoded, max_pixels=max_pixels)
    except TooManyPixels as exc:
        return Refusal("max-pixels", str(exc))
    except (ValueError, RuntimeError) as exc:
        return Refusal("undecodable", str(exc))
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
    lower_thread_priority(DECODE_NICE)
