"""Does the loader slow the step it hides behind? Two studies, each with its baseline in the run.

    python benchmarks/beside_step.py                 # H100: ~3 min
    python benchmarks/beside_step.py --quick         # ~1 min

1. **GEMM step**: a bf16 GEMM step at least as long as one batch's pinned H2D, fed device-resident
   batches (the baseline, timed again right before every run of a feed) and by each loader:
   TensorDataset (the C++ loop, and the Python pipeline for comparison), ArrayDataset (page
   cache mapped: gather kernel or copy engines; not mapped: the pinned ring) and RecordDataset.
   Reported: step time over the device-resident step, the median of each run's ratio to the
   resident run before it (target <= 1.05x for each source at its defaults; the rows that force
   a route compare).
2. **Launch-bound thread**: a training thread launching tiny kernels, K per batch, with K set
   so the launches take as long as the loader needs per batch at its full rate. Reported:
   launches/s beside each loader over launches/s alone, the median of ``--launch-repeats``
   alone/beside pairs (target >= 0.95; the thread's own rate swings ~10% between runs), and the
   thread's CPU seconds over its wall seconds while it launches: below 1 where the loader made it
   wait (for the GIL or a lock), 1 where only the busy link slowed it (the bare copy's row).

Each configuration runs ``--repeats`` times; the median and the spread are printed.
"""

from __future__ import annotations

import math
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import torch_fastload
from torch_fastload import ArrayDataset, DataLoader, RecordDataset, pack
from torch_fastload._benchutil import (
    InflightWindow,
    Study,
    gemm_seconds,
    h2d_copy_seconds,
    log,
    needs_cuda,
    parse_study,
    study_parser,
    table,
    warm_page_cache,
)

OUT = Path(__file__).resolve().parent / "out"


def parse_args(argv=None):
    p = study_parser(__doc__, OUT)
    p.add_argument("--row-kib", type=int, default=192, help="bytes of one sample (KiB) [192]")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--data-gib", type=float, default=None, help="size of each dataset [2 | 0.5 quick]")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run [120 | 60 quick]")
    p.add_argument("--repeats", type=int, default=None, help="runs of each configuration [3 | 2 quick]")
    p.add_argument(
        "--launch-repeats",
        type=int,
        default=None,
        help="alone/beside pairs of each launch-bound configuration (its rate swings ~10%% a run) [9 | 4 quick]",
    )
    p.add_argument("--only", default="", help="comma-separated feed names to run (default: all)")
    return parse_study(
        p, argv, data_gib=(2.0, 0.5, 0.01), steps=(120, 60, 10), repeats=(3, 2, 1), launch_repeats=(9, 4, 1)
    )


# -- data ------------------------------------------------------------------------------------
def make_data(root: Path, rows: int, row_bytes: int) -> dict:
    rng = np.random.default_rng(0)
    data = torch.from_numpy(rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8))
    np.save(root / "rows.npy", data.numpy())
    pack((data[i].numpy().tobytes() for i in range(rows)), root / "pack", progress=False)
    warm_page_cache([root / "rows.npy", *sorted((root / "pack").glob("*"))])
    return {"tensor": data, "npy": root / "rows.npy", "pack": root / "pack"}


#: The feeds at the loader's defaults (the issue's floors are about these); the other rows force a
#: route for comparison.
DEFAULT_FEEDS = (
    "TensorDataset (C++ loop, default: auto)",
    "ArrayDataset mapped (default: auto)",
    "ArrayDataset ring",
    "RecordDataset mapped",
)


