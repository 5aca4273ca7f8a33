"""Batched image transforms: the geometry of every sample drawn at once, the pixels in one kernel.

A transform here is split in two:

- ``geometry(heights, widths, rng)``: per-sample crop boxes, resize sizes, output windows and
  flips for a whole batch, vectorised in numpy (torchvision's parameter semantics);
- ``apply(images, geometry, device)``: the pixels. On a GPU one NVRTC kernel does crop, resize
  (antialiased bilinear, the filter of torchvision's ``resize(antialias=True)`` and PIL),
  flip, normalisation, the dtype cast and the memory layout for every image of the batch in one
  launch, reading each decoded image where it lies (images of different sizes, no padding).
  Elsewhere (no CUDA, or no NVRTC) the same arithmetic runs per sample with torchvision's
  functional ops in float, which is also the reference the kernel is tested against.

A per-sample Python loop of ``resized_crop`` on the GPU tops out near 5,700 images/s on the
H100 machine, below nvJPEG's decode rate: hence one launch per batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

import numpy as np
import torch

__all__ = ["TrainTransform", "EvalTransform", "Geometry", "IMAGENET_MEAN", "IMAGENET_STD", "kernel_available"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class Geometry:
    """Per-sample geometry of a batch (arrays of length N).

    Sample ``n`` crops ``[top, top + height) x [left, left + width)`` of its image, resizes the
    crop to ``resize_h x resize_w``, takes the ``size x size`` window at ``(window_y,
    window_x)`` of that, and mirrors it horizontally where ``flip``.
    """

    top: np.ndarray
    left: np.ndarray
    height: np.ndarray
    width: np.ndarray
    resize_h: np.ndarray
    resize_w: np.ndarray
    window_y: np.ndarray
    window_x: np.ndarray
    flip: np.ndarray
    size: int

    def table(self) -> np.ndarray:
        """int64 (N, 10) rows for the kernel: top, left, h, w, resize_h, resize_w, wy, wx, flip, 0."""
        cols = [
            self.top,
            self.left,
            self.height,
            self.width,
            self.resize_h,
            self.resize_w,
            self.window_y,
            self.window_x,
            self.flip.astype(np.int64),
            np.zeros_like(self.top),
        ]
        return np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1)

    def take(self, keep: np.ndarray) -> Geometry:
        return Geometry(*(getattr(self, f)[keep] for f in _PER_SAMPLE), self.size)

    def put(self, rows: np.ndarray, other: Geometry) -> None:
        """Rows ``rows`` (a mask or indices) replaced by ``other``'s samples, in order."""
        for f in _PER_SAMPLE:
            getattr(self, f)[rows] = getattr(other, f)


_PER_SAMPLE = tuple(f.name for f in fields(Geometry) if f.name != "size")  # the arrays of length N


@dataclass
class _Normalize:
    size: int = 224
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: torch.dtype = torch.float32
    channels_last: bool = False

    def __post_init__(self):
        if self.dtype not in _KERNELS:
            raise ValueError(f"dtype must be one of {list(_KERNELS)}, got {self.dtype}")
        if len(self.mean) != 3 or len(self.std) != 3 or any(s <= 0 for s in self.std):
            raise ValueError(f"mean and std need 3 values each, std > 0 (got mean={self.mean}, std={self.std})")
        if int(self.size) <= 0:
            raise ValueError(f"size must be positive, got {self.size}")

    def apply(self, images: list[torch.Tensor], geometry: Geometry, device: torch.device) -> torch.Tensor:
        """``(N, 3, size, size)`` of ``dtype`` on ``device`` (channels_last memory if asked)."""
        return apply(images, geometry, device, self.mean, self.std, self.dtype, self.channels_last)


