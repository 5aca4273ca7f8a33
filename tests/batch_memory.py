"""Shared by the batch-memory ordering tests (test_native_cuda.py, test_cuda.py): rows numbered
so that each batch can be checked against the rows it must hold, on a plain training loop; and
tensors on pages of their own, which the loaders pin in place."""

import mmap

import torch

PAGE = 4096


def on_own_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in a mapping of its own, whole pages: nothing else can lie on its
    last page, so loaders pin it where it lies (``resources.tail_page_private``). A small tensor
    from the heap may share that page with other allocations and is gathered by the CPU."""
    nbytes = tensor.numel() * tensor.element_size()
    mapping = mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))
    out = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


def numbered_rows(n: int, width: int) -> torch.Tensor:
    """``n`` int64 rows of ``width``, all values distinct; the test runs on the legacy default
    stream (handle 0), as a plain training loop does."""
    assert torch.cuda.current_stream().cuda_stream == 0
    return on_own_pages(torch.arange(n * width, dtype=torch.int64).reshape(n, width))


def batches_intact(batches: list, rows: torch.Tensor, batch: int) -> bool:
    """Whether the k-th of ``batches`` holds rows ``[k * batch, (k + 1) * batch)``, once the
    device's queued work (a batch's copy, a kernel reading it) has run."""
    torch.cuda.synchronize()
    return all(torch.equal(g.cpu(), rows[i * batch : (i + 1) * batch]) for i, g in enumerate(batches))
