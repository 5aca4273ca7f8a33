"""The GPU's side of a batch: one batched decode of host bitstreams on the GPU.

The decode library is ``gpu_backend``'s choice (nvImageCodec or torchvision's nvJPEG); both
take the encoded bytes where they lie (the loader's pinned slot) and DMA them themselves. What
the GPU refuses is decoded on the CPU and routed ``cpu:nvjpeg-error``.
"""

from __future__ import annotations

import torch

from .cpu import try_decode_cpu
from .settings import STEAL_CHUNK_MIN, STEAL_CHUNKS_PER_BATCH

__all__ = ["decode_gpu", "refused_on_cpu", "front_chunks"]


def decode_gpu(
    encoded: list,
    positions: list,
    routes: list,
    device: torch.device,
    max_pixels: int,
    backend,
    refused: str = "cpu:nvjpeg-error",
) -> list:
    """``backend`` (``gpu_backend``, or ``jpeg_engines``) for the whole list, in order; what it
    refuses on the CPU (``routes[positions[k]]`` becomes ``refused``; a ``Refusal`` where the CPU
    fails too): every image comes back, none dropped."""
    return refused_on_cpu(backend.decode(encoded), encoded, positions, routes, device, max_pixels, refused)


def refused_on_cpu(
    out: list, encoded: list, positions: list, routes: list, device: torch.device, max_pixels: int, refused: str
) -> list:
    """A GPU decoder's ``out`` with each None (refused) decoded on the CPU in its place, and its
    route ``refused``."""
    for k, image in enumerate(out):
        if image is None:
            routes[positions[k]] = refused
            result = try_decode_cpu(encoded[k], max_pixels=max_pixels)
            out[k] = result.to(device) if isinstance(result, torch.Tensor) else result
    return out


def front_chunks(job, steal: list):
    """nvJPEG's side of a work-stealing split: chunks claimed from the front until the CPU
    threads' end is reached (a chunk a call: each call waits on the GPU twice)."""
    size = max(STEAL_CHUNK_MIN, len(steal) // STEAL_CHUNKS_PER_BATCH)
    while True:
        first, last = job.claim_front(size)
        if first == last:
            return
        yield steal[first:last]
