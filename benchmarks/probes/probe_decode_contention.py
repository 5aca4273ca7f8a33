"""Where does the image loader lose time beside a training step? Model alone, loader alone,
the model fed by the loader, with the decoder's host time per batch (probe / nvJPEG / CPU).

    python benchmarks/probes/probe_decode_contention.py resnet50

Kept because it decided the design: see benchmarks/RESULTS.md (image pipeline)."""

import os
import sys
import time

import torch
import torchvision

sys.path.insert(0, os.getcwd())
from torch_fastload import DataLoader
from torch_fastload.sources import ImageFolder
from torch_fastload.vision import TrainTransform
from torch_fastload.vision.sample_data import make_image_folder

train, _ = make_image_folder("/tmp/probe-imgs", classes=100, train_per_class=60, val_per_class=1, progress=False)
dev = torch.device("cuda", 0)
arch = sys.argv[1] if len(sys.argv) > 1 else "resnet50"
model = getattr(torchvision.models, arch)(num_classes=100).to(dev).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x0 = torch.randn(256, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
y0 = torch.randint(0, 100, (256,), device=dev)


def step(x, y):
    with torch.autocast("cuda", torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


for _ in range(15):
    step(x0, y0)
torch.cuda.synchronize()


def model_alone(n=40):
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(n):
        step(x0, y0)
    torch.cuda.synchronize()
    return (time.time() - t) / n


def make_loader(**kw):
    ds = ImageFolder(train, TrainTransform(dtype=torch.bfloat16, channels_last=True), seed=0)
    return DataLoader(ds, batch_size=256, shuffle=True, drop_last=True, device=dev, **kw), ds


def loader_alone(loader):
    for _ in loader:
        pass
    torch.cuda.synchronize()
    t = time.time()
    n = 0
    for x, y in loader:
        n += 1
    torch.cuda.synchronize()
    return (time.time() - t) / n


def fed(loader, ds, n=40):
    it = iter(loader)
    for _ in range(5):
        step(*next(it))
    torch.cuda.synchronize()
    loader.stats(reset=True)
    dec = ds.decoder(dev)
    s0 = dict(dec.seconds)
    t = time.time()
    k = 0
    while k < n:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        step(x, y)
        k += 1
    torch.cuda.synchronize()
    dt = (time.time() - t) / n
    st = loader.stats()
    per = {k2: 1e3 * (dec.seconds[k2] - s0[k2]) / st.batches for k2 in s0}
    return dt, st, per


print(arch, "model alone step ms", 1e3 * model_alone(), flush=True)
loader, ds = make_loader()
print("loader alone ms/batch", 1e3 * loader_alone(loader), flush=True)
dt, st, per = fed(loader, ds)
print(f"fed step ms {1e3 * dt:.1f}  wait {100 * st.wait_fraction:.0f}%  decoder host ms per batch: {per}", flush=True)
# Interference or starvation? The model on its own device batch while a thread runs the
# loader flat out beside it (batches discarded): the step slows only by what decode and
# augmentation take from the GPU; the fed step above adds any waiting for input.
running = True


def drain():
    while running:
        for _ in loader:
            if not running:
                break


thread = __import__("threading").Thread(target=drain, daemon=True)
thread.start()
time.sleep(2.0)
print(f"model step beside a free-running loader ms {1e3 * model_alone():.1f}", flush=True)
running = False
thread.join(30)
