"""Issue 17/18: exactly-once, uncorrupted delivery by the C++ loop beside a launch-bound step,
for as long as asked. The thirteenth session's main job (`python -m torch_fastload.bench`, H100,
TORCH_FASTLOAD_DMA_ORDER=stream, the 12th of 12 fastload runs that day) hit a device-side assert
in nll_loss: a label out of range, i.e. a batch with bytes that no sample holds. This reproduces
the job's shape (float32 3x128x128 images + int64 labels, batch 128, shuffled, a small conv
step) with data that checks itself: image i is filled with i, label i is i. Every batch's labels
must be distinct indices of the dataset, equal to its images' values, and every epoch must
deliver every index once. The first bad batch is printed (epoch, batch, what differs) and the
script exits 1.

  python3 benchmarks/gpu/native_stress.py [SECONDS] [ROUTE ...]     (routes: memory_rows values,
  default: auto dma kernel gather; run again under TORCH_FASTLOAD_DMA_ORDER=stream to compare)
"""

import os
import sys
import time

import torch

import torch_fastload

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


def check(epoch: int, number: int, x: torch.Tensor, y: torch.Tensor, seen: torch.Tensor) -> str | None:
    if y.min() < 0 or y.max() >= samples:
        return f"labels out of range: min {int(y.min())} max {int(y.max())}"
    if not torch.equal(x[:, 0, 0, 0].long(), y) or not torch.equal(x[:, 2, size - 1, size - 1].long(), y):
        bad = (x[:, 0, 0, 0].long() != y).nonzero().view(-1)[:4].tolist()
        return f"images differ from their labels at rows {bad}"
    if seen[y].any():
        return f"indices delivered twice in the epoch: {y[seen[y]][:4].tolist()}"
    seen[y] = True
    return None


def run(route: str, seconds: float) -> int:
    """Loaders made and closed one after another (the main job makes one a round: each
    registers the dataset's pages and unregisters them at close), two epochs each."""
    deadline, loaders, epochs, batches = time.monotonic() + seconds, 0, 0, 0
    path = ""
    while time.monotonic() < deadline:
        with torch_fastload.config.override(memory_rows=route):
            loader = torch_fastload.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, device=device)
        loaders += 1
        for _ in range(2):
            seen = torch.zeros(samples, dtype=torch.bool, device=device)
            for number, (x, y) in enumerate(loader):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(x.to(memory_format=torch.channels_last)), y % 10)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                problem = check(epochs, number, x, y, seen)
                if problem is not None:
                    print(f"{route}: loader {loaders} epoch {epochs} batch {number}: {problem} ({loader.stats().path})")
                    return 1
                batches += 1
            if int(seen.sum()) != samples // batch * batch:
                print(f"{route}: loader {loaders} epoch {epochs} delivered {int(seen.sum())} distinct samples")
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
