"""Issue 17/18: exactly-once, uncorrupted delivery by the C++ loop beside a launch-bound step,
for as long as asked. The thirteenth session's main job (`python -m torch_fastload.bench`, H100,
TORCH_FASTLOAD_DMA_ORDER=stream, the 12th of 12 fastload runs that day) hit a device-side assert
in nll_loss: a label out of range, i.e. a batch with bytes that no sample holds. This reproduces
the job's shape (float32 3x128x128 images + int64 labels, batch 128, shuffled, a small conv
step) with data that checks itself: image i is filled with i, label i is i. Every batch's labels
must be distinct indices of the dataset, equal to its images' values, and every epoch must
deliver every index once. The checks queue on the device without a sync, so the host runs
ahead as in a training loop; the first bad batch is printed (epoch, batch, what differs) and
the script exits 1. The cause (fourteenth session): the loop's copies skipped their wait for the
training stream when that stream was the legacy default (handle 0), so a batch could land in
memory the step's queued kernels were still to write. STRESS_UNSAFE=1 brings that back (the
negative control: the script must then fail); it runs with output_stream='consumer', the
allocation that wait protects (the default allocates on the copy stream, where the hand-over's
record_stream is the guard, and its own control lives in tests/test_native_cuda.py).

  python3 benchmarks/gpu/native_stress.py [SECONDS] [ROUTE ...]     (routes: memory_rows values,
  default: auto dma kernel gather; run again under TORCH_FASTLOAD_DMA_ORDER=stream to compare;
  STRESS_JITTER_US=N: each batch's staging first sleeps 0..N us, so workers finish out of order)
"""

import os
import sys
import time

import torch

if os.environ.get("STRESS_UNSAFE") == "1":
    os.environ["TORCH_FASTLOAD_OUTPUT_STREAM"] = "consumer"

import torch_fastload  # noqa: E402
from torch_fastload import native  # noqa: E402

native.UNSAFE_SKIP_ALLOCATION_WAIT = os.environ.get("STRESS_UNSAFE") == "1"
# workers finishing their staging out of order (the copies' order must hold them to it)
native.DEBUG_JITTER_US = int(os.environ.get("STRESS_JITTER_US", "0"))

device = torch.device(os.environ.get("STRESS_DEVICE", "cuda"))  # cpu: a smoke run of the checks
samples, size, batch = 8192, 128, 128
images = torch.arange(samples, dtype=torch.float32).view(-1, 1, 1, 1).expand(samples, 3, size, size).contiguous()
labels = torch.arange(samples, dtype=torch.int64)
dataset = torch.utils.data.TensorDataset(images, labels)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(),
    torch.nn.Linear(16, 10),
).to(device, memory_format=torch.channels_last)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)


def check(number: int, x: torch.Tensor, y: torch.Tensor, bad: torch.Tensor, counts: torch.Tensor) -> None:
    """Queued on the device, no sync: the host runs ahead of the GPU as a training loop does,
    which is when a copy racing the step's use of recycled memory shows."""
    wrong = (y < 0) | (y >= samples) | (x[:, 0, 0, 0].long() != y) | (x[:, 2, size - 1, size - 1].long() != y)
    bad[number] = wrong.sum()
    counts.index_add_(0, y.clamp(0, samples - 1), torch.ones_like(y))


def verdict(bad: torch.Tensor, counts: torch.Tensor, delivered: int) -> str | None:
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        return f"batch {first}: {int(bad[first])} rows whose image or label is not the sample's own"
    if int((counts > 1).sum()) or int(counts.sum()) != delivered:
        return f"{int((counts > 1).sum())} indices delivered twice, {int((counts == 0).sum())} never"
    return None


def run(route: str, seconds: float) -> int:
    """Loaders made and closed one after another (the main job makes one a round: each
    registers the dataset's pages and unregisters them at close), two epochs each."""
    deadline, loaders, epochs, batches = time.monotonic() + seconds, 0, 0, 0
    path = ""
    steps = samples // batch
    while time.monotonic() < deadline:
        with torch_fastload.config.override(memory_rows=route):
            loader = torch_fastload.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, device=device)
        loaders += 1
        for _ in range(2):
            bad = torch.zeros(steps, dtype=torch.int64, device=device)
            counts = torch.zeros(samples, dtype=torch.int64, device=device)
            for number, (x, y) in enumerate(loader):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(x.to(memory_format=torch.channels_last)), y % 10)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                check(number, x, y, bad, counts)
                batches += 1
            problem = verdict(bad, counts, steps * batch)
            if problem is not None:
                print(f"{route}: loader {loaders} epoch {epochs}: {problem} ({loader.stats().path})", flush=True)
                return 1
            epochs += 1
        path = loader.stats().path
        loader.close()
    print(f"{route}: {loaders} loaders, {epochs} epochs, {batches} batches checked, none bad ({path})", flush=True)
    return 0


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60
    routes = sys.argv[2:] or ["auto", "dma", "kernel", "gather"]
    sys.exit(max(run(route, seconds / len(routes)) for route in routes))
