"""Zero-copy gathers: a GPU kernel reads byte ranges straight out of registered host memory.

Host memory registered with CUDA (``cudaHostRegister``; here a file's page-cache mapping,
``engine.MappedFiles``) is addressable from the GPU at the same address (unified
addressing). One kernel launch copies every range of a batch into device memory, reading
host memory over PCIe in aligned 16-byte words: on the H100 machine ~50 GB/s for a batch of
192 KiB rows, against ~21 GB/s for one DMA copy per row and 0 CPU cores either way.

The kernel reads its table of ranges from pinned host memory too (``RangeTables``): no
per-batch upload. It is compiled at first use with NVRTC through ``torch.cuda._compile_kernel``
(torch >= 2.8); where that is missing, ``available()`` is False and callers use DMA copies.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

__all__ = ["available", "host_view", "gather_ranges", "RangeTables", "PIECE"]

#: bytes of one range copied by one thread block; longer ranges span several blocks
PIECE = 64 << 10
_MAX_BLOCKS_Y = 65535

_SOURCE = r"""
extern "C" __global__ void gather_ranges(const unsigned char* src, unsigned char* dst,
                                         const long long* offsets, const long long* lengths,
                                         const long long* dst_offsets, int piece) {
  const int r = blockIdx.y;
  const long long length = lengths[r];
  const long long start = (long long)blockIdx.x * piece;
  if (start >= length) return;
  const long long end = min(length, start + (long long)piece);
  const unsigned char* s = src + offsets[r];
  unsigned char* d = dst + dst_offsets[r];
  // Read the 16-byte-aligned words of the source that cover [start, end): whole PCIe-friendly
  // loads, never outside the registered pages (they are page aligned and whole).
  const unsigned long long first = ((unsigned long long)(s + start)) & ~15ULL;
  const unsigned long long last = ((unsigned long long)(s + end) + 15ULL) & ~15ULL;
  const long long words = (long long)((last - first) / 16);
  const bool aligned = ((((unsigned long long)s) ^ ((unsigned long long)d)) & 15ULL) == 0;
  for (long long w = threadIdx.x; w < words; w += blockDim.x) {
    const unsigned long long address = first + 16ULL * (unsigned long long)w;
    const uint4 word = *(const uint4*)address;
    const long long at = (long long)(address - (unsigned long long)s);
    if (aligned && at >= start && at + 16 <= end) {
      *(uint4*)(d + at) = word;
    } else {
      const unsigned char* bytes = (const unsigned char*)&word;
      for (int k = 0; k < 16; ++k) {
        const long long i = at + k;
        if (i >= start && i < end) d[i] = bytes[k];
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
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def host_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over ``nbytes`` of registered host memory at ``address`` (no copy).
    The memory must stay registered while the tensor or any kernel reading it lives."""
    with torch.cuda.device(device):
        return torch.as_tensor(_HostMemory(address, nbytes), device=device)


class RangeTables:
    """Pinned host slots for the kernel's (offset, length, dst offset) table, read by the
    kernel in place (zero-copy) so no per-batch upload or pinned allocation is needed. A slot
    is held by one launch at a time and rewritten only after the event recorded after its
    kernel has completed."""

    def __init__(self, slots: int = 8):
        self._slots = [{"table": None, "event": None, "held": False} for _ in range(slots)]
        self._next = 0
        self._cond = threading.Condition()

    def table(self, rows: int) -> tuple[torch.Tensor, dict]:
        """A free pinned (3, >= rows) int64 table and its slot (hand the slot to ``done``)."""
        with self._cond:
            while all(slot["held"] for slot in self._slots):
                self._cond.wait(0.01)
            while self._slots[self._next]["held"]:
                self._next = (self._next + 1) % len(self._slots)
            slot = self._slots[self._next]
            slot["held"] = True
            self._next = (self._next + 1) % len(self._slots)
        event = slot["event"]
        while event is not None and not event.query():
            time.sleep(2e-5)
        if slot["table"] is None or slot["table"].shape[1] < rows:
            slot["table"] = torch.empty((3, max(rows, 4096)), dtype=torch.int64, pin_memory=True)
        return slot["table"], slot

    def done(self, slot: dict, stream) -> None:
        """The slot's kernel is enqueued on ``stream`` (None: it was not launched)."""
        if stream is not None:
            slot["event"] = torch.cuda.Event()
            slot["event"].record(stream)
        with self._cond:
            slot["held"] = False
            self._cond.notify()


def gather_ranges(src: torch.Tensor, dst: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray,
                  dst_offsets: np.ndarray, tables: RangeTables) -> None:
    """``dst[dst_offsets[i]:+lengths[i]] = src[offsets[i]:+lengths[i]]`` for every i, in one
    launch per 65535 ranges on the current stream. ``src`` is a ``host_view`` (or any uint8
    CUDA tensor); ranges must already be checked against both buffers."""
    n = len(offsets)
    if not n:
        return
    kernel = _kernel(dst.device)
    table, slot = tables.table(n)
    stream = None
    try:
        rows = table.numpy()
        rows[0, :n], rows[1, :n], rows[2, :n] = offsets, lengths, dst_offsets
        blocks_x = int(-(-int(lengths.max()) // PIECE))
        stream = torch.cuda.current_stream(dst.device)
        for first in range(0, n, _MAX_BLOCKS_Y):
            count = min(_MAX_BLOCKS_Y, n - first)
            kernel(grid=(blocks_x, count, 1), block=(256, 1, 1),
                   args=[src, dst, table[0, first:], table[1, first:], table[2, first:], PIECE])
    finally:
        tables.done(slot, stream)
