"""Issue 17: where the launch-bound thread's time goes beside a loader: CPU placement, the GIL,
the driver calls.

beside_step.py's launch-bound study, with the thread's own CPU time recorded. For each feed (the
bare pinned copy, and the loaders at their defaults), ROUNDS rounds: the thread alone, then beside
the feed in each of MODES (order reversed every other round):
  beside            the defaults;
  turns in next()   config turn_thread=0 (the group turns inside next(), not on a thread);
  isolated          the defaults, the launching thread pinned to one CPU, every other thread of
                    the process kept off that CPU and its SMT siblings;
  config:K=V;K2=V2  the defaults with these config options (e.g. config:io_task_size=16MiB);
  env:K=V           the defaults with these environment variables set while the loader is made
                    and run (e.g. env:TORCH_FASTLOAD_RING_WAIT=block, read when its ring is made);
  native:NAME=INT   the defaults with torch_fastload.native.NAME set (an A/B's before, e.g.
                    native:SMALL_SLOT_BYTES=0: the loop's slots as pool_slots says).
Each run times K launches a batch (K as in beside_step.py; LAUNCH_SCALE multiplies it, so the
loader runs at that fraction of its full rate) and records: launches/s over its launch loops (the
issue's figure), steps/s with next() counted too, the thread's CPU seconds over its wall seconds
while launching (below 1: it waited, for the GIL or a lock), its voluntary and involuntary context
switches. The loader's own batches/s in each mode is measured after each of its runs.

LAUNCHERS="python,native" repeats every run with the launches made by a C loop (ctypes, the GIL
released for all K launches of a step, cuLaunchKernel of a one-thread kernel on the same
stream): what a loader costs a thread that never waits for the GIL while it launches, so the
two launchers' gap beside a loader is the GIL's share of its cost and the native launcher's
own gap to alone is the driver's and the link's.

COUNT=1 counts the engine's own driver calls (TORCH_FASTLOAD_COUNT_DRIVER_CALLS) and reports
them a step, made by the launching thread (its next()) and by the loader's threads, by entry
point (torch's own calls, e.g. its allocator's, are not counted).

    python3 benchmarks/gpu/launch_cpu_probe.py [ROUNDS]      # JSON on stdout's last line
    env FEEDS="bare,TensorDataset,ArrayDataset mapped,ArrayDataset ring,RecordDataset" DATA_GIB=1
        (also "bare [thread] [xN]": the bare copy in N pieces, made by a thread of its own;
        "TensorDataset labels": the rows with a label each)
        MODES="beside,turns in next()" LAUNCH_SCALE=1 LAUNCHERS=python
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch

import torch_fastload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import beside_step as bs  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
COUNT = os.environ.get("COUNT") == "1"
if COUNT:  # read once, at the engine's first driver call
    os.environ["TORCH_FASTLOAD_COUNT_DRIVER_CALLS"] = "1"
BATCH, ROW_KIB, STEPS = 256, 192, 120
device = torch.device("cuda")


def siblings(cpu: int) -> set[int]:
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        out: set[int] = set()
        for part in path.read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out
    except OSError:
        return {cpu}


CPUS = sorted(os.sched_getaffinity(0))
LAUNCH_CPU = CPUS[-1]
KEEP_OFF = siblings(LAUNCH_CPU)
OTHERS = set(CPUS) - KEEP_OFF


def tasks() -> dict[int, tuple[int, int]]:
    """tid -> (CPU ticks used, the CPU it last ran on), for every thread of the process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12]), int(fields[36]))
    return out


def place(isolated: bool) -> None:
    me = threading.get_native_id()
    for tid in tasks():
        try:
            if not isolated:
                os.sched_setaffinity(tid, CPUS)
            else:
                os.sched_setaffinity(tid, {LAUNCH_CPU} if tid == me else OTHERS)
        except OSError:
            pass  # the thread ended


_LAUNCH_C = r"""
#include <dlfcn.h>
typedef int (*launch_fn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
static launch_fn launch;
int launch_n(void* function, void* stream, int n, void* x) {
  if (!launch) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib || !(launch = (launch_fn)dlsym(lib, "cuLaunchKernel"))) return -1;
  }
  void* params[] = {&x};
  for (int i = 0; i < n; ++i) {
    int r = launch(function, 1, 1, 1, 1, 1, 1, 0, stream, params, 0);
    if (r) return r;
  }
  return 0;
}
"""
_BUMP = 'extern "C" __global__ void bump(float* x) { x[0] += 1.0f; }'


