"""How fast do 2 GPUs all-reduce ResNet-50's gradients here? (Why the model alone scales 1.71x.)

    NCCL_DEBUG=INFO torchrun --standalone --nproc-per-node 2 benchmarks/probes/probe_nccl_allreduce.py

All-reduces a 100 MB float32 buffer (ResNet-50's 25.6M gradients) and 25 MB buckets (DDP's
default bucket size) 20 times each and prints the bus bandwidth (NCCL's busbw = 2(n-1)/n x
bytes / time); NCCL_DEBUG=INFO shows the transport (P2P/NVLink, SHM through the host, ...).
"""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
for mbytes in (25, 100):
    buf = torch.ones(mbytes * 2**20 // 4, device="cuda")
    for _ in range(3):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / 20
    if rank == 0:
        busbw = 2 * (world - 1) / world * buf.numel() * 4 / seconds / 1e9
        print(
            f"all_reduce {mbytes} MB x {world} GPUs: {1e3 * seconds:.2f} ms, bus bandwidth {busbw:.1f} GB/s", flush=True
        )
dist.destroy_process_group()
