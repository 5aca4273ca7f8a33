"""Issue 21/17: where a Parquet batch's one-call stage (``_C.stage_host_batch``) spends its time
on the GPU machine. The timeline put ~0.9 ms a batch in that call, against ~0.1-0.2 ms for its
host copies alone on the dev machine. For each batch of the 1M-row uncompressed alert file,
decoded into the registered arena as the loader does, timed call by call (no pipeline):
  host      the copies into the slot and the offsets' rebase only (no device copy)
  direct    the loader's call: host part, then the slot's runs and the arena's fields in one
            cuMemcpyBatchAsync (TORCH_FASTLOAD_DMA_BATCH=0: one cuMemcpyHtoDAsync a range)
  slot      every field copied into the slot first, then one cuMemcpyHtoDAsync of the slot
  *-busy    the same with ~2 ms of work queued on the copy stream before the call (a call that
            returns only once its copy ran takes that long)
Each row: the call's wall time (median over batches and repeats) and the device copy's own time
between its events. Run with TORCH_FASTLOAD_DMA_BATCH=0, with TORCH_FASTLOAD_DMA_ORDER=any and with neither.

  python3 benchmarks/gpu/stage_call_probe.py DATA_DIR [REPEATS]
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import parquet_data  # noqa: E402

from torch_fastload import stager, transfer  # noqa: E402
from torch_fastload.sources import ParquetDataset, parquet_arena  # noqa: E402
from torch_fastload.staging import ParallelCopier  # noqa: E402

BUSY_CYCLES = 4_000_000  # ~2 ms at the H100's ~1.98 GHz


def main() -> None:
    root = Path(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    device = torch.device("cuda", 0)
    path = parquet_data.write_alert(root, 1000000, "none", 131072)
    dataset = ParquetDataset(path, cache_bytes=2 << 30)
    decode = parquet_arena.decoder(device, 4 << 30)
    assert decode is not None, parquet_arena.unavailable_reason()
    dataset._reader().arena_decode = decode
    rows, n = 67394, len(dataset)
    batches = [dataset.__fastload_batch__(range(s, min(n, s + rows))) for s in range(0, n, rows)]
    copier = ParallelCopier(4)
    slot = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device)
    handle = stream.cuda_stream
    out = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    routes = ("host", "direct", "slot", "direct-busy", "slot-busy")
    timings: dict = {route: [] for route in routes}
    copies: dict = {route: [] for route in routes if route != "host"}
    for _ in range(repeats):
        for batch in batches:
            plan = stager.plan_batch(batch, collated=True)
            for route in routes:
                host_plan = copier.plan_copy(slot, plan.copy_list(), None, direct=not route.startswith("slot"))
                (cd, cs, csz), rebase, direct = host_plan.native
                start, end = transfer._CopyEvent(handle), transfer._CopyEvent(handle)
                torch.cuda.synchronize()
                if route.endswith("busy"):  # ~2 ms of work queued on the copy stream first
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(BUSY_CYCLES)
                began = time.perf_counter()
                transfer._stage_host_batch(
                    cd,
                    cs,
                    csz,
                    *rebase,
                    host_plan.threads,
                    host_plan.task_bytes,
                    True,
                    slot.data_ptr(),
                    0 if route == "host" else out.data_ptr(),
                    plan.total_bytes,
                    handle,
                    start,
                    end,
                    *(direct or ()),
                )
                timings[route].append(time.perf_counter() - began)
                torch.cuda.synchronize()
                if route != "host":
                    copies[route].append(start.elapsed_ms(end))
    batch_mode = (
        "per-range cuMemcpyHtoDAsync" if os.environ.get("TORCH_FASTLOAD_DMA_BATCH") == "0" else "cuMemcpyBatchAsync"
    )
    print(
        f"stage_host_batch on {torch.cuda.get_device_name(device)}, {len(batches)} batches x {repeats}, {batch_mode}:"
    )
    for route, seconds in timings.items():
        p90 = sorted(seconds)[int(0.9 * len(seconds))]
        line = f"  {route:6s} call {1e3 * statistics.median(seconds):.3f} ms (p90 {1e3 * p90:.3f})"
        if copies.get(route):
            line += f", device copy {statistics.median(copies[route]):.3f} ms"
        print(line, flush=True)
    dataset.close()


if __name__ == "__main__":
    main()