def native_launcher(workdir: Path):
    """launch(x, k): k launches of a one-thread kernel bumping ``x`` on the current stream, from a
    C loop that ctypes runs without the GIL (as x.add_(1) k times, minus Python and the GIL)."""
    src, lib = workdir / "launch_n.c", workdir / "launch_n.so"
    src.write_text(_LAUNCH_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True)
    launch_n = ctypes.CDLL(str(lib)).launch_n
    launch_n.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    function = torch.cuda._compile_kernel(_BUMP, "bump").func.value

    def launch(x: torch.Tensor, k: int) -> None:
        code = launch_n(function, torch.cuda.current_stream().cuda_stream, k, x.data_ptr())
        if code:
            raise RuntimeError(f"cuLaunchKernel returned {code}")

    return launch


def python_launch(x: torch.Tensor, k: int) -> None:
    for _ in range(k):
        x.add_(1)


def driver_calls() -> dict:
    """{thread id: {entry point: calls}} of the engine so far (empty unless COUNT=1)."""
    if not COUNT:
        return {}
    from torch_fastload import engine

    return engine._require().driver_call_counts()


def calls_per_step(before: dict, after: dict, me: int, steps: int) -> dict:
    """{"training": {entry: calls a step}, "loader": {...}}: the launching thread's (next()) and
    every other thread's driver calls over the timed steps."""
    out: dict = {"training": {}, "loader": {}}
    for tid, calls in after.items():
        side = out["training" if tid == me else "loader"]
        for name, n in calls.items():
            n -= before.get(tid, {}).get(name, 0)
            if n:
                side[name] = side.get(name, 0) + n / steps
    return out


