"""Why does nvJPEG decode take ~125 ms of host time per batch beside a ResNet-50 step (14 ms
alone)? A torch.profiler (CUPTI) trace of fed steps, summarised per thread and per stream.

    python benchmarks/probes/probe_decode_trace.py resnet50 OUTDIR

Prints, for the loader's stage threads: host time by CUDA runtime call (synchronize, malloc,
launch, memcpy) and by op; for each CUDA stream: busy time and, for the copy stream, how long
its kernels waited between launch and start (queueing behind the step's kernels). Writes the
summary JSON and the gzipped chrome trace to OUTDIR.
"""

import collections
import gzip
import json
import os
import shutil
import sys
import time

import torch
import torchvision

sys.path.insert(0, os.getcwd())
from torch_fastload import DataLoader  # noqa: E402
from torch_fastload.sources import ImageFolder  # noqa: E402
from torch_fastload.vision import TrainTransform  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402

arch = sys.argv[1] if len(sys.argv) > 1 else "resnet50"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/decode-trace"
os.makedirs(out, exist_ok=True)
train, _ = make_image_folder("/tmp/probe-imgs", classes=100, train_per_class=60, val_per_class=1, progress=False)
dev = torch.device("cuda", 0)
model = getattr(torchvision.models, arch)(num_classes=100).to(dev).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def step(x, y):
    with torch.autocast("cuda", torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


ds = ImageFolder(train, TrainTransform(dtype=torch.bfloat16, channels_last=True), seed=0)
loader = DataLoader(ds, batch_size=256, shuffle=True, drop_last=True, device=dev)
it = iter(loader)
for _ in range(12):
    step(*next(it))
torch.cuda.synchronize()
started = time.time()
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
    record_shapes=False,
    with_stack=False,
) as prof:
    for _ in range(6):
        step(*next(it))
    torch.cuda.synchronize()
fed_ms = (time.time() - started) / 6 * 1e3
trace = os.path.join(out, f"trace-{arch}.json")
prof.export_chrome_trace(trace)
with open(trace) as f:
    events = json.load(f)["traceEvents"]
with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
    shutil.copyfileobj(f, g)
os.remove(trace)

thread_names = {}
for e in events:
    if e.get("ph") == "M" and e.get("name") == "thread_name":
        thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
by_thread = collections.defaultdict(lambda: collections.Counter())
counts = collections.defaultdict(lambda: collections.Counter())
launch_end = {}  # correlation id -> end of the runtime launch call (us)
kernels = []
for e in events:
    if e.get("ph") != "X":
        continue
    cat = e.get("cat", "")
    if cat in ("cuda_runtime", "cuda_driver"):
        key = (e["pid"], e["tid"])
        by_thread[key]["runtime:" + e["name"]] += e["dur"]
        counts[key]["runtime:" + e["name"]] += 1
        corr = e.get("args", {}).get("correlation")
        if corr is not None:
            launch_end[corr] = e["ts"] + e["dur"]
    elif cat == "cpu_op":
        key = (e["pid"], e["tid"])
        by_thread[key]["op:" + e["name"]] += e["dur"]
        counts[key]["op:" + e["name"]] += 1
    elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        kernels.append(e)
streams = collections.defaultdict(
    lambda: {"busy_us": 0.0, "kernels": 0, "queue_us": [], "names": collections.Counter()}
)
for k in kernels:
    s = streams[k.get("args", {}).get("stream", k.get("tid"))]
    s["busy_us"] += k["dur"]
    s["kernels"] += 1
    s["names"][k["name"][:60]] += k["dur"]
    corr = k.get("args", {}).get("correlation")
    if corr in launch_end:
        s["queue_us"].append(k["ts"] - launch_end[corr])
summary = {"arch": arch, "fed_step_ms": fed_ms, "window_steps": 6, "threads": {}, "streams": {}}
for key, counter in by_thread.items():
    name = thread_names.get(key, str(key[1]))
    top = counter.most_common(14)
    summary["threads"][f"{name} ({key[1]})"] = [(n, round(us / 1e3, 2), counts[key][n]) for n, us in top]
for sid, s in sorted(streams.items(), key=lambda kv: -kv[1]["busy_us"]):
    q = sorted(s["queue_us"])
    summary["streams"][str(sid)] = {
        "busy_ms": round(s["busy_us"] / 1e3, 1),
        "kernels": s["kernels"],
        "queue_ms_p50": round(q[len(q) // 2] / 1e3, 2) if q else None,
        "queue_ms_p90": round(q[int(len(q) * 0.9)] / 1e3, 2) if q else None,
        "queue_ms_sum": round(sum(q) / 1e3, 1),
        "top": [(n, round(us / 1e3, 2)) for n, us in s["names"].most_common(8)],
    }
print(json.dumps(summary, indent=1))
with open(os.path.join(out, f"summary-{arch}.json"), "w") as f:
    json.dump(summary, f, indent=1)
