"""Zero-copy gathers: a GPU kernel reads byte ranges straight out of registered host memory.

Host memory registered with CUDA (``cudaHostRegister``; here a file's page-cache mapping,
``engine.MappedFiles``) is addressable from the GPU at the same address (unified
addressing). One kernel launch copies every range of a batch into device memory, reading
host memory over PCIe in aligned 16-byte words: on the H100 machine ~50 GB/s for a batch of
192 KiB rows, against ~21 GB/s for one DMA copy per row and 0 CPU cores either way.

This module owns the kernel's source and its compilation; the engine launches it, with no GIL
(the native loop: one launch a batch, its range table in the batch's pinned slot;
``DeviceStager.gather_mapped`` for the Python pipeline: tables in its pinned ring). It is compiled at
first use with NVRTC through ``torch.cuda._compile_kernel``
(torch >= 2.8); where that is missing, ``available()`` is False and callers use DMA copies.
"""

from __future__ import annotations

import threading

import torch

from . import config

__all__ = ["available", "host_view", "kernel_handle", "PIECE", "blocks"]

#: bytes of one range one thread block copies at a time; longer ranges span several pieces
PIECE = 64 << 10


def blocks() -> int:
    """Thread blocks (of 256 threads) per launch: the ``gather_blocks`` option
    (``TORCH_FASTLOAD_GATHER_BLOCKS``), validated when a loader reads it, never at import."""
    return config.get("gather_blocks")


_SOURCE = r"""
#define UNROLL 4
extern "C" __global__ void gather_ranges(const unsigned char* src, unsigned char* dst,
                                         const long long* offsets, const long long* lengths,
                                         const long long* dst_offsets, int piece, int ranges,
                                         int pieces_per_range) {
  // Grid-stride over (range, piece) pairs: a few blocks keep enough 16-byte PCIe reads in
  // flight to fill the link while leaving most SMs to the training step running beside it.
  const long long items = (long long)ranges * pieces_per_range;
  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const int r = (int)(item / pieces_per_range);
    const long long length = lengths[r];
    const long long start = (item % pieces_per_range) * (long long)piece;
    if (start >= length) continue;
    const long long end = min(length, start + (long long)piece);
    const unsigned char* s = src + offsets[r];
    unsigned char* d = dst + dst_offsets[r];
    // The 16-byte-aligned words of the source that cover [start, end): whole loads, never
    // outside the registered pages (page aligned and whole).
    const unsigned long long first = ((unsigned long long)(s + start)) & ~15ULL;
    const unsigned long long last = ((unsigned long long)(s + end) + 15ULL) & ~15ULL;
    const long long words = (long long)((last - first) / 16);
    const bool aligned = ((((unsigned long long)s) ^ ((unsigned long long)d)) & 15ULL) == 0;
    // UNROLL independent loads per thread before any store: more reads in flight per SM.
    for (long long w0 = threadIdx.x; w0 < words; w0 += UNROLL * (long long)blockDim.x) {
      uint4 word[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const long long w = w0 + u * (long long)blockDim.x;
        if (w < words) word[u] = *(const uint4*)(first + 16ULL * (unsigned long long)w);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const long long w = w0 + u * (long long)blockDim.x;
        if (w >= words) break;
        const long long at = (long long)(first + 16ULL * (unsigned long long)w - (unsigned long long)s);
        if (aligned && at >= start && at + 16 <= end) {
          *(uint4*)(d + at) = word[u];
        } else {
          const unsigned char* bytes = (const unsigned char*)&word[u];
          for (int k = 0; k < 16; ++k) {
            const long long i = at + k;
            if (i >= start && i < end) d[i] = bytes[k];
          }
        }
      }
    }
  }
}
"""

_kernels: dict = {}
_lock = threading.Lock()


def available() -> bool:
    """Whether this torch can compile the kernel (NVRTC through torch.cuda._compile_kernel)."""
    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel")


def _kernel(device: torch.device):
    with _lock:
        kernel = _kernels.get(device.index)
        if kernel is None:
            with torch.cuda.device(device):
                kernel = _kernels[device.index] = torch.cuda._compile_kernel(_SOURCE, "gather_ranges")
        return kernel


class _HostMemory:
    """``__cuda_array_interface__`` of registered host memory, so torch wraps it without a copy."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def host_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over ``nbytes`` of registered host memory at ``address`` (no copy).
    The memory must stay registered while the tensor or any kernel reading it lives."""
    with torch.cuda.device(device):
        return torch.as_tensor(_HostMemory(address, nbytes), device=device)


def kernel_handle(device: torch.device) -> int:
    """The compiled kernel's CUfunction, for the engine to launch without the GIL
    (``engine.DeviceStager.gather_mapped``); the module stays loaded for the process."""
    return int(_kernel(device).func.value)
