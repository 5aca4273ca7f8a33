"""nvJPEG's side of a batch: ``torchvision.io.decode_jpeg(device='cuda')`` over host bitstreams.

nvJPEG's API takes the encoded bytes where they lie (the loader's pinned slot) and DMAs them
itself. A batch it refuses is retried one image at a time; what it refuses alone is decoded on
the CPU and routed ``cpu:nvjpeg-error``.
"""

from __future__ import annotations

import torch

from .cpu import RGB, torchvision_ops, try_decode_cpu
from .settings import STEAL_CHUNK_MIN, STEAL_CHUNKS_PER_BATCH

__all__ = ["decode_gpu", "front_chunks"]


def decode_gpu(encoded: list, positions: list, routes: list, device: torch.device, max_pixels: int) -> list:
    """nvJPEG for the whole list; where it refuses the batch, one by one, the refused on the
    CPU (``routes[positions[k]]`` becomes 'cpu:nvjpeg-error'; a ``Refusal`` where that fails too)."""
    ops = torchvision_ops()
    try:
        return ops.decode_jpegs_cuda(encoded, RGB, device)
    except RuntimeError:
        pass
    out = []
    for k, tensor in enumerate(encoded):
        try:
            out.append(ops.decode_jpegs_cuda([tensor], RGB, device)[0])
        except RuntimeError:
            routes[positions[k]] = "cpu:nvjpeg-error"
            result = try_decode_cpu(tensor, max_pixels=max_pixels)
            out.append(result.to(device) if isinstance(result, torch.Tensor) else result)
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