def feeds(data: dict, batch_size: int, device: torch.device) -> dict:
    """name -> a function making a fresh loader (each returns batches whose first field is rows)."""
    common = dict(batch_size=batch_size, shuffle=True, drop_last=True, device=device)
    tensors = torch.utils.data.TensorDataset(data["tensor"])

    def with_config(make, **options):
        def build():
            with torch_fastload.config.override(**options):
                return make()

        return build

    return {
        "TensorDataset (C++ loop, copy engines)": with_config(lambda: DataLoader(tensors, **common), memory_rows="dma"),
        "TensorDataset (C++ loop, default: auto)": lambda: DataLoader(tensors, **common),
        "TensorDataset (C++ loop, gather kernel)": with_config(
            lambda: DataLoader(tensors, **common), memory_rows="kernel"
        ),
        "TensorDataset (C++ loop, CPU gather)": with_config(
            lambda: DataLoader(tensors, **common), memory_rows="gather"
        ),
        "TensorDataset (Python pipeline)": with_config(lambda: DataLoader(tensors, **common), native="off"),
        "ArrayDataset mapped (default: auto)": lambda: DataLoader(ArrayDataset(data["npy"]), **common),
        "ArrayDataset mapped, kernel": with_config(
            lambda: DataLoader(ArrayDataset(data["npy"]), **common), mapped_copy="kernel"
        ),
        "ArrayDataset mapped, copy engines": with_config(
            lambda: DataLoader(ArrayDataset(data["npy"]), **common), mapped_copy="dma"
        ),
        "ArrayDataset ring": lambda: DataLoader(ArrayDataset(data["npy"]), map_budget=0, **common),
        "RecordDataset mapped": lambda: DataLoader(RecordDataset(data["pack"]), **common),
    }


def first_field(batch) -> torch.Tensor:
    while isinstance(batch, (list, tuple)):
        batch = batch[0]
    return batch