def link_busy(resident, pieces: int, threaded: bool):
    """beside_step's bare pinned copy a batch, as ``pieces`` copies and one event record, made by
    the launching thread in next() or by a thread of its own (one batch ahead, as a loader's):
    what another thread's submissions alone cost the launching thread, with no loader code."""
    batch_bytes = BATCH * ROW_KIB * 1024
    src = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(batch_bytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    step = -(-batch_bytes // pieces)

    def one_batch():
        with torch.cuda.stream(side):
            for at in range(0, batch_bytes, step):
                dst[at : at + step].copy_(src[at : at + step], non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()  # one batch in flight, as a loader keeps the link busy, not queued deep

    if not threaded:
        for i in range(10**9):
            one_batch()
            yield resident[i % len(resident)]
    import queue

    tokens: queue.Queue = queue.Queue(maxsize=2)
    ended = threading.Event()

    def copier():
        while not ended.is_set():
            try:
                tokens.get(timeout=0.1)
            except queue.Empty:
                continue
            one_batch()

    thread = threading.Thread(target=copier, daemon=True)
    thread.start()
    try:
        for i in range(10**9):
            tokens.put(i)
            yield resident[i % len(resident)]
    finally:
        ended.set()
        thread.join()


def launch_run(kernels: int, batches, isolated: bool = False, launch=python_launch, steps: int = STEPS) -> dict:
    """bs.launches_per_second's loop, placed after its warm-up (the loader's threads exist then)."""
    x = torch.zeros(1, device=device)
    it = iter(batches)
    me = threading.get_native_id()
    wall = cpu = waiting = 0.0
    for i in range(steps + bs.WARMUP_STEPS):
        if i == bs.WARMUP_STEPS:
            place(isolated)
            before, ru, counted = tasks(), resource.getrusage(resource.RUSAGE_THREAD), driver_calls()
        t0 = time.perf_counter()
        next(it)
        t1, c1 = time.perf_counter(), time.thread_time()
        launch(x, kernels)
        t2, c2 = time.perf_counter(), time.thread_time()
        if i >= bs.WARMUP_STEPS:
            wall += t2 - t1
            cpu += c2 - c1
            waiting += t1 - t0
    after, ru2, counted_after = tasks(), resource.getrusage(resource.RUSAGE_THREAD), driver_calls()
    t3 = time.perf_counter()
    torch.cuda.current_stream().synchronize()  # the launches' stream only (not the loader's queue)
    lag = time.perf_counter() - t3  # well above a launch: the GPU, not the thread, set the pace
    torch.cuda.synchronize()
    place(False)
    my_cpu = after.get(me, (0, -1))[1]
    near = siblings(my_cpu) if my_cpu >= 0 else set()
    busy_near = sum(
        1 for tid, (ticks, on) in after.items() if tid != me and on in near and ticks > before.get(tid, (ticks, 0))[0]
    )
    return {
        "rate": kernels * steps / wall,
        "steps_per_s": steps / (wall + waiting),
        "next_ms": waiting / steps * 1e3,
        "cpu_over_wall": cpu / wall,
        "gpu_lag_ms": lag * 1e3,
        "voluntary_switches": ru2.ru_nvcsw - ru.ru_nvcsw,
        "involuntary_switches": ru2.ru_nivcsw - ru.ru_nivcsw,
        "busy_threads_on_its_core": busy_near,
        "cpu": my_cpu,
        "driver_calls_per_step": calls_per_step(counted, counted_after, me, steps) if COUNT else None,
    }


def in_mode(mode: str) -> contextlib.ExitStack:
    """The config (and environment) of one beside run in ``mode``."""
    import torch_fastload

    options: dict = {}
    env: dict = {}
    attributes: dict = {}
    if mode == "turns in next()":
        options["turn_thread"] = False
    elif mode.startswith(("config:", "env:", "native:")):
        into = {"config": options, "env": env, "native": attributes}[mode.partition(":")[0]]
        for item in mode.partition(":")[2].split(";"):
            key, _, value = item.partition("=")
            into[key.strip()] = value.strip()
    stack = contextlib.ExitStack()
    for name, value in attributes.items():
        stack.enter_context(mock.patch.object(torch_fastload.native, name, int(value)))
    stack.enter_context(mock.patch.dict(os.environ, env))
    stack.enter_context(torch_fastload.config.override(**options))
    return stack


def main() -> None:
    print(f"CPUs {CPUS[0]}-{CPUS[-1]} ({len(CPUS)}); launching CPU {LAUNCH_CPU}, kept off {sorted(KEEP_OFF)}")
    every = "bare,TensorDataset,ArrayDataset mapped,ArrayDataset ring,RecordDataset"
    wanted = [f.strip() for f in os.environ.get("FEEDS", every).split(",")]
    modes = [m.strip() for m in os.environ.get("MODES", "beside,turns in next()").split(",")]
    rows = max(4 * BATCH, int(float(os.environ.get("DATA_GIB", "1")) * 2**30) // (ROW_KIB * 1024))
    result: dict = {"launch_cpu": LAUNCH_CPU, "kept_off": sorted(KEEP_OFF), "cpus": len(CPUS), "feeds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = bs.make_data(Path(tmp), rows, ROW_KIB * 1024)
        resident = [data["tensor"][i * BATCH : (i + 1) * BATCH].to(device) for i in range(4)]
        args = type("Args", (), {"batch_size": BATCH, "row_kib": ROW_KIB})()
        defaults = {k: v for k, v in bs.feeds(data, BATCH, device).items() if k in bs.DEFAULT_FEEDS}
        candidates = {}
        for want in wanted:
            if want == "bare":
                candidates["bare"] = lambda: bs._link_busy_batches(resident, args, device)
            elif want.startswith("bare "):  # "bare [thread] [xN]": link_busy's variants
                words = want.split()
                pieces = int(next((w[1:] for w in words if w.startswith("x")), "1"))
                candidates[want] = lambda p=pieces, t="thread" in words: link_busy(resident, p, t)
            elif want == "TensorDataset labels":  # rows and their labels (packed in the loop's pinned slot)
                candidates[want] = lambda: torch_fastload.DataLoader(
                    torch.utils.data.TensorDataset(data["tensor"], torch.arange(len(data["tensor"]))),
                    batch_size=BATCH,
                    shuffle=True,
                    drop_last=True,
                    device=device,
                )
            else:
                candidates.update({k: v for k, v in defaults.items() if k.startswith(want)})
        launchers = {"python": python_launch}
        if "native" in os.environ.get("LAUNCHERS", "python"):
            launchers["native"] = native_launcher(Path(tmp))
        for name, make in candidates.items():
            rate = bs.loader_rate(make, 60)
            # LAUNCH_SCALE > 1: steps that hold the GIL longer than the loader needs per batch
            scale = float(os.environ.get("LAUNCH_SCALE", "1"))
            bare = name.startswith("bare")
            feed_modes = ["beside"] if bare else modes
            kernels, alone, labels = {}, {}, {}  # per launcher: K, its alone runs' key, its modes' keys
            for who, launch in launchers.items():
                probe = launch_run(2000, (resident[i % 4] for i in range(10**9)), launch=launch, steps=10)
                kernels[who] = max(1, round(scale * probe["rate"] / rate))
                prefix = "" if who == "python" else f"{who} "
                alone[who] = f"{prefix}alone"
                labels[who] = {mode: f"{prefix}{mode}" for mode in feed_modes}
            loader_rates: dict = {mode: [] for mode in feed_modes}  # the loader alone, each round
            runs: dict = {key: [] for who in launchers for key in [alone[who], *labels[who].values()]}
            for k in range(ROUNDS):
                for who, launch in launchers.items():
                    endless_resident = (resident[i % 4] for i in range(10**9))
                    runs[alone[who]].append(launch_run(kernels[who], endless_resident, launch=launch))
                    for mode in feed_modes if k % 2 == 0 else feed_modes[::-1]:
                        paths: list = []
                        with in_mode(mode):
                            feed = make() if bare else bs.endless(make, paths)
                            isolated = mode == "isolated"
                            runs[labels[who][mode]].append(launch_run(kernels[who], feed, isolated, launch))
                            del feed
                            if not bare and who == "python":
                                loader_rates[mode].append(bs.loader_rate(make, 150))
                        runs[labels[who][mode]][-1]["paths"] = sorted(set(paths))
            summary = {}
            for who in launchers:
                for mode, label in labels[who].items():
                    base, beside = runs[alone[who]], runs[label]
                    pairs = [b["rate"] / a["rate"] for a, b in zip(base, beside)]
                    steps = [b["steps_per_s"] / a["steps_per_s"] for a, b in zip(base, beside)]
                    summary[label] = {
                        "ratio": statistics.median(pairs),
                        "pairs": pairs,
                        "steps_ratio": statistics.median(steps),
                        "loader_mode": mode,
                    }
            result["feeds"][name] = {
                "loader_batches_per_s": rate,
                "kernels": kernels["python"],
                "kernels_by_launcher": kernels,
                "summary": summary,
                "loader_batches_per_s_by_mode": loader_rates,
                "runs": runs,
            }
            print(f"{name}: loader {rate:.0f} batches/s alone, launches a batch {kernels}")
            for mode, rs in runs.items():
                med = lambda key, rs=rs: statistics.median(r[key] for r in rs)  # noqa: E731
                line = (
                    f"  {mode:16s} {med('rate') / 1e3:6.1f} k/s ({min(r['rate'] for r in rs) / 1e3:.0f}-"
                    f"{max(r['rate'] for r in rs) / 1e3:.0f}), next() {med('next_ms'):.3f} ms, "
                    f"cpu/wall {med('cpu_over_wall'):.3f}, GPU lag {med('gpu_lag_ms'):.2f} ms, "
                    f"switches vol {med('voluntary_switches'):.0f} "
                    f"invol {med('involuntary_switches'):.0f}"
                )
                if mode in summary:
                    m = summary[mode]
                    alone_rate = statistics.median(loader_rates[m["loader_mode"]] or [0])
                    line += (
                        f" | vs alone {m['ratio']:.3f} (pairs {min(m['pairs']):.2f}-{max(m['pairs']):.2f}), "
                        f"steps/s {m['steps_ratio']:.3f}, loader alone {alone_rate:.0f} "
                        f"batches/s (median of {len(loader_rates[m['loader_mode']])})"
                    )
                print(line)
                if COUNT and mode != "alone" and not mode.endswith(" alone"):
                    for side in ("training", "loader"):
                        names = sorted({n for r in rs for n in r["driver_calls_per_step"][side]})
                        per = {
                            n: statistics.median(r["driver_calls_per_step"][side].get(n, 0) for r in rs) for n in names
                        }
                        text = ", ".join(f"{n} {v:.1f}" for n, v in sorted(per.items(), key=lambda kv: -kv[1]))
                        print(f"    driver calls a step, {side}: {sum(per.values()):.1f} ({text})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
