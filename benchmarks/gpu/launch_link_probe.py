"""Issue 17: what a busy link alone costs a launch-bound thread (no loader, no other thread).

The thread launches tiny kernels on its own stream while copies it queued beforehand run on a
side stream: nothing else runs on the host, so any loss is the link's or the GPU's, not the
GIL's or the driver lock's. Conditions, alternated over ROUNDS rounds (median launch rate over
the rate alone in the same round):
  h2d 48 MiB      pinned -> device, one copy per 48 MiB (the size of a beside_step batch)
  h2d 4 MiB       the same bytes as 4 MiB copies
  d2h 48 MiB      device -> pinned (the link's other direction)
  d2d 48 MiB      device -> device (copy engines, no PCIe)
  h2d paced 50%   one 48 MiB copy, then as long idle (half the link)
Also the GPU's lag: how long after the last launch the launched work completes (if the GPU
falls behind the launches, the loss is on the device side).

    python3 benchmarks/gpu/launch_link_probe.py [ROUNDS]     # JSON on stdout's last line
"""

import json
import statistics
import sys
import time

import torch

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
LAUNCHES = 5_000  # ~50 ms of launches: the copies queued for it stay within the stream queue
dev = torch.device("cuda")
MiB = 1 << 20
big = 48 * MiB
host = torch.empty(big, dtype=torch.uint8, pin_memory=True)
host_out = torch.empty(big, dtype=torch.uint8, pin_memory=True)
dev_a = torch.empty(big, dtype=torch.uint8, device=dev)
dev_b = torch.empty(big, dtype=torch.uint8, device=dev)
side = torch.cuda.Stream(dev)
x = torch.zeros(1, device=dev)


def copy_seconds(fn, reps=5) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def _h2d_in_4_mib_copies():
    for k in range(0, 48, 4):
        dev_a[k * MiB : (k + 4) * MiB].copy_(host[k * MiB : (k + 4) * MiB], non_blocking=True)


def _h2d_then_idle():
    dev_a.copy_(host, non_blocking=True)
    torch.cuda._sleep(int(T["h2d"] * 1.7e9))  # ~ one copy's time of idle link (cycles at ~1.7 GHz)


#: condition -> (one unit of copies, the key of its time in T, link time it takes in units of that)
UNITS = {
    "h2d 48 MiB": (lambda: dev_a.copy_(host, non_blocking=True), "h2d", 1),
    "h2d 4 MiB": (_h2d_in_4_mib_copies, "h2d", 1),
    "d2h 48 MiB": (lambda: host_out.copy_(dev_a, non_blocking=True), "d2h", 1),
    "d2d 48 MiB": (lambda: dev_b.copy_(dev_a, non_blocking=True), "d2d", 1),
    "h2d paced 50%": (_h2d_then_idle, "h2d", 2),
}


def queue(kind: str, seconds: float) -> None:
    """Copies on the side stream covering ~seconds, queued now."""
    unit, key, spans = UNITS[kind]
    with torch.cuda.stream(side):
        for _ in range(max(1, round(seconds / (spans * T[key])))):
            unit()


def launches_per_second(kind: str | None) -> tuple[float, float]:
    torch.cuda.synchronize()
    if kind:
        queue(kind, 1.5 * LAUNCHES / RATE_ALONE)
    t0 = time.perf_counter()
    for _ in range(LAUNCHES):
        x.add_(1)
    t1 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    lag = time.perf_counter() - t1
    torch.cuda.synchronize()
    return LAUNCHES / (t1 - t0), lag


T = {
    "h2d": copy_seconds(lambda: dev_a.copy_(host, non_blocking=True)),
    "d2h": copy_seconds(lambda: host_out.copy_(dev_a, non_blocking=True)),
    "d2d": copy_seconds(lambda: dev_b.copy_(dev_a, non_blocking=True)),
}
for _ in range(3):
    launches_per_second(None)
RATE_ALONE = statistics.median(launches_per_second(None)[0] for _ in range(3))
KINDS = list(UNITS)
ratios = {k: [] for k in KINDS}
lags = {k: [] for k in ["alone", *KINDS]}
for _ in range(ROUNDS):
    alone, lag = launches_per_second(None)
    lags["alone"].append(lag)
    for kind in KINDS:
        rate, lag = launches_per_second(kind)
        ratios[kind].append(rate / alone)
        lags[kind].append(lag)
print(
    f"{torch.cuda.get_device_name()}: launches alone {RATE_ALONE / 1e3:.0f} k/s; 48 MiB copy h2d "
    f"{big / T['h2d'] / 1e9:.1f} GB/s, d2h {big / T['d2h'] / 1e9:.1f}, d2d {big / T['d2d'] / 1e9:.0f}"
)
for kind in KINDS:
    r = ratios[kind]
    print(
        f"  {kind:14s} launch rate {statistics.median(r):.3f}x alone ({min(r):.3f}-{max(r):.3f}), "
        f"GPU lag after the last launch {statistics.median(lags[kind]) * 1e3:.2f} ms"
    )
print(f"  alone          GPU lag {statistics.median(lags['alone']) * 1e3:.2f} ms")
print(json.dumps({"rate_alone": RATE_ALONE, "copy_s": T, "ratios": ratios, "lag_s": lags}))
