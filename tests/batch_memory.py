"""Shared by the batch-memory ordering tests (test_native_cuda.py, test_cuda.py): rows numbered
so that each batch can be checked against the rows it must hold, on a plain training loop."""

import torch


def numbered_rows(n: int, width: int) -> torch.Tensor:
    """``n`` int64 rows of ``width``, all values distinct; the test runs on the legacy default
    stream (handle 0), as a plain training loop does."""
    assert torch.cuda.current_stream().cuda_stream == 0
    return torch.arange(n * width, dtype=torch.int64).reshape(n, width)


def batches_intact(batches: list, rows: torch.Tensor, batch: int) -> bool:
    """Whether the k-th of ``batches`` holds rows ``[k * batch, (k + 1) * batch)``, once the
    device's queued work (a batch's copy, a kernel reading it) has run."""
    torch.cuda.synchronize()
    return all(torch.equal(g.cpu(), rows[i * batch : (i + 1) * batch]) for i, g in enumerate(batches))