# -- study 1: a GEMM step as long as one batch's transfer ---------------------------------------
class GemmStep:
    def __init__(self, seconds: float, device: torch.device):
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        one = gemm_seconds(self.a, self.b, warmup=10)
        # At least as long as the transfer: a step any shorter cannot hide a batch a step,
        # whatever the loader (the link alone would set the pace).
        self.gemms = max(1, math.ceil(seconds / one))
        self.seconds = self.gemms * one

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        acc = batch.view(-1)[:: max(1, batch.numel() // 1024)].float().sum()  # reads the batch
        for _ in range(self.gemms):
            self.a @ self.b
        return acc


def time_steps(batches, step, steps: int, warmup: int = 40) -> float:
    """Median-free wall time per step over ``steps`` steps after ``warmup`` (the warm-up covers
    the loader's start and its memory_rows='auto' window). The host runs at most 2 steps ahead
    of the GPU, waiting on an event: reading a result with ``.item()`` would wait for the whole
    stream instead, so every step would also pay the host's ``next()`` and launches."""
    it = iter(batches)
    window = InflightWindow(torch.device("cuda"), 2)
    for i in range(warmup + steps):
        if i == warmup:
            window.drain()
            started = time.perf_counter()
        step(first_field(next(it)))
        window.step_done()
    window.drain()
    return (time.perf_counter() - started) / steps


def endless(make, paths: list | None = None, edges: list | None = None):
    """Batches of one loader, epoch after epoch (as a training run reuses its loader); its
    ``stats().path`` (the routes it chose) is appended to ``paths`` after each epoch, and the
    seconds of each epoch's edge to ``edges``: the next() that ends an epoch, iter() and the
    next epoch's first next(), what the training thread pays there instead of one next()."""
    loader = make()
    it = iter(loader)
    while True:
        asked = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            ended = time.perf_counter()
            if paths is not None and hasattr(loader, "stats"):
                paths.append(loader.stats().path)
            asked_again = time.perf_counter()  # the stats' own time is not the edge's
            it = iter(loader)
            batch = next(it)
            if edges is not None:
                edges.append(ended - asked + time.perf_counter() - asked_again)
        yield batch


def study_gemm(data, args, device) -> dict:
    batch_bytes = args.batch_size * args.row_kib * 1024
    src = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(batch_bytes, dtype=torch.uint8, device=device)
    transfer = statistics.median(h2d_copy_seconds(src, dst, reps=10))
    step = GemmStep(transfer, device)
    log(f"GEMM step: {step.gemms} x bf16 4096^3 = {step.seconds * 1e3:.2f} ms; batch transfer {transfer * 1e3:.2f} ms")
    resident = [data["tensor"][i * args.batch_size : (i + 1) * args.batch_size].to(device) for i in range(8)]
    baseline: list = []  # every device-resident run, each timed right before a feed's run

    def paired(batches) -> tuple[list, list]:
        """``args.repeats`` runs of a feed (``batches()`` makes its batches), each right after a
        device-resident run: the runs and their ratios to the resident run beside them (one
        resident figure for every feed swings with the machine's state between rows)."""
        runs, ratios = [], []
        for _ in range(args.repeats):
            base = time_steps((resident[i % 8] for i in range(10**9)), step, args.steps)
            baseline.append(base)
            runs.append(time_steps(batches(), step, args.steps))
            ratios.append(runs[-1] / base)
        return runs, ratios

    # The link's own cost: resident batches while a pinned copy of one batch runs beside every
    # step on another stream (what any loader moving a batch per step must at least pay).
    side = torch.cuda.Stream()

    def resident_with_link_busy():
        for i in range(10**9):
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            yield resident[i % 8]

    routes: dict = {}  # feed -> the loader's stats().path after each epoch (its routes)
    edges: dict = {}  # feed -> seconds of each epoch's edge on the training thread
    rows, ratios = {}, {}
    name = "device-resident + a batch H2D beside"
    rows[name], ratios[name] = paired(resident_with_link_busy)
    for name, make in selected(feeds(data, args.batch_size, device), args.only).items():
        routes[name], edges[name] = [], []
        rows[name], ratios[name] = paired(lambda make=make, name=name: endless(make, routes[name], edges[name]))
        edge = f"; an epoch's edge {statistics.median(edges[name]) * 1e3:.2f} ms" if edges[name] else ""
        step_ms = statistics.median(rows[name]) * 1e3
        log(f"  {name}: {step_ms:.2f} ms/step ({statistics.median(ratios[name]):.3f}x){edge}")
    rows = {"device-resident": baseline, **rows}
    return {
        "transfer_ms": transfer * 1e3,
        "step_ms": step.seconds * 1e3,
        "runs_ms": {k: [v * 1e3 for v in vals] for k, vals in rows.items()},
        "pair_ratios": ratios,
        "ratio": {"device-resident": 1.0, **{k: statistics.median(v) for k, v in ratios.items()}},
        "routes": {k: sorted(set(v)) for k, v in routes.items()},
        "edge_ms": {k: statistics.median(v) * 1e3 for k, v in edges.items() if v},
        "batches_per_epoch": len(data["tensor"]) // args.batch_size,
    }


# -- study 2: a launch-bound training thread ---------------------------------------------------
WARMUP_STEPS = 40  # untimed: past the loader's start and its memory_rows='auto' window (~32 batches)


def launch_loop(kernels: int, steps: int, device, batches=None) -> dict:
    """The thread's own launch rate (launches per second of launching), timed over its launch
    loops only, so a loader that falls behind (the thread waits in next()) does not count as one
    that slows the launches; its seconds a step in next(); its CPU seconds over its wall seconds
    while launching (below 1: it waited, for the GIL or a lock; a busy link slows it without a
    wait) and its voluntary context switches a step while launching."""
    x = torch.zeros(1, device=device)
    it = iter(batches) if batches is not None else None
    launching = waiting = cpu = 0.0
    switches = 0
    for i in range(steps + WARMUP_STEPS):
        t0 = time.perf_counter()
        if it is not None:
            next(it)
        before = _voluntary_switches()
        t1, c1 = time.perf_counter(), time.thread_time()
        for _ in range(kernels):
            x.add_(1)
        t2, c2 = time.perf_counter(), time.thread_time()
        if i >= WARMUP_STEPS:
            waiting += t1 - t0
            launching += t2 - t1
            cpu += c2 - c1
            switches += _voluntary_switches() - before
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "rate": kernels * steps / launching,
        "next_s": waiting / steps,
        "cpu_over_wall": cpu / launching,
        "waits_per_step": switches / steps,
    }


def _voluntary_switches() -> int:
    """The calling thread's voluntary context switches so far (0 where the OS does not count them)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nvcsw if who is not None else 0


def launches_per_second(kernels: int, steps: int, device, batches=None) -> tuple[float, float]:
    """(launches per second of launching, seconds per batch spent in next()): ``launch_loop``'s."""
    run = launch_loop(kernels, steps, device, batches)
    return run["rate"], run["next_s"]


def loader_rate(make, batches: int) -> float:
    it = endless(make)
    for _ in range(5):
        next(it)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(batches):
        next(it)
    torch.cuda.synchronize()
    return batches / (time.perf_counter() - started)


LINK_ONLY = "raw pinned H2D of a batch beside (no loader)"


def _link_busy_batches(resident, args, device):
    """Ready device-resident batches, each handed out with a pinned copy of one batch enqueued
    on a side stream: the link's own cost to the launching thread (the baseline a loader can at
    best match, as it moves the same bytes)."""
    batch_bytes = args.batch_size * args.row_kib * 1024
    src = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(batch_bytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    done = None
    for i in range(10**9):
        if done is not None:
            done.synchronize()  # one copy in flight, as a loader keeps the link busy, not queued deep
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        yield resident[i % len(resident)]


def study_launches(data, args, device) -> dict:
    """For each loader: K launches a batch, K such that the launches take as long as the loader
    needs per batch at its full rate; the thread's launch rate beside the loader over its rate
    with the same K taking ready device-resident batches (the baseline, measured alternately)."""
    resident = [data["tensor"][i * args.batch_size : (i + 1) * args.batch_size].to(device) for i in range(4)]
    keys = "alone beside ratio pair_ratios kernels_per_batch next_ms routes cpu_over_wall waits_per_step"
    out: dict = {key: {} for key in keys.split()}
    candidates = {LINK_ONLY: lambda: _link_busy_batches(resident, args, device)}
    candidates.update(selected(feeds(data, args.batch_size, device), args.only))
    for name, make in candidates.items():
        rate = loader_rate(make, max(20, args.steps // 2))
        kernels = max(1, round(launches_per_second(2000, 10, device)[0] / rate))
        alone, beside, runs = [], [], []
        for _ in range(args.launch_repeats):
            alone.append(launches_per_second(kernels, args.steps, device, (resident[i % 4] for i in range(10**9)))[0])
            paths = out["routes"].setdefault(name, [])
            feed = endless(make, paths) if name != LINK_ONLY else make()
            runs.append(launch_loop(kernels, args.steps, device, feed))
            beside.append(runs[-1]["rate"])
        out["alone"][name], out["beside"][name] = alone, beside
        out["next_ms"][name] = statistics.median(r["next_s"] for r in runs) * 1e3
        out["cpu_over_wall"][name] = statistics.median(r["cpu_over_wall"] for r in runs)
        out["waits_per_step"][name] = statistics.median(r["waits_per_step"] for r in runs)
        out["kernels_per_batch"][name] = kernels
        out["pair_ratios"][name] = [b / a for a, b in zip(alone, beside)]
        out["ratio"][name] = statistics.median(out["pair_ratios"][name])
        log(
            f"  {name}: loader {rate:.0f} batches/s alone, {kernels} launches a batch, "
            f"{statistics.median(beside) / 1e3:.0f} k launches/s beside vs {statistics.median(alone) / 1e3:.0f} k "
            f"alone ({out['ratio'][name]:.3f}x), next() {out['next_ms'][name]:.3f} ms a batch, "
            f"CPU / wall while launching {out['cpu_over_wall'][name]:.3f}"
        )
    return out


def selected(all_feeds: dict, only: str) -> dict:
    names = [n.strip() for n in only.split(",") if n.strip()]
    return {k: v for k, v in all_feeds.items() if not names or any(n in k for n in names)}


def spread(values) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not needs_cuda(args, "beside_step.py (GPU steps beside each loader)"):
        return 2
    device = args.device
    row_bytes = args.row_kib * 1024
    rows = max(4 * args.batch_size, int(args.data_gib * 2**30) // row_bytes)
    study = Study("beside_step", args, "loaders beside a step")
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        log(f"data: {rows} rows x {args.row_kib} KiB ({rows * row_bytes / 2**30:.2f} GiB), batch {args.batch_size}")
        data = make_data(Path(tmp), rows, row_bytes)
        gemm = study["gemm"] = study_gemm(data, args, device)
        launches = study["launches"] = study_launches(data, args, device)
    for name, ratio in gemm["ratio"].items():
        if name != "device-resident":
            study.figure(f"gemm_step_vs_resident:{name}", ratio)
            if name in DEFAULT_FEEDS:
                study.verdict(f"GEMM step fed by {name} <= 1.05x device-resident", ratio <= 1.05, f"{ratio:.3f}x")
    link = launches["ratio"].get(LINK_ONLY)
    for name, ratio in launches["ratio"].items():
        study.figure(f"launch_rate_vs_alone:{name}", ratio)
        if name in DEFAULT_FEEDS:
            study.verdict(f"launch-bound thread beside {name} >= 0.95x alone", ratio >= 0.95, f"{ratio:.3f}x")
        if link:
            study.figure(f"launch_rate_vs_link_only:{name}", ratio / link)
    return study.finish(gemm_table(gemm), launch_table(launches), plot=plot)


def plot(data: dict, plt):
    """The GEMM step over device-resident, and the launch rate over alone, per loader."""
    gemm, launches = data["gemm"]["ratio"], data["launches"]["ratio"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(gemm) + 2))
    left.barh(list(gemm), list(gemm.values()), color="tab:blue")
    left.axvline(1.05, color="tab:red", linestyle="--", label="target 1.05x")
    left.set_xlabel("GEMM step time / device-resident")
    left.legend()
    right.barh(list(launches), list(launches.values()), color="tab:green")
    right.axvline(0.95, color="tab:red", linestyle="--", label="target 0.95x")
    right.set_xlabel("launch rate beside the loader / alone")
    right.legend()
    fig.tight_layout()
    return fig


def gemm_table(gemm: dict) -> str:
    rows = [
        [
            k,
            f"{statistics.median(v):.2f}",
            spread(v),
            f"{gemm['ratio'][k]:.3f}x",
            f"{gemm['edge_ms'][k]:.2f}" if k in gemm.get("edge_ms", {}) else "-",
            chosen_routes(gemm.get("routes", {}).get(k)),
        ]
        for k, v in gemm["runs_ms"].items()
    ]
    base = statistics.median(gemm["runs_ms"]["device-resident"])
    return table(
        ["feed", "step ms (median)", "spread", "vs device-resident", "epoch edge ms", "route"],
        rows,
        title=f"GEMM step ({gemm['step_ms']:.2f} ms of GEMMs, batch transfer {gemm['transfer_ms']:.2f} ms) beside "
        f"each loader (device-resident {base:.2f} ms; each run's ratio to a resident run just before it, "
        f"the median of those; epoch edge: the training thread's time from the next() that ends an epoch "
        f"to the next epoch's first batch, every {gemm.get('batches_per_epoch', '?')} batches)",
    )


def chosen_routes(paths) -> str:
    """The routes a loader's ``stats().path`` names (its parenthesised notes, without what the
    choice saw: the JSON keeps whole paths), over its runs."""
    notes = {p.split(" (", 1)[1].removesuffix(")").split(", the GPU")[0] for p in paths or () if " (" in p}
    return "; ".join(sorted(notes)) or "-"


def launch_table(launches: dict) -> str:
    rows = [
        [
            k,
            launches["kernels_per_batch"][k],
            f"{statistics.median(v) / 1e3:.0f}",
            f"{launches['ratio'][k]:.3f}",
            f"{launches['next_ms'][k]:.3f}",
            _optional(launches.get("cpu_over_wall", {}).get(k), "{:.3f}"),
            _optional(launches.get("waits_per_step", {}).get(k), "{:.1f}"),
            chosen_routes(launches.get("routes", {}).get(k)),
        ]
        for k, v in launches["beside"].items()
    ]
    return table(
        ["feed", "launches a batch", "k launches/s", "vs alone", "next() ms", "CPU / wall", "waits a step", "route"],
        rows,
        title="launch-bound thread beside each loader at its full rate (vs the same launches alone, timed just "
        "before: the median of those pairs' ratios; CPU / wall: the thread's CPU seconds over its wall seconds "
        "while launching, below 1 where it waited for the GIL or a lock, and its voluntary switches a step "
        "then; a busy link slows it without a wait, as the bare copy's row shows)",
    )


def _optional(value, spec: str) -> str:
    return spec.format(value) if value is not None else "-"


if __name__ == "__main__":
    raise SystemExit(main())
