"""The image loader alone (no training): train images/s per cpu_decode_share.

    python benchmarks/probes/probe_loader_alone.py [DIR] [0,auto,...]

Per share: one untimed epoch, then two timed ones, of
the generated 10k-image folder (page cache hot), batch 256, train transform bf16 channels_last.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
import torch_fastload  # noqa: E402
from torch_fastload import DataLoader  # noqa: E402
from torch_fastload.sources import ImageFolder  # noqa: E402
from torch_fastload.vision import TrainTransform  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/inet-sample"
shares = (sys.argv[2] if len(sys.argv) > 2 else "0,auto").split(",")
train, _ = make_image_folder(root, classes=100, train_per_class=100, val_per_class=10, progress=False)
for share in shares:
    with torch_fastload.config.override(cpu_decode_share=share):
        ds = ImageFolder(train, TrainTransform(dtype=torch.bfloat16, channels_last=True), seed=0)
        loader = DataLoader(ds, batch_size=256, shuffle=True, drop_last=True, device="cuda")
        for _ in loader:
            pass
        torch.cuda.synchronize()
        t, n = time.perf_counter(), 0
        for _ in range(2):
            for images, _ in loader:
                n += len(images)
        torch.cuda.synchronize()
        rate = n / (time.perf_counter() - t)
        cpu = sum(v for k, v in loader.stats().decoded.items() if k.startswith("cpu:"))
        print(
            f"loader alone, share={share}: {rate:,.0f} images/s (decoded {dict(loader.stats().decoded)}, cpu {cpu})",
            flush=True,
        )
        ds.close()