@dataclass
class TrainTransform(_Normalize):
    """RandomResizedCrop(size, scale, ratio) + RandomHorizontalFlip(flip_p) + Normalize."""

    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3.0 / 4.0, 4.0 / 3.0)
    flip_p: float = 0.5

    def geometry(self, heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator) -> Geometry:
        """torchvision's ``RandomResizedCrop.get_params`` for every sample: 10 tries of a random
        area and log-uniform aspect ratio, then the whole image clamped to ``ratio``."""
        h = np.asarray(heights, dtype=np.int64)
        w = np.asarray(widths, dtype=np.int64)
        n, tries = len(h), 10
        area = (h * w).astype(np.float64)[:, None]
        target = area * rng.uniform(self.scale[0], self.scale[1], size=(n, tries))
        log_ratio = np.log(self.ratio)
        aspect = np.exp(rng.uniform(log_ratio[0], log_ratio[1], size=(n, tries)))
        cw = np.rint(np.sqrt(target * aspect)).astype(np.int64)
        ch = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        fits = (cw > 0) & (cw <= w[:, None]) & (ch > 0) & (ch <= h[:, None])
        first = np.argmax(fits, axis=1)
        found = fits[np.arange(n), first]
        crop_h = np.where(found, ch[np.arange(n), first], 0)
        crop_w = np.where(found, cw[np.arange(n), first], 0)
        # fallback: a central crop of the whole image with its aspect ratio clamped to ``ratio``
        in_ratio = w / np.maximum(h, 1)
        fb_w = np.where(
            in_ratio < self.ratio[0],
            w,
            np.where(in_ratio > self.ratio[1], np.rint(h * self.ratio[1]).astype(np.int64), w),
        )
        fb_h = np.where(in_ratio < self.ratio[0], np.rint(w / self.ratio[0]).astype(np.int64), h)
        crop_h = np.where(found, crop_h, np.minimum(fb_h, h))
        crop_w = np.where(found, crop_w, np.minimum(fb_w, w))
        top = np.where(found, (rng.random(n) * (h - crop_h + 1)).astype(np.int64), (h - crop_h) // 2)
        left = np.where(found, (rng.random(n) * (w - crop_w + 1)).astype(np.int64), (w - crop_w) // 2)
        flip = rng.random(n) < self.flip_p
        s = np.full(n, int(self.size), dtype=np.int64)
        zero = np.zeros(n, dtype=np.int64)
        return Geometry(top, left, crop_h, crop_w, s, s, zero, zero, flip, int(self.size))


@dataclass
class EvalTransform(_Normalize):
    """Resize(resize) of the shorter side + CenterCrop(size) + Normalize (torchvision semantics)."""

    resize: int = 256

    def geometry(self, heights: np.ndarray, widths: np.ndarray, rng=None) -> Geometry:
        h = np.asarray(heights, dtype=np.int64)
        w = np.asarray(widths, dtype=np.int64)
        short = np.minimum(h, w)
        long_ = np.maximum(h, w)
        new_long = (self.resize * long_ / np.maximum(short, 1)).astype(np.int64)  # torchvision: int()
        rh = np.where(h <= w, self.resize, new_long)
        rw = np.where(h <= w, new_long, self.resize)
        size = int(self.size)
        # torchvision center_crop: int(round((resized - size) / 2.0)); pads when smaller (not here)
        if (rh < size).any() or (rw < size).any():
            raise ValueError(f"EvalTransform(resize={self.resize}) is smaller than its crop size {size}")
        wy = np.rint((rh - size) / 2.0).astype(np.int64)
        wx = np.rint((rw - size) / 2.0).astype(np.int64)
        n = len(h)
        zero = np.zeros(n, dtype=np.int64)
        return Geometry(zero, zero.copy(), h, w, rh, rw, wy, wx, np.zeros(n, dtype=bool), size)


# ------------------------------------------------------------------------------------------
# the pixels
# ------------------------------------------------------------------------------------------

_SOURCE = r"""
// One thread per output pixel of one sample: crop, antialiased bilinear resize (aten's
// _upsample_bilinear2d_aa filter: triangle of support max(scale, 1)), flip, normalise, cast.
typedef long long i64;

__device__ __forceinline__ float tri(float x) {
  x = fabsf(x);
  return x < 1.f ? 1.f - x : 0.f;
}

// taps of output index `i` along one axis: [lo, lo + count) of the crop, weights via tri()
__device__ __forceinline__ void taps(int i, int in_size, int out_size, int* lo, int* count, float* center,
                                     float* invscale) {
  const float scale = (float)in_size / (float)out_size;
  const float support = scale >= 1.f ? scale : 1.f;
  *center = scale * (i + 0.5f);
  *invscale = scale >= 1.f ? 1.f / scale : 1.f;
  int xmin = (int)(*center - support + 0.5f);
  if (xmin < 0) xmin = 0;
  int xmax = (int)(*center + support + 0.5f);
  if (xmax > in_size) xmax = in_size;
  *lo = xmin;
  *count = xmax - xmin;
}

template <typename T>
__device__ __forceinline__ void store(T* p, float v);
template <>
__device__ __forceinline__ void store<float>(float* p, float v) { *p = v; }
template <>
__device__ __forceinline__ void store<unsigned short>(unsigned short* p, float v) {  // bfloat16, RNE
  unsigned int bits = __float_as_uint(v);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *p = (unsigned short)(bits >> 16);
}
__device__ __forceinline__ unsigned short to_half_bits(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

template <typename T, bool HALF>
__device__ void resize_normalize(const i64* images, const i64* table, T* out, int n, int size, int channels_last,
                                 float m0, float m1, float m2, float s0, float s1, float s2) {
  const int sample = blockIdx.y;
  const int pixel = blockIdx.x * blockDim.x + threadIdx.x;
  if (sample >= n || pixel >= size * size) return;
  const int oy = pixel / size, ox = pixel % size;
  const i64* g = table + 10 * (i64)sample;
  const int top = (int)g[0], left = (int)g[1], ch = (int)g[2], cw = (int)g[3];
  const int rh = (int)g[4], rw = (int)g[5], wy = (int)g[6], wx = (int)g[7], flip = (int)g[8];
  const unsigned char* src = (const unsigned char*)images[3 * sample];
  const i64 height = images[3 * sample + 1], width = images[3 * sample + 2];
  const i64 plane = height * width;

  const int ry = oy + wy;
  const int rx = (flip ? size - 1 - ox : ox) + wx;
  int ylo, ycount, xlo, xcount;
  float ycenter, yinv, xcenter, xinv;
  taps(ry, ch, rh, &ylo, &ycount, &ycenter, &yinv);
  taps(rx, cw, rw, &xlo, &xcount, &xcenter, &xinv);
  float ysum = 0.f, xsum = 0.f;
  for (int j = 0; j < ycount; ++j) ysum += tri((j + ylo - ycenter + 0.5f) * yinv);
  for (int j = 0; j < xcount; ++j) xsum += tri((j + xlo - xcenter + 0.5f) * xinv);
  const float ynorm = ysum != 0.f ? 1.f / ysum : 0.f, xnorm = xsum != 0.f ? 1.f / xsum : 0.f;
  float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f;
  for (int j = 0; j < ycount; ++j) {
    const float wyj = tri((j + ylo - ycenter + 0.5f) * yinv) * ynorm;
    if (wyj == 0.f) continue;
    const unsigned char* row = src + (i64)(top + ylo + j) * width + left + xlo;
    float r0 = 0.f, r1 = 0.f, r2 = 0.f;
    for (int k = 0; k < xcount; ++k) {
      const float wxk = tri((k + xlo - xcenter + 0.5f) * xinv) * xnorm;
      r0 += wxk * (float)row[k];
      r1 += wxk * (float)row[plane + k];
      r2 += wxk * (float)row[2 * plane + k];
    }
    acc0 += wyj * r0;
    acc1 += wyj * r1;
    acc2 += wyj * r2;
  }
  const float v0 = (acc0 * (1.f / 255.f) - m0) / s0;
  const float v1 = (acc1 * (1.f / 255.f) - m1) / s1;
  const float v2 = (acc2 * (1.f / 255.f) - m2) / s2;
  const i64 hw = (i64)size * size;
  i64 base, step;
  if (channels_last) { base = ((i64)sample * hw + pixel) * 3; step = 1; }
  else { base = (i64)sample * 3 * hw + pixel; step = hw; }
  if (HALF) {
    unsigned short* o = (unsigned short*)out;
    o[base] = to_half_bits(v0); o[base + step] = to_half_bits(v1); o[base + 2 * step] = to_half_bits(v2);
  } else {
    store<T>(out + base, v0); store<T>(out + base + step, v1); store<T>(out + base + 2 * step, v2);
  }
}

#define ENTRY(name, T, HALF)                                                                              \
  extern "C" __global__ void name(const i64* images, const i64* table, T* out, int n, int size,        \
                                  int channels_last, float m0, float m1, float m2, float s0, float s1, \
                                  float s2) {                                                           \
    resize_normalize<T, HALF>(images, table, out, n, size, channels_last, m0, m1, m2, s0, s1, s2);      \
  }
ENTRY(resize_normalize_f32, float, false)
ENTRY(resize_normalize_bf16, unsigned short, false)
ENTRY(resize_normalize_f16, unsigned short, true)
"""

_KERNELS = {
    torch.float32: "resize_normalize_f32",
    torch.bfloat16: "resize_normalize_bf16",
    torch.float16: "resize_normalize_f16",
}
_compiled: dict = {}
_lock = threading.Lock()
_THREADS = 256


def kernel_available() -> bool:
    """Whether the fused kernel can run here (CUDA and NVRTC through torch.cuda._compile_kernel)."""
    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel")


def _kernel(device: torch.device, dtype: torch.dtype):
    key = (device.index, dtype)
    with _lock:
        kernel = _compiled.get(key)
        if kernel is None:
            with torch.cuda.device(device):
                kernel = _compiled[key] = torch.cuda._compile_kernel(_SOURCE, _KERNELS[dtype])
        return kernel


def _float_bits(values) -> list:
    """Kernel float arguments: _compile_kernel passes Python floats as doubles, so pass the
    float32 bit patterns reinterpreted as ints (a C int and a C float are both 4 bytes)."""
    return [int(np.array(v, dtype=np.float32).view(np.int32)) for v in values]


def apply(
    images: list[torch.Tensor],
    geometry: Geometry,
    device: torch.device,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """Crop/resize/flip/normalise every ``(3, H, W)`` uint8 image into one ``(N, 3, S, S)`` batch."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = geometry.size
    n = len(images)
    if device.type == "cuda" and kernel_available():
        return _apply_kernel(images, geometry, device, mean, std, dtype, channels_last)
    out = torch.empty(
        (n, 3, size, size),
        dtype=dtype,
        device=device,
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
    )
    if n:
        _check_geometry(geometry.table(), np.array([(0, im.shape[-2], im.shape[-1]) for im in images]), size)
    for i, image in enumerate(images):
        out[i] = reference(image.to(device), geometry, i, mean, std)
    return out


def _apply_kernel(images, geometry, device, mean, std, dtype, channels_last) -> torch.Tensor:
    n, size = len(images), geometry.size
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, 3, size, size), dtype=dtype, device=device, memory_format=memory_format)
    if n == 0:
        return out
    pointers = np.empty((n, 3), dtype=np.int64)
    for i, image in enumerate(images):
        if (
            image.dtype != torch.uint8
            or image.dim() != 3
            or image.shape[0] != 3
            or image.device != device
            or not image.is_contiguous()
        ):
            raise ValueError(
                f"image {i}: the kernel takes contiguous (3, H, W) uint8 tensors on {device}, got "
                f"{tuple(image.shape)} {image.dtype} on {image.device}"
            )
        pointers[i] = (image.data_ptr(), image.shape[1], image.shape[2])
    table = geometry.table()
    _check_geometry(table, pointers, size)
    host = torch.from_numpy(np.concatenate([pointers.reshape(-1), table.reshape(-1)])).pin_memory()
    tables = host.to(device, non_blocking=True)  # on the current stream, before the kernel
    kernel = _kernel(device, dtype)
    blocks = (size * size + _THREADS - 1) // _THREADS
    bits = _float_bits(list(mean) + list(std))
    kernel(
        grid=(blocks, n, 1),
        block=(_THREADS, 1, 1),
        args=[tables, tables[3 * n :], out, n, size, int(channels_last), *bits],
        stream=torch.cuda.current_stream(device),
    )
    return out  # ``host`` may go: the caching host allocator keeps it until its copy has run


def _check_geometry(table: np.ndarray, pointers: np.ndarray, size: int) -> None:
    """Every crop inside its image and every window inside its resized crop (the kernel trusts it)."""
    top, left, h, w, rh, rw, wy, wx = (table[:, k] for k in range(8))
    height, width = pointers[:, 1], pointers[:, 2]
    bad = (
        (top < 0)
        | (left < 0)
        | (h <= 0)
        | (w <= 0)
        | (top + h > height)
        | (left + w > width)
        | (wy < 0)
        | (wx < 0)
        | (wy + size > rh)
        | (wx + size > rw)
    )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"sample {i}: crop (top, left, h, w)={table[i, :4].tolist()} of its "
            f"{height[i]}x{width[i]} image, resized to {rh[i]}x{rw[i]}, window at "
            f"({wy[i]}, {wx[i]}) of size {size}: outside the image or the resized crop"
        )


def reference(image: torch.Tensor, geometry: Geometry, i: int, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """Sample ``i`` through torchvision's functional ops in float32 (the kernel's specification)."""
    from torchvision.transforms.v2 import functional as F

    top, left, h, w, rh, rw, wy, wx = (
        int(getattr(geometry, f)[i])
        for f in ("top", "left", "height", "width", "resize_h", "resize_w", "window_y", "window_x")
    )
    size = geometry.size
    crop = image[:, top : top + h, left : left + w].float()
    resized = F.resize(crop, [rh, rw], interpolation=F.InterpolationMode.BILINEAR, antialias=True)
    window = resized[:, wy : wy + size, wx : wx + size]
    if bool(geometry.flip[i]):
        window = window.flip(-1)
    m = torch.tensor(mean, dtype=torch.float32, device=window.device).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=window.device).view(3, 1, 1)
    return (window / 255.0 - m) / s
